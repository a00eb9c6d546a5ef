/*
 * RC queue pairs: creation (legacy and extended), the state machine of
 * ibv_modify_qp with the attribute masks the kernel requires, ibv_query_qp,
 * and the ibv_wr_* builder of ibv_qp_ex.
 */
#include "emu.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void emu_qp_table_insert(struct emu_qp *qp);
void emu_qp_table_remove(struct emu_qp *qp);

/* ---- fabric record ------------------------------------------------------ */

void emu_qp_publish(struct emu_qp *qp)
{
	struct emu_device *dev = qp->ctx->dev;
	int port = qp->port ? qp->port : 1;
	const struct emu_port_cfg *pc = &dev->ports[port];
	struct emu_qp_rec r;

	memset(&r, 0, sizeof(r));
	r.owner = emu_self();
	snprintf(r.fifo, sizeof(r.fifo), "%s", qp->ctx->fifo);
	r.guid = dev->node_guid;
	r.port = port;
	r.lid = pc->link_layer == IBV_LINK_LAYER_INFINIBAND ? pc->lid : 0;
	r.link_layer = pc->link_layer;
	for (int i = 0; i < pc->gid_tbl_len; i++)
		if (pc->gids[i].valid)
			r.gids[r.ngids++] = pc->gids[i].gid;
	r.state = qp->hw_state;
	r.dest_qpn = qp->dest_qpn;
	r.pd = qp->pd->id;
	r.access = qp->access;
	int err = emu_fabric_write_qp(qp->qpx.qp_base.qp_num, &r);
	if (err)
		emu_log("cannot update QP 0x%06x in the fabric: %s",
			qp->qpx.qp_base.qp_num, strerror(err));
}

/* Completes every posted receive with IBV_WC_WR_FLUSH_ERR. */
void emu_qp_flush_recv(struct emu_qp *qp)
{
	for (uint32_t i = 0; i < qp->rq_n; i++) {
		struct emu_cqe e = {
			.wr_id = qp->rq[i].wr_id,
			.status = IBV_WC_WR_FLUSH_ERR,
			.opcode = IBV_WC_RECV,
			.qp_num = qp->qpx.qp_base.qp_num,
			.ts_ns = emu_now_ns(CLOCK_MONOTONIC),
			.wallclock_ns = emu_now_ns(CLOCK_REALTIME),
			.qp = qp,
		};
		emu_cq_push(qp->rcq, &e);
	}
	qp->rq_n = 0;
}

/* Like an RC QP entering the error state: posted receives flush. */
void emu_qp_enter_error(struct emu_qp *qp)
{
	if (qp->hw_state == IBV_QPS_ERR)
		return;
	qp->hw_state = IBV_QPS_ERR;
	emu_qp_flush_recv(qp);
	emu_qp_publish(qp);
}

/* A peer's request violated our access rights: on real hardware the
 * responder QP goes to ERR too (and IBV_EVENT_QP_ACCESS_ERR is raised,
 * which the peer already sent to our async FIFO). */
void emu_qp_sync_remote_error(struct emu_qp *qp)
{
	if ((qp->hw_state == IBV_QPS_RTR || qp->hw_state == IBV_QPS_RTS ||
	     qp->hw_state == IBV_QPS_SQD) &&
	    emu_fabric_qp_error_marked(qp->qpx.qp_base.qp_num)) {
		emu_debug("QP 0x%06x: a peer's access error moved it to ERR",
			  qp->qpx.qp_base.qp_num);
		emu_qp_enter_error(qp);
	}
}

/* ---- create / destroy --------------------------------------------------- */

static struct ibv_qp *create_qp(struct emu_pd *pd, void *qp_context,
				struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
				struct ibv_srq *srq, struct ibv_qp_cap *cap,
				enum ibv_qp_type type, int sq_sig_all,
				int extended, uint64_t send_ops)
{
	struct emu_context *ctx = pd->ctx;
	struct emu_qp *qp;
	struct emu_qp_rec rec;
	uint32_t qpn;
	int err;

	if (type != IBV_QPT_RC) {
		static int told;
		if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
			emu_log("only RC queue pairs are emulated (asked for type %d)",
				(int)type);
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (srq) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (!send_cq || !recv_cq || send_cq->context != &ctx->vctx.context ||
	    recv_cq->context != &ctx->vctx.context || !cap ||
	    cap->max_send_wr > EMU_MAX_QP_WR || cap->max_recv_wr > EMU_MAX_QP_WR ||
	    cap->max_send_sge > EMU_MAX_SGE || cap->max_recv_sge > EMU_MAX_SGE ||
	    cap->max_inline_data > EMU_MAX_INLINE) {
		errno = EINVAL;
		return NULL;
	}
	qp = calloc(1, sizeof(*qp));
	if (!qp) {
		errno = ENOMEM;
		return NULL;
	}
	qp->ctx = ctx;
	qp->pd = pd;
	qp->scq = emu_cq_of(send_cq);
	qp->rcq = emu_cq_of(recv_cq);
	qp->cap = *cap;
	qp->sq_sig_all = sq_sig_all;
	qp->extended = extended;
	qp->send_ops = send_ops;
	qp->hw_state = IBV_QPS_RESET;
	qp->port = 1;
	pthread_mutex_init(&qp->lock, NULL);

	memset(&rec, 0, sizeof(rec));
	rec.owner = emu_self();
	snprintf(rec.fifo, sizeof(rec.fifo), "%s", ctx->fifo);
	rec.guid = ctx->dev->node_guid;
	rec.port = 1;
	rec.state = IBV_QPS_RESET;
	rec.pd = pd->id;
	err = emu_fabric_alloc_qpn(&rec, &qpn);
	if (err) {
		emu_log("cannot publish a QP in %s/qp: %s", emu_g.fabric_dir,
			strerror(err));
		pthread_mutex_destroy(&qp->lock);
		free(qp);
		errno = err;
		return NULL;
	}

	struct ibv_qp *b = &qp->qpx.qp_base;
	b->context = &ctx->vctx.context;
	b->qp_context = qp_context;
	b->pd = &pd->pd;
	b->send_cq = send_cq;
	b->recv_cq = recv_cq;
	b->srq = NULL;
	b->handle = qpn;
	b->qp_num = qpn;
	b->state = IBV_QPS_RESET;
	b->qp_type = type;
	pthread_mutex_init(&b->mutex, NULL);
	pthread_cond_init(&b->cond, NULL);
	if (extended)
		emu_qp_init_ex_ops(qp);
	emu_qp_publish(qp);

	__atomic_add_fetch(&pd->refs, 1, __ATOMIC_ACQ_REL);
	__atomic_add_fetch(&qp->scq->refs, 1, __ATOMIC_ACQ_REL);
	__atomic_add_fetch(&qp->rcq->refs, 1, __ATOMIC_ACQ_REL);
	emu_qp_table_insert(qp);
	emu_debug("created RC QP 0x%06x on %s%s", qpn, ctx->dev->ibdev.name,
		  extended ? " (ibv_qp_ex)" : "");
	return b;
}

EMU_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd,
					struct ibv_qp_init_attr *a)
{
	if (!pd || !a) {
		errno = EINVAL;
		return NULL;
	}
	return create_qp((struct emu_pd *)pd, a->qp_context, a->send_cq, a->recv_cq,
			 a->srq, &a->cap, a->qp_type, a->sq_sig_all, 0, 0);
}

#define SUPPORTED_SEND_OPS                                                     \
	(IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |      \
	 IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |                  \
	 IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |        \
	 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD | IBV_QP_EX_WITH_LOCAL_INV |      \
	 IBV_QP_EX_WITH_BIND_MW | IBV_QP_EX_WITH_SEND_WITH_INV)

/* verbs_context->create_qp_ex, reached through the inline ibv_create_qp_ex. */
struct ibv_qp *emu_create_qp_ex(struct ibv_context *c, struct ibv_qp_init_attr_ex *a)
{
	uint32_t known = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS |
			 IBV_QP_INIT_ATTR_CREATE_FLAGS;

	if (!a || !(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd ||
	    a->pd->context != c) {
		errno = EINVAL;
		return NULL;
	}
	if ((a->comp_mask & ~known) ||
	    ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	int extended = !!(a->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS);
	/* Operations beyond WRITE/READ may be requested (sideway asks for
	 * SEND by default); posting them fails with EOPNOTSUPP. */
	if (extended && (a->send_ops_flags & ~(uint64_t)SUPPORTED_SEND_OPS)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	return create_qp((struct emu_pd *)a->pd, a->qp_context, a->send_cq,
			 a->recv_cq, a->srq, &a->cap, a->qp_type, a->sq_sig_all,
			 extended, extended ? a->send_ops_flags : 0);
}

EMU_EXPORT struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *ibqp)
{
	struct emu_qp *qp = emu_qp_of(ibqp);

	if (!ibqp || !qp->extended) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	return &qp->qpx;
}

static void free_batch(struct emu_qp *qp)
{
	for (uint32_t i = 0; i < qp->batch_n; i++) {
		free(qp->batch[i].inline_buf);
		qp->batch[i].inline_buf = NULL;
	}
	qp->batch_n = 0;
}

EMU_EXPORT int ibv_destroy_qp(struct ibv_qp *ibqp)
{
	struct emu_qp *qp;

	if (!ibqp)
		return EINVAL;
	qp = emu_qp_of(ibqp);
	/* Out of the table first (async event lookups), then wait for posts. */
	emu_qp_table_remove(qp);
	pthread_mutex_lock(&qp->lock);
	emu_fabric_remove_qp(ibqp->qp_num);
	emu_cq_scrub_qp(qp->scq, qp);
	if (qp->rcq != qp->scq)
		emu_cq_scrub_qp(qp->rcq, qp);
	free_batch(qp);
	free(qp->batch);
	free(qp->rq);
	pthread_mutex_unlock(&qp->lock);
	__atomic_sub_fetch(&qp->pd->refs, 1, __ATOMIC_ACQ_REL);
	__atomic_sub_fetch(&qp->scq->refs, 1, __ATOMIC_ACQ_REL);
	__atomic_sub_fetch(&qp->rcq->refs, 1, __ATOMIC_ACQ_REL);
	pthread_mutex_destroy(&qp->lock);
	pthread_mutex_destroy(&ibqp->mutex);
	pthread_cond_destroy(&ibqp->cond);
	free(qp);
	return 0;
}

/* ---- modify ------------------------------------------------------------- */

#define A(x) IBV_QP_##x
struct transition {
	int valid;
	int req;
	int opt;
};

/* RC columns of the kernel's qp_state_table (drivers/infiniband/core/verbs.c). */
static const struct transition rc_table[IBV_QPS_ERR + 1][IBV_QPS_ERR + 1] = {
	[IBV_QPS_RESET] = {
		[IBV_QPS_RESET] = { 1, 0, 0 },
		[IBV_QPS_INIT] = { 1, A(PKEY_INDEX) | A(PORT) | A(ACCESS_FLAGS), 0 },
	},
	[IBV_QPS_INIT] = {
		[IBV_QPS_INIT] = { 1, 0, A(PKEY_INDEX) | A(PORT) | A(ACCESS_FLAGS) },
		[IBV_QPS_RTR] = { 1,
				  A(AV) | A(PATH_MTU) | A(DEST_QPN) | A(RQ_PSN) |
					  A(MAX_DEST_RD_ATOMIC) | A(MIN_RNR_TIMER),
				  A(ALT_PATH) | A(ACCESS_FLAGS) | A(PKEY_INDEX) },
	},
	[IBV_QPS_RTR] = {
		[IBV_QPS_RTS] = { 1,
				  A(SQ_PSN) | A(TIMEOUT) | A(RETRY_CNT) | A(RNR_RETRY) |
					  A(MAX_QP_RD_ATOMIC),
				  A(CUR_STATE) | A(ALT_PATH) | A(ACCESS_FLAGS) |
					  A(MIN_RNR_TIMER) | A(PATH_MIG_STATE) },
	},
	[IBV_QPS_RTS] = {
		[IBV_QPS_RTS] = { 1, 0,
				  A(CUR_STATE) | A(ACCESS_FLAGS) | A(ALT_PATH) |
					  A(PATH_MIG_STATE) | A(MIN_RNR_TIMER) },
		[IBV_QPS_SQD] = { 1, 0, A(EN_SQD_ASYNC_NOTIFY) },
	},
	[IBV_QPS_SQD] = {
		[IBV_QPS_RTS] = { 1, 0,
				  A(CUR_STATE) | A(ACCESS_FLAGS) | A(ALT_PATH) |
					  A(MIN_RNR_TIMER) | A(PATH_MIG_STATE) },
		[IBV_QPS_SQD] = { 1, 0,
				  A(PKEY_INDEX) | A(PORT) | A(AV) | A(ACCESS_FLAGS) |
					  A(ALT_PATH) | A(MAX_QP_RD_ATOMIC) |
					  A(MIN_RNR_TIMER) | A(TIMEOUT) | A(RETRY_CNT) |
					  A(RNR_RETRY) | A(MAX_DEST_RD_ATOMIC) |
					  A(PATH_MIG_STATE) },
	},
	[IBV_QPS_SQE] = {
		[IBV_QPS_RTS] = { 1, 0, A(CUR_STATE) | A(ACCESS_FLAGS) },
	},
};

static int transition_ok(int cur, int next, int mask)
{
	struct transition t;

	if (cur < 0 || cur > IBV_QPS_ERR || next < 0 || next > IBV_QPS_ERR)
		return 0;
	if ((mask & A(CUR_STATE)) && cur != IBV_QPS_RTR && cur != IBV_QPS_RTS &&
	    cur != IBV_QPS_SQD && cur != IBV_QPS_SQE)
		return 0;
	if (next == IBV_QPS_RESET || next == IBV_QPS_ERR)
		t = (struct transition){ 1, 0, 0 };
	else
		t = rc_table[cur][next];
	if (!t.valid)
		return 0;
	if ((mask & t.req) != t.req)
		return 0;
	if (mask & ~(t.req | t.opt | A(STATE)))
		return 0;
	return 1;
}

static int check_values(struct emu_qp *qp, const struct ibv_qp_attr *a, int mask)
{
	struct emu_device *dev = qp->ctx->dev;
	int port = (mask & A(PORT)) ? a->port_num : qp->port;

	if ((mask & A(PORT)) && (a->port_num < 1 || a->port_num > dev->port_count))
		return EINVAL;
	if ((mask & A(PKEY_INDEX)) && a->pkey_index != 0)
		return EINVAL; /* one P_Key (the default) per port */
	if ((mask & A(ACCESS_FLAGS)) &&
	    (a->qp_access_flags & ~(unsigned)(IBV_ACCESS_LOCAL_WRITE |
					      IBV_ACCESS_REMOTE_WRITE |
					      IBV_ACCESS_REMOTE_READ |
					      IBV_ACCESS_REMOTE_ATOMIC)))
		return EINVAL;
	if ((mask & A(PATH_MTU)) &&
	    (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
		return EINVAL;
	if (mask & A(AV)) {
		const struct emu_port_cfg *pc = &dev->ports[port];
		const struct ibv_ah_attr *ah = &a->ah_attr;
		if (ah->is_global) {
			if (ah->grh.sgid_index >= pc->gid_tbl_len ||
			    !pc->gids[ah->grh.sgid_index].valid)
				return EINVAL;
		} else if (pc->link_layer == IBV_LINK_LAYER_ETHERNET) {
			return EINVAL; /* RoCE needs a GRH */
		} else if (ah->dlid == 0) {
			return EINVAL;
		}
	}
	if ((mask & A(DEST_QPN)) && a->dest_qp_num > 0xffffff)
		return EINVAL;
	if ((mask & A(TIMEOUT)) && a->timeout > 31)
		return EINVAL;
	if ((mask & A(RETRY_CNT)) && a->retry_cnt > 7)
		return EINVAL;
	if ((mask & A(RNR_RETRY)) && a->rnr_retry > 7)
		return EINVAL;
	if ((mask & A(MIN_RNR_TIMER)) && a->min_rnr_timer > 31)
		return EINVAL;
	if ((mask & A(MAX_QP_RD_ATOMIC)) && a->max_rd_atomic > EMU_MAX_RD_ATOMIC)
		return EINVAL;
	if ((mask & A(MAX_DEST_RD_ATOMIC)) &&
	    a->max_dest_rd_atomic > EMU_MAX_RD_ATOMIC)
		return EINVAL;
	if ((mask & A(CUR_STATE)) && (int)a->cur_qp_state != qp->hw_state)
		return EINVAL;
	return 0;
}

static const char *state_name(int s)
{
	static const char *const n[] = { "RESET", "INIT", "RTR", "RTS",
					 "SQD",   "SQE",  "ERR" };
	return s >= 0 && s <= IBV_QPS_ERR ? n[s] : "?";
}

EMU_EXPORT int ibv_modify_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *a, int mask)
{
	struct emu_qp *qp;
	int cur, next, err;

	if (!ibqp || !a)
		return EINVAL;
	qp = emu_qp_of(ibqp);
	pthread_mutex_lock(&qp->lock);
	emu_qp_sync_remote_error(qp);
	cur = qp->hw_state;
	next = (mask & A(STATE)) ? (int)a->qp_state : cur;
	if (!transition_ok(cur, next, mask)) {
		emu_debug("modify QP 0x%06x %s->%s with mask 0x%x: invalid",
			  ibqp->qp_num, state_name(cur), state_name(next), mask);
		pthread_mutex_unlock(&qp->lock);
		errno = EINVAL;
		return EINVAL;
	}
	err = check_values(qp, a, mask);
	if (err) {
		emu_debug("modify QP 0x%06x %s->%s: bad attribute value",
			  ibqp->qp_num, state_name(cur), state_name(next));
		pthread_mutex_unlock(&qp->lock);
		errno = err;
		return err;
	}
	if (mask & A(PORT))
		qp->port = a->port_num;
	if (mask & A(PKEY_INDEX))
		qp->pkey_index = a->pkey_index;
	if (mask & A(ACCESS_FLAGS))
		qp->access = a->qp_access_flags;
	if (mask & A(PATH_MTU))
		qp->path_mtu = a->path_mtu;
	if (mask & A(AV))
		qp->ah = a->ah_attr;
	if (mask & A(DEST_QPN))
		qp->dest_qpn = a->dest_qp_num;
	if (mask & A(RQ_PSN))
		qp->rq_psn = a->rq_psn;
	if (mask & A(SQ_PSN))
		qp->sq_psn = a->sq_psn;
	if (mask & A(TIMEOUT))
		qp->timeout = a->timeout;
	if (mask & A(RETRY_CNT))
		qp->retry_cnt = a->retry_cnt;
	if (mask & A(RNR_RETRY))
		qp->rnr_retry = a->rnr_retry;
	if (mask & A(MIN_RNR_TIMER))
		qp->min_rnr_timer = a->min_rnr_timer;
	if (mask & A(MAX_QP_RD_ATOMIC))
		qp->max_rd_atomic = a->max_rd_atomic;
	if (mask & A(MAX_DEST_RD_ATOMIC))
		qp->max_dest_rd_atomic = a->max_dest_rd_atomic;

	if (next == IBV_QPS_RESET) {
		/* mlx5_modify_qp: a reset QP leaves no completions behind */
		emu_cq_scrub_qp(qp->scq, qp);
		if (qp->rcq != qp->scq)
			emu_cq_scrub_qp(qp->rcq, qp);
		qp->rq_n = 0;
		__atomic_store_n(&qp->sq_inflight, 0, __ATOMIC_RELEASE);
		qp->unsignaled = 0;
		qp->dest_qpn = 0;
		memset(&qp->ah, 0, sizeof(qp->ah));
		emu_fabric_clear_qp_error(ibqp->qp_num);
		qp->hw_state = IBV_QPS_RESET;
	} else if (next == IBV_QPS_ERR) {
		emu_qp_enter_error(qp);
	} else {
		qp->hw_state = next;
	}
	emu_qp_publish(qp);
	/* As rdma-core's ibv_modify_qp: the cached state follows the call. */
	if (mask & A(STATE))
		ibqp->state = (enum ibv_qp_state)next;
	emu_debug("QP 0x%06x %s -> %s", ibqp->qp_num, state_name(cur),
		  state_name(next));
	pthread_mutex_unlock(&qp->lock);
	return 0;
}

EMU_EXPORT int ibv_query_qp(struct ibv_qp *ibqp, struct ibv_qp_attr *a, int mask,
			    struct ibv_qp_init_attr *init)
{
	struct emu_qp *qp;

	(void)mask; /* like mlx5: everything is filled */
	if (!ibqp || !a || !init)
		return EINVAL;
	qp = emu_qp_of(ibqp);
	pthread_mutex_lock(&qp->lock);
	emu_qp_sync_remote_error(qp);
	memset(a, 0, sizeof(*a));
	a->qp_state = (enum ibv_qp_state)qp->hw_state;
	a->cur_qp_state = (enum ibv_qp_state)qp->hw_state;
	a->path_mtu = (enum ibv_mtu)qp->path_mtu;
	a->qp_access_flags = qp->access;
	a->pkey_index = qp->pkey_index;
	a->port_num = (uint8_t)qp->port;
	a->dest_qp_num = qp->dest_qpn;
	a->rq_psn = qp->rq_psn;
	a->sq_psn = qp->sq_psn;
	a->timeout = qp->timeout;
	a->retry_cnt = qp->retry_cnt;
	a->rnr_retry = qp->rnr_retry;
	a->min_rnr_timer = qp->min_rnr_timer;
	a->max_rd_atomic = qp->max_rd_atomic;
	a->max_dest_rd_atomic = qp->max_dest_rd_atomic;
	a->ah_attr = qp->ah;
	a->cap = qp->cap;
	memset(init, 0, sizeof(*init));
	init->qp_context = ibqp->qp_context;
	init->send_cq = ibqp->send_cq;
	init->recv_cq = ibqp->recv_cq;
	init->cap = qp->cap;
	init->qp_type = ibqp->qp_type;
	init->sq_sig_all = qp->sq_sig_all;
	pthread_mutex_unlock(&qp->lock);
	return 0;
}

/* ---- ibv_wr_* builder --------------------------------------------------- */

static struct emu_wr *new_wr(struct ibv_qp_ex *qpx, int opcode, const char *name)
{
	struct emu_qp *qp = emu_qp_of_ex(qpx);
	struct emu_wr *wr;

	if (!qp->batch_open) {
		qp->batch_err = EINVAL;
		return NULL;
	}
	if (qp->batch_n == qp->batch_cap) {
		uint32_t cap = qp->batch_cap ? qp->batch_cap * 2 : 16;
		struct emu_wr *b = realloc(qp->batch, cap * sizeof(*b));
		if (!b) {
			qp->batch_err = ENOMEM;
			return NULL;
		}
		qp->batch = b;
		qp->batch_cap = cap;
	}
	wr = &qp->batch[qp->batch_n++];
	memset(wr, 0, sizeof(*wr));
	wr->wr_id = qpx->wr_id;
	wr->flags = qpx->wr_flags;
	wr->opcode = opcode;
	wr->unsupported = name;
	return wr;
}

static struct emu_wr *last_wr(struct ibv_qp_ex *qpx)
{
	struct emu_qp *qp = emu_qp_of_ex(qpx);

	if (!qp->batch_open || qp->batch_n == 0) {
		qp->batch_err = EINVAL;
		return NULL;
	}
	return &qp->batch[qp->batch_n - 1];
}

static void x_wr_start(struct ibv_qp_ex *qpx)
{
	struct emu_qp *qp = emu_qp_of_ex(qpx);

	free_batch(qp);
	qp->batch_open = 1;
	qp->batch_err = 0;
}

static int x_wr_complete(struct ibv_qp_ex *qpx)
{
	struct emu_qp *qp = emu_qp_of_ex(qpx);
	uint32_t failed;
	int err;

	if (!qp->batch_open)
		return EINVAL;
	pthread_mutex_lock(&qp->lock);
	emu_qp_sync_remote_error(qp);
	err = qp->batch_err;
	if (!err)
		err = emu_qp_execute(qp, qp->batch, qp->batch_n, &failed);
	free_batch(qp);
	qp->batch_open = 0;
	pthread_mutex_unlock(&qp->lock);
	return err;
}

static void x_wr_abort(struct ibv_qp_ex *qpx)
{
	struct emu_qp *qp = emu_qp_of_ex(qpx);

	free_batch(qp);
	qp->batch_open = 0;
}

static void x_rdma_write(struct ibv_qp_ex *qpx, uint32_t rkey, uint64_t raddr)
{
	struct emu_wr *wr = new_wr(qpx, IBV_WR_RDMA_WRITE, NULL);

	if (wr) {
		wr->rkey = rkey;
		wr->raddr = raddr;
	}
}

static void x_rdma_read(struct ibv_qp_ex *qpx, uint32_t rkey, uint64_t raddr)
{
	struct emu_wr *wr = new_wr(qpx, IBV_WR_RDMA_READ, NULL);

	if (wr) {
		wr->rkey = rkey;
		wr->raddr = raddr;
	}
}

/* Builders for operations the emulator does not carry: the WR is recorded
 * so that ibv_wr_complete fails with EOPNOTSUPP and names it. */
static void x_rdma_write_imm(struct ibv_qp_ex *q, uint32_t k, uint64_t a, __be32 i)
{
	(void)k, (void)a, (void)i;
	new_wr(q, -1, "RDMA_WRITE_WITH_IMM");
}
static void x_send(struct ibv_qp_ex *q)
{
	new_wr(q, -1, "SEND");
}
static void x_send_imm(struct ibv_qp_ex *q, __be32 i)
{
	(void)i;
	new_wr(q, -1, "SEND_WITH_IMM");
}
static void x_send_inv(struct ibv_qp_ex *q, uint32_t k)
{
	(void)k;
	new_wr(q, -1, "SEND_WITH_INV");
}
static void x_send_tso(struct ibv_qp_ex *q, void *h, uint16_t hs, uint16_t mss)
{
	(void)h, (void)hs, (void)mss;
	new_wr(q, -1, "TSO");
}
static void x_cmp_swp(struct ibv_qp_ex *q, uint32_t k, uint64_t a, uint64_t c,
		      uint64_t s)
{
	(void)k, (void)a, (void)c, (void)s;
	new_wr(q, -1, "ATOMIC_CMP_AND_SWP");
}
static void x_fetch_add(struct ibv_qp_ex *q, uint32_t k, uint64_t a, uint64_t add)
{
	(void)k, (void)a, (void)add;
	new_wr(q, -1, "ATOMIC_FETCH_AND_ADD");
}
static void x_bind_mw(struct ibv_qp_ex *q, struct ibv_mw *mw, uint32_t k,
		      const struct ibv_mw_bind_info *b)
{
	(void)mw, (void)k, (void)b;
	new_wr(q, -1, "BIND_MW");
}
static void x_local_inv(struct ibv_qp_ex *q, uint32_t k)
{
	(void)k;
	new_wr(q, -1, "LOCAL_INV");
}
static void x_atomic_write(struct ibv_qp_ex *q, uint32_t k, uint64_t a, const void *v)
{
	(void)k, (void)a, (void)v;
	new_wr(q, -1, "ATOMIC_WRITE");
}
static void x_set_ud_addr(struct ibv_qp_ex *q, struct ibv_ah *ah, uint32_t qpn,
			  uint32_t qkey)
{
	(void)ah, (void)qpn, (void)qkey;
	emu_qp_of_ex(q)->batch_err = EOPNOTSUPP;
}
static void x_set_xrc_srqn(struct ibv_qp_ex *q, uint32_t n)
{
	(void)n;
	emu_qp_of_ex(q)->batch_err = EOPNOTSUPP;
}

static void x_set_sge(struct ibv_qp_ex *qpx, uint32_t lkey, uint64_t addr,
		      uint32_t length)
{
	struct emu_wr *wr = last_wr(qpx);

	if (!wr)
		return;
	wr->sge_store[0] = (struct ibv_sge){ .addr = addr, .length = length, .lkey = lkey };
	wr->sge = wr->sge_store;
	wr->num_sge = 1;
	wr->has_data = 1;
}

static void x_set_sge_list(struct ibv_qp_ex *qpx, size_t n, const struct ibv_sge *l)
{
	struct emu_wr *wr = last_wr(qpx);
	struct emu_qp *qp = emu_qp_of_ex(qpx);

	if (!wr)
		return;
	if (n > qp->cap.max_send_sge || n > EMU_MAX_SGE || (n && !l)) {
		qp->batch_err = EINVAL;
		return;
	}
	if (n)
		memcpy(wr->sge_store, l, n * sizeof(*l));
	wr->sge = wr->sge_store;
	wr->num_sge = (uint32_t)n;
	wr->has_data = 1;
}

static void set_inline(struct ibv_qp_ex *qpx, size_t nbuf, const struct ibv_data_buf *bufs)
{
	struct emu_wr *wr = last_wr(qpx);
	struct emu_qp *qp = emu_qp_of_ex(qpx);
	size_t total = 0, off = 0;

	if (!wr)
		return;
	for (size_t i = 0; i < nbuf; i++)
		total += bufs[i].length;
	if (total > qp->cap.max_inline_data) {
		qp->batch_err = EINVAL;
		return;
	}
	free(wr->inline_buf);
	wr->inline_buf = malloc(total ? total : 1);
	if (!wr->inline_buf) {
		qp->batch_err = ENOMEM;
		return;
	}
	/* The caller's buffers may be reused as soon as this returns. */
	for (size_t i = 0; i < nbuf; i++) {
		memcpy(wr->inline_buf + off, bufs[i].addr, bufs[i].length);
		off += bufs[i].length;
	}
	wr->inline_len = total;
	wr->flags |= IBV_SEND_INLINE;
	wr->num_sge = 0;
	wr->has_data = 1;
}

static void x_set_inline_data(struct ibv_qp_ex *qpx, void *addr, size_t length)
{
	struct ibv_data_buf b = { .addr = addr, .length = length };

	set_inline(qpx, 1, &b);
}

static void x_set_inline_data_list(struct ibv_qp_ex *qpx, size_t n,
				   const struct ibv_data_buf *l)
{
	set_inline(qpx, n, l);
}

void emu_qp_init_ex_ops(struct emu_qp *qp)
{
	struct ibv_qp_ex *x = &qp->qpx;

	x->wr_atomic_cmp_swp = x_cmp_swp;
	x->wr_atomic_fetch_add = x_fetch_add;
	x->wr_bind_mw = x_bind_mw;
	x->wr_local_inv = x_local_inv;
	x->wr_rdma_read = x_rdma_read;
	x->wr_rdma_write = x_rdma_write;
	x->wr_rdma_write_imm = x_rdma_write_imm;
	x->wr_send = x_send;
	x->wr_send_imm = x_send_imm;
	x->wr_send_inv = x_send_inv;
	x->wr_send_tso = x_send_tso;
	x->wr_set_ud_addr = x_set_ud_addr;
	x->wr_set_xrc_srqn = x_set_xrc_srqn;
	x->wr_set_inline_data = x_set_inline_data;
	x->wr_set_inline_data_list = x_set_inline_data_list;
	x->wr_set_sge = x_set_sge;
	x->wr_set_sge_list = x_set_sge_list;
	x->wr_start = x_wr_start;
	x->wr_complete = x_wr_complete;
	x->wr_abort = x_wr_abort;
	x->wr_atomic_write = x_atomic_write;
}
