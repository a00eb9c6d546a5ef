/*
 * The data path: RDMA WRITE and READ between processes.
 *
 * Work requests execute synchronously in the posting call (ibv_post_send
 * or ibv_wr_complete), one after another under the QP's lock, so their
 * completions reach the CQ in posting order. Every check is made before a
 * single byte moves: local SGEs against our MRs, the remote QP's record,
 * the rkey's record. Only then does process_vm_writev/readv run, and only
 * over the ranges those checks approved.
 */
#include "emu.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

/* ---- moving bytes ------------------------------------------------------- */

static void report_denied(pid_t pid, int err)
{
	static int told;
	char scope[16] = "absent";
	FILE *f;

	if (__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
		return;
	f = fopen("/proc/sys/kernel/yama/ptrace_scope", "re");
	if (f) {
		if (!fgets(scope, sizeof(scope), f))
			snprintf(scope, sizeof(scope), "?");
		scope[strcspn(scope, "\n")] = '\0';
		fclose(f);
	}
	emu_log("process_vm_readv/writev to pid %d refused (%s). The emulator "
		"moves RDMA data with them: both processes must run as the same "
		"user in the same PID namespace, be dumpable (no setuid, no "
		"PR_SET_DUMPABLE 0), and Yama ptrace_scope must be 0 or 1 (this "
		"library calls prctl(PR_SET_PTRACER_ANY) at load for scope 1). "
		"ptrace_scope here: %s; a seccomp profile may also block these "
		"calls. Failing the work request with IBV_WC_GENERAL_ERR, "
		"vendor_err 0x%x.",
		(int)pid, strerror(err), scope, EMU_VENDOR_ERR_PROCESS_VM_DENIED);
}

/*
 * Copies `total` bytes between our local ranges `local` and [raddr,
 * raddr+total) in process `pid` (which may be us).
 *
 * Why this is safe for both processes:
 *  - The kernel does the copy (process_vm_readv/writev): an address that
 *    is not mapped, or not writable, in either process makes the call fail
 *    with EFAULT instead of faulting; neither process can crash here.
 *  - Every local range was checked against one of our MRs (lkey, PD,
 *    bounds, LOCAL_WRITE for a READ target), or is inline data we copied,
 *    and our MR table is read-locked, so ibv_dereg_mr cannot complete
 *    underneath us.
 *  - The remote range lies inside an MR that the peer registered with the
 *    needed REMOTE_* right, on the PD of the QP we are connected to; its
 *    record is flock(LOCK_SH)ed for the whole call, so the peer's
 *    ibv_dereg_mr waits for us. The peer named that memory as remotely
 *    accessible; we touch nothing else.
 *  - The peer's identity is pid + start time checked just before: a
 *    recycled pid has another start time and was rejected. (Between that
 *    check and the call a pid could in theory be reused; with 4M pids
 *    and a microsecond window this is accepted for a test double.)
 *  - Only a short transfer can be partial: the loop resumes where it
 *    stopped, and stops on any error.
 */
static int transfer(pid_t pid, int is_write, const struct iovec *local, int nlocal,
		    uint64_t raddr, size_t total)
{
	struct iovec l[EMU_MAX_SGE + 1];
	size_t done = 0;

	while (done < total) {
		/* local ranges from `done` on */
		size_t skip = done;
		int n = 0;
		for (int i = 0; i < nlocal; i++) {
			if (skip >= local[i].iov_len) {
				skip -= local[i].iov_len;
				continue;
			}
			l[n].iov_base = (char *)local[i].iov_base + skip;
			l[n].iov_len = local[i].iov_len - skip;
			skip = 0;
			n++;
		}
		struct iovec r = { .iov_base = (void *)(uintptr_t)(raddr + done),
				   .iov_len = total - done };
		ssize_t got = is_write ? process_vm_writev(pid, l, (unsigned long)n, &r, 1, 0)
				       : process_vm_readv(pid, l, (unsigned long)n, &r, 1, 0);
		if (got < 0) {
			if (errno == EINTR)
				continue;
			return errno;
		}
		if (got == 0)
			return EFAULT;
		done += (size_t)got;
	}
	return 0;
}

/* ---- one work request --------------------------------------------------- */

struct outcome {
	int status;
	uint32_t vendor_err;
};

static int has_gid(const struct emu_qp_rec *r, const union ibv_gid *g)
{
	for (int i = 0; i < r->ngids; i++)
		if (!memcmp(r->gids[i].raw, g->raw, 16))
			return 1;
	return 0;
}

static const char *op_name(int op)
{
	return op == IBV_WR_RDMA_READ ? "READ" : "WRITE";
}

/* The remote half: the target QP, its rkey, the transfer. */
static struct outcome remote_part(struct emu_qp *qp, const struct emu_wr *wr,
				  const struct iovec *liov, int nl, size_t total)
{
	uint32_t me = qp->qpx.qp_base.qp_num;
	int is_write = wr->opcode == IBV_WR_RDMA_WRITE;
	unsigned need = is_write ? IBV_ACCESS_REMOTE_WRITE : IBV_ACCESS_REMOTE_READ;
	struct emu_qp_rec r;
	struct emu_mr_rec m;
	int fd, err;

	/* Nobody answers: the requester retries, then gives up. */
	err = emu_fabric_read_qp(qp->dest_qpn, &r);
	if (err || !emu_owner_alive(&r.owner)) {
		emu_debug("QP 0x%06x: remote QP 0x%06x %s", me, qp->dest_qpn,
			  err ? "does not exist" : "belongs to a dead process");
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	}
	if ((r.state != IBV_QPS_RTR && r.state != IBV_QPS_RTS && r.state != IBV_QPS_SQD) ||
	    emu_fabric_qp_error_marked(qp->dest_qpn) || r.dest_qpn != me) {
		emu_debug("QP 0x%06x: remote QP 0x%06x is not connected to us "
			  "(state %d, its remote 0x%06x)",
			  me, qp->dest_qpn, r.state, r.dest_qpn);
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	}
	if (qp->ah.is_global ? !has_gid(&r, &qp->ah.grh.dgid)
			     : (r.link_layer != IBV_LINK_LAYER_INFINIBAND ||
				r.lid != qp->ah.dlid)) {
		emu_debug("QP 0x%06x: address vector does not reach QP 0x%06x's port",
			  me, qp->dest_qpn);
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	}
	if (emu_fabric_port_down(r.guid, r.port)) {
		emu_debug("QP 0x%06x: remote port is down", me);
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	}
	if (total == 0)
		return (struct outcome){ IBV_WC_SUCCESS, 0 }; /* no R_Key check */

	/* From here on the responder judges the request. */
	err = emu_fabric_lock_mr(wr->rkey, &m, &fd);
	if (err) {
		emu_debug("QP 0x%06x: rkey 0x%08x unknown", me, wr->rkey);
		goto access_error;
	}
	if (m.owner.pid != r.owner.pid || m.owner.start != r.owner.start ||
	    m.pd != r.pd) {
		emu_debug("QP 0x%06x: rkey 0x%08x is not on the remote QP's PD", me,
			  wr->rkey);
		close(fd);
		goto access_error;
	}
	if (wr->raddr < m.iova || total > m.length ||
	    wr->raddr - m.iova > m.length - total) {
		emu_debug("QP 0x%06x: %s of %zu bytes at 0x%llx is outside rkey "
			  "0x%08x [0x%llx, +%llu)",
			  me, op_name(wr->opcode), total,
			  (unsigned long long)wr->raddr, wr->rkey,
			  (unsigned long long)m.iova, (unsigned long long)m.length);
		close(fd);
		goto access_error;
	}
	if (!(m.access & need) || !(r.access & need)) {
		emu_debug("QP 0x%06x: %s not allowed by rkey 0x%08x (0x%x) or the "
			  "remote QP (0x%x)",
			  me, op_name(wr->opcode), wr->rkey, m.access, r.access);
		close(fd);
		goto access_error;
	}
	if (m.kind == EMU_MR_DMABUF_UNMAPPED) {
		close(fd);
		return (struct outcome){ IBV_WC_REM_ACCESS_ERR,
					 EMU_VENDOR_ERR_DMABUF_UNMAPPED };
	}
	err = transfer(r.owner.pid, is_write, liov, nl, m.host + (wr->raddr - m.iova),
		       total);
	close(fd);
	switch (err) {
	case 0:
		return (struct outcome){ IBV_WC_SUCCESS, 0 };
	case ESRCH:
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	case EPERM:
	case EACCES:
	case ENOSYS:
		report_denied(r.owner.pid, err);
		return (struct outcome){ IBV_WC_GENERAL_ERR,
					 EMU_VENDOR_ERR_PROCESS_VM_DENIED };
	case EFAULT:
		/* Registered memory was unmapped under its registration (a
		 * real HCA would still reach the pinned pages). Whose? */
		for (int i = 0; i < nl; i++) {
			if (emu_range_mapped((uintptr_t)liov[i].iov_base,
					     liov[i].iov_len, !is_write)) {
				emu_log("QP 0x%06x: local memory of a registered MR is "
					"no longer mapped",
					me);
				return (struct outcome){ IBV_WC_LOC_PROT_ERR, 0 };
			}
		}
		emu_log("QP 0x%06x: pid %d unmapped memory it still has registered "
			"(rkey 0x%08x); the target may be partially written",
			me, (int)r.owner.pid, wr->rkey);
		return (struct outcome){ IBV_WC_REM_ACCESS_ERR, 0 };
	default:
		return (struct outcome){ IBV_WC_GENERAL_ERR, 0 };
	}

access_error:
	/* The responder NAKs and its QP goes to ERR too, with an async event. */
	emu_fabric_mark_qp_error(qp->dest_qpn, "remote access error");
	emu_fabric_send_event(r.fifo, IBV_EVENT_QP_ACCESS_ERR, qp->dest_qpn);
	return (struct outcome){ IBV_WC_REM_ACCESS_ERR, 0 };
}

static struct outcome run(struct emu_qp *qp, const struct emu_wr *wr, uint64_t *len)
{
	struct emu_device *dev = qp->ctx->dev;
	struct iovec liov[EMU_MAX_SGE];
	int nl = 0, is_read = wr->opcode == IBV_WR_RDMA_READ;
	uint64_t total = 0;
	struct outcome out;

	if (qp->hw_state == IBV_QPS_ERR)
		return (struct outcome){ IBV_WC_WR_FLUSH_ERR, 0 };

	/* Faults. WRs 1..N pass, the port is down from WR N+1 on. */
	if (emu_port_is_down(dev, qp->port)) {
		__atomic_add_fetch(&dev->wr_counter, 1, __ATOMIC_RELAXED);
		return (struct outcome){ IBV_WC_RETRY_EXC_ERR, 0 };
	}
	uint64_t nth = __atomic_add_fetch(&dev->wr_counter, 1, __ATOMIC_RELAXED);
	if (dev->fault.wc_error_every && nth % (uint64_t)dev->fault.wc_error_every == 0) {
		emu_debug("fault injected: WR %llu on %s completes with %s",
			  (unsigned long long)nth, dev->ibdev.name,
			  emu_wc_status_name(dev->fault.wc_error_status));
		return (struct outcome){ dev->fault.wc_error_status,
					 EMU_VENDOR_ERR_INJECTED };
	}

	/* The local half. */
	if (wr->flags & IBV_SEND_INLINE) {
		if (is_read)
			return (struct outcome){ IBV_WC_LOC_QP_OP_ERR, 0 };
		if (wr->inline_buf) {
			liov[nl].iov_base = wr->inline_buf;
			liov[nl++].iov_len = wr->inline_len;
			total = wr->inline_len;
		} else {
			for (uint32_t i = 0; i < wr->num_sge; i++) {
				if (!wr->sge[i].length)
					continue;
				liov[nl].iov_base = (void *)(uintptr_t)wr->sge[i].addr;
				liov[nl++].iov_len = wr->sge[i].length;
				total += wr->sge[i].length;
			}
		}
		*len = total;
		return remote_part(qp, wr, liov, nl, total);
	}

	emu_mr_table_rdlock();
	for (uint32_t i = 0; i < wr->num_sge; i++) {
		const struct ibv_sge *s = &wr->sge[i];
		struct emu_mr *mr;

		total += s->length;
		if (!s->length)
			continue;
		mr = emu_mr_lookup_locked(s->lkey);
		if (!mr || mr->pd != qp->pd || s->addr < mr->iova ||
		    s->length > mr->length || s->addr - mr->iova > mr->length - s->length ||
		    (is_read && !(mr->access & IBV_ACCESS_LOCAL_WRITE))) {
			emu_debug("QP 0x%06x: SGE %u (lkey 0x%08x addr 0x%llx len %u) "
				  "is not inside a usable MR of this PD",
				  qp->qpx.qp_base.qp_num, i, s->lkey,
				  (unsigned long long)s->addr, s->length);
			emu_mr_table_unlock();
			return (struct outcome){ IBV_WC_LOC_PROT_ERR, 0 };
		}
		if (mr->kind == EMU_MR_DMABUF_UNMAPPED) {
			emu_mr_table_unlock();
			return (struct outcome){ IBV_WC_LOC_ACCESS_ERR,
						 EMU_VENDOR_ERR_DMABUF_UNMAPPED };
		}
		liov[nl].iov_base = (void *)(mr->host + (uintptr_t)(s->addr - mr->iova));
		liov[nl++].iov_len = s->length;
	}
	*len = total;
	if (total > EMU_MAX_MSG_SZ) {
		emu_mr_table_unlock();
		return (struct outcome){ IBV_WC_LOC_LEN_ERR, 0 };
	}
	out = remote_part(qp, wr, liov, nl, (size_t)total);
	emu_mr_table_unlock();
	return out;
}

static void complete(struct emu_qp *qp, const struct emu_wr *wr, struct outcome o,
		     uint64_t len)
{
	int fails = o.status != IBV_WC_SUCCESS && o.status != IBV_WC_WR_FLUSH_ERR &&
		    qp->hw_state != IBV_QPS_ERR;

	__atomic_add_fetch(&qp->sq_inflight, 1, __ATOMIC_ACQ_REL);
	qp->unsignaled++;
	if (o.status == IBV_WC_SUCCESS && !(wr->flags & IBV_SEND_SIGNALED) &&
	    !qp->sq_sig_all)
		return;
	struct emu_cqe e = {
		.wr_id = wr->wr_id,
		.status = (uint32_t)o.status,
		.opcode = wr->opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ
							 : IBV_WC_RDMA_WRITE,
		.vendor_err = o.vendor_err,
		.byte_len = len > UINT32_MAX ? UINT32_MAX : (uint32_t)len,
		.qp_num = qp->qpx.qp_base.qp_num,
		.wqe_count = qp->unsignaled,
		.ts_ns = emu_now_ns(CLOCK_MONOTONIC),
		.wallclock_ns = emu_now_ns(CLOCK_REALTIME),
		.qp = qp,
	};
	qp->unsignaled = 0;
	emu_cq_push(qp->scq, &e);
	if (fails) {
		/* RC: an error completion moves the QP to ERR; the flushes of
		 * posted receives follow the error CQE, as on hardware. */
		emu_debug("QP 0x%06x: %s wr_id %llu completed with %s",
			  qp->qpx.qp_base.qp_num, op_name(wr->opcode),
			  (unsigned long long)wr->wr_id, emu_wc_status_name(o.status));
		emu_qp_enter_error(qp);
	}
}

/* ---- posting ------------------------------------------------------------ */

/* Errors ibv_post_send itself returns (nothing is executed). */
static int validate(struct emu_qp *qp, const struct emu_wr *wr, uint32_t queued)
{
	if (qp->hw_state != IBV_QPS_RTS && qp->hw_state != IBV_QPS_ERR) {
		emu_debug("QP 0x%06x: post in state %d (needs RTS)",
			  qp->qpx.qp_base.qp_num, qp->hw_state);
		return EINVAL;
	}
	if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_READ) {
		static int told;
		if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED)) {
			if (wr->unsupported)
				emu_log("only RDMA WRITE and READ are emulated; %s is "
					"refused with EOPNOTSUPP",
					wr->unsupported);
			else
				emu_log("only RDMA WRITE and READ are emulated; opcode "
					"%d is refused with EOPNOTSUPP",
					wr->opcode);
		}
		return EOPNOTSUPP;
	}
	if (qp->extended &&
	    !(qp->send_ops & (wr->opcode == IBV_WR_RDMA_READ ? IBV_QP_EX_WITH_RDMA_READ
							     : IBV_QP_EX_WITH_RDMA_WRITE)))
		return EINVAL;
	if (wr->num_sge > qp->cap.max_send_sge || (wr->num_sge && !wr->sge))
		return EINVAL;
	if (wr->flags & IBV_SEND_INLINE) {
		uint64_t t = wr->inline_len;
		for (uint32_t i = 0; !wr->inline_buf && i < wr->num_sge; i++)
			t += wr->sge[i].length;
		if (t > qp->cap.max_inline_data)
			return EINVAL;
	}
	if (__atomic_load_n(&qp->sq_inflight, __ATOMIC_ACQUIRE) + queued + 1 >
	    qp->cap.max_send_wr)
		return ENOMEM; /* send queue full: poll completions first */
	return 0;
}

static void execute_one(struct emu_qp *qp, const struct emu_wr *wr)
{
	uint64_t len = 0;
	struct outcome o = run(qp, wr, &len);

	emu_debug("QP 0x%06x: %s wr_id %llu %llu bytes -> QP 0x%06x rkey 0x%08x: %s",
		  qp->qpx.qp_base.qp_num, op_name(wr->opcode),
		  (unsigned long long)wr->wr_id, (unsigned long long)len,
		  qp->dest_qpn, wr->rkey, emu_wc_status_name(o.status));
	complete(qp, wr, o, len);
}

/* ibv_wr_complete: all or nothing. */
int emu_qp_execute(struct emu_qp *qp, struct emu_wr *wrs, uint32_t n,
		   uint32_t *failed_at)
{
	for (uint32_t i = 0; i < n; i++) {
		int err = validate(qp, &wrs[i], i);
		if (!err && !wrs[i].has_data && wrs[i].opcode >= 0)
			err = EINVAL; /* an opcode without ibv_wr_set_sge* */
		if (err) {
			*failed_at = i;
			return err;
		}
	}
	for (uint32_t i = 0; i < n; i++)
		execute_one(qp, &wrs[i]);
	return 0;
}

int emu_post_send(struct ibv_qp *ibqp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct emu_qp *qp = emu_qp_of(ibqp);
	int err = 0;

	pthread_mutex_lock(&qp->lock);
	emu_qp_sync_remote_error(qp);
	for (; wr; wr = wr->next) {
		struct emu_wr w = {
			.wr_id = wr->wr_id,
			.opcode = (int)wr->opcode,
			.flags = wr->send_flags,
			.rkey = wr->wr.rdma.rkey,
			.raddr = wr->wr.rdma.remote_addr,
			.num_sge = wr->num_sge < 0 ? UINT32_MAX : (uint32_t)wr->num_sge,
			.sge = wr->sg_list,
		};
		err = validate(qp, &w, 0);
		if (err)
			break;
		execute_one(qp, &w);
	}
	if (err && bad)
		*bad = wr;
	pthread_mutex_unlock(&qp->lock);
	return err;
}

/* Receives are held (the emulator carries no SEND), and flushed with
 * IBV_WC_WR_FLUSH_ERR when the QP enters ERR, as hardware does. */
int emu_post_recv(struct ibv_qp *ibqp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	struct emu_qp *qp = emu_qp_of(ibqp);
	int err = 0;

	pthread_mutex_lock(&qp->lock);
	emu_qp_sync_remote_error(qp);
	for (; wr; wr = wr->next) {
		if (qp->hw_state == IBV_QPS_RESET || wr->num_sge < 0 ||
		    (uint32_t)wr->num_sge > qp->cap.max_recv_sge) {
			err = EINVAL;
			break;
		}
		if (qp->rq_n >= qp->cap.max_recv_wr) {
			err = ENOMEM;
			break;
		}
		if (qp->rq_n == qp->rq_cap) {
			uint32_t cap = qp->rq_cap ? qp->rq_cap * 2 : 16;
			struct emu_recv *rq = realloc(qp->rq, cap * sizeof(*rq));
			if (!rq) {
				err = ENOMEM;
				break;
			}
			qp->rq = rq;
			qp->rq_cap = cap;
		}
		qp->rq[qp->rq_n++].wr_id = wr->wr_id;
		if (qp->hw_state == IBV_QPS_ERR)
			emu_qp_flush_recv(qp); /* flushed right away */
	}
	if (err && bad)
		*bad = wr;
	pthread_mutex_unlock(&qp->lock);
	return err;
}
