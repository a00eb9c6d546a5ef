/*
 * Test of the verbs emulator through the real rdma-core API (verbs.h and
 * its inline functions), with real processes:
 *
 *   target     owns the memory; creates a QP per connection request
 *   port-down  an initiator whose NIC's port goes down after 3 WRs
 *   initiator  WRITE/READ of several sizes checked by checksum, the
 *              extended API, every error the emulator promises, and
 *              finally the target's death
 * plus single-process children for the device list, queries, DMA-BUF,
 * memory registration checks, and bad configurations.
 *
 * Needs FERRY_VERBS_EMU_CONFIG (dgx-h100.conf), FERRY_VERBS_EMU_DIR and
 * VERBS_TEST_TMP (a scratch directory); test/run-check.sh sets them.
 * Exits non-zero on the first failure; every child is bounded by alarm().
 */
#define _GNU_SOURCE
#include <infiniband/verbs.h>

#include <arpa/inet.h>
#include <pthread.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *role = "main";
static int checks;

#define CHECK(cond, ...)                                                       \
	do {                                                                   \
		__atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED);              \
		if (!(cond)) {                                                 \
			fprintf(stderr, "[%s] FAIL %s:%d: %s: ", role, __FILE__, \
				__LINE__, #cond);                              \
			fprintf(stderr, __VA_ARGS__);                          \
			fprintf(stderr, "\n");                                 \
			exit(1);                                               \
		}                                                              \
	} while (0)

static void say(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "[%s] ", role);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fprintf(stderr, "\n");
}

static uint64_t fnv(const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t h = 0xcbf29ce484222325ull;

	for (size_t i = 0; i < n; i++)
		h = (h ^ b[i]) * 0x100000001b3ull;
	return h;
}

static void fill(void *p, size_t n, uint32_t seed)
{
	unsigned char *b = p;
	uint32_t x = seed * 2654435761u + 1;

	for (size_t i = 0; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		b[i] = (unsigned char)x;
	}
}

/* ---- messages between processes ---------------------------------------- */

enum cmd {
	HELLO = 1, CONNECT, CSUM, QPSTATE, RECONNECT, FILL, BYE, BYE_EXIT, REPLY
};

struct msg {
	int cmd;
	int index;
	uint32_t qpn;
	uint16_t lid;
	uint8_t gid[16];
	uint64_t addr, len, ro_addr, ro_len, value, value2;
	uint32_t rkey, ro_rkey;
};

static void xfer(int fd, void *p, size_t n, int wr)
{
	char *c = p;

	while (n) {
		ssize_t r = wr ? write(fd, c, n) : read(fd, c, n);
		if (r <= 0) {
			if (r < 0 && errno == EINTR)
				continue;
			fprintf(stderr, "[%s] pipe %s failed\n", role, wr ? "write" : "read");
			exit(1);
		}
		c += r;
		n -= (size_t)r;
	}
}

static void send_msg(int fd, struct msg *m)
{
	xfer(fd, m, sizeof(*m), 1);
}

static struct msg recv_msg(int fd)
{
	struct msg m;

	xfer(fd, &m, sizeof(m), 0);
	return m;
}

static struct msg call(int out, int in, struct msg m)
{
	send_msg(out, &m);
	return recv_msg(in);
}

/* ---- verbs helpers ------------------------------------------------------ */

struct node {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	uint16_t lid;
	union ibv_gid gid;
};

static struct ibv_context *open_named(const char *name)
{
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;

	CHECK(list, "ibv_get_device_list: %s", strerror(errno));
	for (int i = 0; i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), name))
			ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	CHECK(ctx, "cannot open %s", name);
	return ctx;
}

static struct node open_node(const char *name)
{
	struct node nd;
	struct ibv_port_attr pa;

	nd.ctx = open_named(name);
	nd.pd = ibv_alloc_pd(nd.ctx);
	CHECK(nd.pd, "alloc_pd");
	nd.cq = ibv_create_cq(nd.ctx, 256, NULL, NULL, 0);
	CHECK(nd.cq, "create_cq: %s", strerror(errno));
	CHECK(ibv_query_port(nd.ctx, 1, &pa) == 0, "query_port");
	nd.lid = pa.lid;
	CHECK(ibv_query_gid(nd.ctx, 1, 0, &nd.gid) == 0, "query_gid");
	return nd;
}

static struct ibv_qp *make_qp(struct node *nd, uint32_t max_send_wr)
{
	struct ibv_qp_init_attr a = {
		.send_cq = nd->cq,
		.recv_cq = nd->cq,
		.cap = { .max_send_wr = max_send_wr, .max_recv_wr = 16,
			 .max_send_sge = 4, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.qp_type = IBV_QPT_RC,
	};
	struct ibv_qp *qp = ibv_create_qp(nd->pd, &a);

	CHECK(qp, "create_qp: %s", strerror(errno));
	return qp;
}

#define RW_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

static int to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0,
				 .port_num = 1, .qp_access_flags = RW_ACCESS };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					     IBV_QP_ACCESS_FLAGS);
}

static int to_rtr(struct ibv_qp *qp, uint32_t qpn, uint16_t lid, const uint8_t *gid)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
		.dest_qp_num = qpn, .rq_psn = 0, .max_dest_rd_atomic = 16,
		.min_rnr_timer = 12,
		.ah_attr = { .dlid = lid, .port_num = 1, .is_global = gid != NULL },
	};
	if (gid) {
		memcpy(a.ah_attr.grh.dgid.raw, gid, 16);
		a.ah_attr.grh.sgid_index = 0;
		a.ah_attr.grh.hop_limit = 1;
	}
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					     IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					     IBV_QP_MAX_DEST_RD_ATOMIC |
					     IBV_QP_MIN_RNR_TIMER);
}

static int to_rts(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTS, .sq_psn = 0, .timeout = 14,
				 .retry_cnt = 7, .rnr_retry = 7, .max_rd_atomic = 16 };
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT |
					     IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
					     IBV_QP_MAX_QP_RD_ATOMIC);
}

static void connect_qp(struct ibv_qp *qp, uint32_t qpn, uint16_t lid, const uint8_t *gid)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };

	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "-> RESET");
	CHECK(to_init(qp) == 0, "-> INIT");
	CHECK(to_rtr(qp, qpn, lid, gid) == 0, "-> RTR");
	CHECK(to_rts(qp) == 0, "-> RTS");
}

static int hw_state(struct ibv_qp *qp)
{
	struct ibv_qp_attr a;
	struct ibv_qp_init_attr ia;

	CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE, &ia) == 0, "query_qp");
	return a.qp_state;
}

static struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	struct timespec nap = { 0, 1000000 };

	for (int i = 0; i < 5000; i++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		CHECK(n >= 0, "poll_cq %d", n);
		if (n == 1)
			return wc;
		nanosleep(&nap, NULL);
	}
	CHECK(0, "no completion within 5 s");
	return wc;
}

static int post(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id,
		struct ibv_sge *sge, int nsge, uint64_t raddr, uint32_t rkey,
		unsigned flags)
{
	struct ibv_send_wr wr = {
		.wr_id = wr_id, .sg_list = sge, .num_sge = nsge, .opcode = op,
		.send_flags = flags,
		.wr.rdma = { .remote_addr = raddr, .rkey = rkey },
	}, *bad = NULL;
	int ret = ibv_post_send(qp, &wr, &bad);

	if (ret)
		CHECK(bad == &wr, "bad_wr not set");
	return ret;
}

/* One signaled WR and its completion. */
static struct ibv_wc rdma(struct node *nd, struct ibv_qp *qp, enum ibv_wr_opcode op,
			  void *laddr, uint32_t len, uint32_t lkey, uint64_t raddr,
			  uint32_t rkey)
{
	static __thread uint64_t id = 1000; /* per thread: wr_ids must not race */
	struct ibv_sge sge = { .addr = (uintptr_t)laddr, .length = len, .lkey = lkey };
	struct ibv_wc wc;

	id++;
	CHECK(post(qp, op, id, &sge, 1, raddr, rkey, IBV_SEND_SIGNALED) == 0, "post");
	wc = wait_wc(nd->cq);
	CHECK(wc.wr_id == id, "wr_id %llu != %llu", (unsigned long long)wc.wr_id,
	      (unsigned long long)id);
	CHECK(wc.qp_num == qp->qp_num, "qp_num");
	return wc;
}

static void *page_buf(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
		       -1, 0);
	CHECK(p != MAP_FAILED, "mmap");
	return p;
}

/* ---- target ------------------------------------------------------------- */

#define TBUF (1u << 20)
#define TRO (64u << 10)
#define MAXQ 16

static void serve(struct node *nd, int in, int out, unsigned char *buf, struct ibv_mr *mr,
		  unsigned char *ro, struct ibv_mr *romr, struct ibv_qp **qps, int *nq,
		  int *access_events)
{
	for (;;) {
		struct msg m = recv_msg(in), r = { .cmd = REPLY };

		/* Drain async events: QP_ACCESS_ERR arrives when a peer's
		 * request violated our MR rights. */
		struct ibv_async_event ev;
		while (ibv_get_async_event(nd->ctx, &ev) == 0) {
			if (ev.event_type == IBV_EVENT_QP_ACCESS_ERR)
				(*access_events)++;
			ibv_ack_async_event(&ev);
		}
		switch (m.cmd) {
		case HELLO:
			r.addr = (uintptr_t)buf;
			r.len = TBUF;
			r.rkey = mr->rkey;
			r.ro_addr = (uintptr_t)ro;
			r.ro_len = TRO;
			r.ro_rkey = romr->rkey;
			break;
		case CONNECT: {
			CHECK(*nq < MAXQ, "too many QPs");
			struct ibv_qp *qp = make_qp(nd, 16);
			CHECK(to_init(qp) == 0, "INIT");
			CHECK(to_rtr(qp, m.qpn, m.lid, m.gid) == 0, "RTR");
			CHECK(to_rts(qp) == 0, "RTS");
			qps[*nq] = qp;
			r.index = (*nq)++;
			r.qpn = qp->qp_num;
			r.lid = nd->lid;
			memcpy(r.gid, nd->gid.raw, 16);
			break;
		}
		case CSUM:
			r.value = m.value2 ? fnv(ro + m.addr, m.len) : fnv(buf + m.addr, m.len);
			break;
		case QPSTATE:
			r.value = (uint64_t)hw_state(qps[m.index]);
			r.value2 = (uint64_t)*access_events;
			break;
		case RECONNECT:
			connect_qp(qps[m.index], m.qpn, m.lid, m.gid);
			break;
		case FILL:
			fill(buf, TBUF, (uint32_t)m.value);
			fill(ro, TRO, (uint32_t)m.value + 1);
			break;
		case BYE:
			send_msg(out, &r);
			return;
		case BYE_EXIT:
			send_msg(out, &r);
			/* Die without cleaning up, like a crash. */
			_exit(0);
		default:
			CHECK(0, "unknown command %d", m.cmd);
		}
		send_msg(out, &r);
	}
}

static void run_target(int in1, int out1, int in2, int out2)
{
	role = "target";
	struct node nd = open_node("mlx5_0");
	unsigned char *buf = page_buf(TBUF), *ro = page_buf(TRO);
	struct ibv_qp *qps[MAXQ];
	int nq = 0, access_events = 0;

	/* Events are read without blocking between commands. */
	fcntl(nd.ctx->async_fd, F_SETFL, fcntl(nd.ctx->async_fd, F_GETFL) | O_NONBLOCK);
	fill(buf, TBUF, 1);
	fill(ro, TRO, 2);
	struct ibv_mr *mr = ibv_reg_mr(nd.pd, buf, TBUF, RW_ACCESS);
	struct ibv_mr *romr = ibv_reg_mr(nd.pd, ro, TRO, IBV_ACCESS_REMOTE_READ);
	CHECK(mr && romr, "reg_mr: %s", strerror(errno));
	serve(&nd, in1, out1, buf, mr, ro, romr, qps, &nq, &access_events);
	say("port-down client done");
	serve(&nd, in2, out2, buf, mr, ro, romr, qps, &nq, &access_events);
}

/* ---- initiator helpers -------------------------------------------------- */

struct peer {
	int in, out;
	struct msg info; /* HELLO reply */
};

static struct msg connect_to(struct peer *p, struct node *nd, struct ibv_qp *qp)
{
	struct msg m = { .cmd = CONNECT, .qpn = qp->qp_num, .lid = nd->lid };
	struct msg r;

	memcpy(m.gid, nd->gid.raw, 16);
	r = call(p->out, p->in, m);
	CHECK(to_init(qp) == 0, "INIT");
	CHECK(to_rtr(qp, r.qpn, r.lid, r.gid) == 0, "RTR");
	CHECK(to_rts(qp) == 0, "RTS");
	return r;
}

static uint64_t remote_csum(struct peer *p, uint64_t off, uint64_t len, int ro)
{
	struct msg m = { .cmd = CSUM, .addr = off, .len = len, .value2 = (uint64_t)ro };

	return call(p->out, p->in, m).value;
}

/* Both ends back to RTS after an error (the target's QP may be in ERR). */
static void reconnect(struct peer *p, struct node *nd, struct ibv_qp *qp, struct msg *t)
{
	struct msg m = { .cmd = RECONNECT, .index = t->index, .qpn = qp->qp_num,
			 .lid = nd->lid };

	memcpy(m.gid, nd->gid.raw, 16);
	call(p->out, p->in, m);
	connect_qp(qp, t->qpn, t->lid, t->gid);
}

/* ---- port-down client --------------------------------------------------- */

static void run_port_down(int in, int out)
{
	role = "port-down";
	setenv("FERRY_VERBS_EMU_FAULTS", "mlx5_4:port_down_after=3", 1);
	struct peer p = { in, out };
	struct node nd = open_node("mlx5_4");
	struct ibv_port_attr pa;
	struct ibv_async_event ev;
	unsigned char *buf = page_buf(4096);
	struct ibv_mr *mr = ibv_reg_mr(nd.pd, buf, 4096, RW_ACCESS);
	struct ibv_qp *qp = make_qp(&nd, 16);
	struct ibv_wc wc;

	CHECK(mr, "reg_mr");
	p.info = call(out, in, (struct msg){ .cmd = HELLO });
	struct msg t = connect_to(&p, &nd, qp);
	(void)t;
	for (int i = 0; i < 3; i++) {
		CHECK(ibv_query_port(nd.ctx, 1, &pa) == 0 && pa.state == IBV_PORT_ACTIVE,
		      "port should be ACTIVE before WR %d", i + 1);
		fill(buf, 4096, 100 + (uint32_t)i);
		wc = rdma(&nd, qp, IBV_WR_RDMA_WRITE, buf, 4096, mr->lkey,
			  p.info.addr + 8192, p.info.rkey);
		CHECK(wc.status == IBV_WC_SUCCESS, "WR %d: %s", i + 1,
		      ibv_wc_status_str(wc.status));
		CHECK(remote_csum(&p, 8192, 4096, 0) == fnv(buf, 4096), "data of WR %d", i + 1);
	}
	CHECK(ibv_query_port(nd.ctx, 1, &pa) == 0 && pa.state == IBV_PORT_DOWN &&
		      pa.phys_state == 3,
	      "port must be DOWN after 3 WRs (state %d)", pa.state);
	uint64_t before = remote_csum(&p, 8192, 4096, 0);
	fill(buf, 4096, 999);
	wc = rdma(&nd, qp, IBV_WR_RDMA_WRITE, buf, 4096, mr->lkey, p.info.addr + 8192,
		  p.info.rkey);
	CHECK(wc.status == IBV_WC_RETRY_EXC_ERR, "WR 4 on a down port: %s",
	      ibv_wc_status_str(wc.status));
	CHECK(remote_csum(&p, 8192, 4096, 0) == before, "target touched after port down");
	fcntl(nd.ctx->async_fd, F_SETFL, O_NONBLOCK);
	CHECK(ibv_get_async_event(nd.ctx, &ev) == 0 && ev.event_type == IBV_EVENT_PORT_ERR &&
		      ev.element.port_num == 1,
	      "expected IBV_EVENT_PORT_ERR");
	ibv_ack_async_event(&ev);
	say("port down after 3 WRs: WR 4 -> RETRY_EXC_ERR, query_port DOWN, PORT_ERR event");
	call(out, in, (struct msg){ .cmd = BYE });
	say("ok (%d checks)", checks);
	exit(0);
}

/* ---- initiator ---------------------------------------------------------- */

#define IBUF (2u << 20)

static void test_write_read(struct peer *p, struct node *nd, struct ibv_qp *qp,
			    unsigned char *buf, struct ibv_mr *mr)
{
	static const struct { uint32_t len; uint64_t off; } cases[] = {
		{ 1, 0 }, { 64, 4095 }, { 4096, 4096 }, { 65539, 12345 },
		{ 300000, 700000 }, { TBUF, 0 },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uint32_t len = cases[i].len;
		uint64_t off = cases[i].off;
		unsigned char *src = buf + 17;
		fill(src, len, 10 + (uint32_t)i);
		struct ibv_wc wc = rdma(nd, qp, IBV_WR_RDMA_WRITE, src, len, mr->lkey,
					p->info.addr + off, p->info.rkey);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_WRITE,
		      "WRITE %u: %s", len, ibv_wc_status_str(wc.status));
		CHECK(remote_csum(p, off, len, 0) == fnv(src, len), "WRITE %u data", len);
	}
	say("RDMA WRITE of 1 B .. 1 MiB verified by checksum");

	call(p->out, p->in, (struct msg){ .cmd = FILL, .value = 77 });
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		uint32_t len = cases[i].len;
		uint64_t off = cases[i].off;
		unsigned char *dst = buf + 4096 + 3;
		uint64_t want = remote_csum(p, off, len, 0);
		memset(dst, 0, len);
		struct ibv_wc wc = rdma(nd, qp, IBV_WR_RDMA_READ, dst, len, mr->lkey,
					p->info.addr + off, p->info.rkey);
		CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RDMA_READ &&
			      wc.byte_len == len,
		      "READ %u: %s", len, ibv_wc_status_str(wc.status));
		CHECK(fnv(dst, len) == want, "READ %u data", len);
	}
	say("RDMA READ of 1 B .. 1 MiB verified by checksum");

	/* three SGEs gathered into one remote range */
	unsigned char joined[3000];
	struct ibv_sge sge[3] = {
		{ (uintptr_t)(buf + 100), 1000, mr->lkey },
		{ (uintptr_t)(buf + 50000), 1000, mr->lkey },
		{ (uintptr_t)(buf + 900000), 1000, mr->lkey },
	};
	for (int i = 0; i < 3; i++) {
		fill((void *)(uintptr_t)sge[i].addr, 1000, 50 + (uint32_t)i);
		memcpy(joined + 1000 * i, (void *)(uintptr_t)sge[i].addr, 1000);
	}
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 7, sge, 3, p->info.addr + 5000, p->info.rkey,
		   IBV_SEND_SIGNALED) == 0,
	      "post 3 SGEs");
	struct ibv_wc wc = wait_wc(nd->cq);
	CHECK(wc.status == IBV_WC_SUCCESS && wc.byte_len == 3000, "gather WRITE");
	CHECK(remote_csum(p, 5000, 3000, 0) == fnv(joined, 3000), "gather data");

	/* unsignaled WRs complete silently; the signaled one retires them */
	struct ibv_send_wr wrs[4];
	struct ibv_sge s4[4];
	for (int i = 0; i < 4; i++) {
		s4[i] = (struct ibv_sge){ (uintptr_t)(buf + 4096 * (uint64_t)i), 4096, mr->lkey };
		fill(buf + 4096 * (uint64_t)i, 4096, 60 + (uint32_t)i);
		wrs[i] = (struct ibv_send_wr){
			.wr_id = 200 + (uint64_t)i, .next = i < 3 ? &wrs[i + 1] : NULL,
			.sg_list = &s4[i], .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
			.send_flags = i == 3 ? IBV_SEND_SIGNALED : 0,
			.wr.rdma = { p->info.addr + 4096 * (uint64_t)i, p->info.rkey },
		};
	}
	struct ibv_send_wr *bad = NULL;
	CHECK(ibv_post_send(qp, wrs, &bad) == 0, "post chain");
	wc = wait_wc(nd->cq);
	CHECK(wc.wr_id == 203 && wc.status == IBV_WC_SUCCESS, "signaled last of chain");
	struct ibv_wc extra;
	CHECK(ibv_poll_cq(nd->cq, 1, &extra) == 0, "unsignaled WRs produced completions");
	CHECK(remote_csum(p, 0, 4 * 4096, 0) == fnv(buf, 4 * 4096), "chain data");

	/* inline WRITE: no lkey needed */
	unsigned char small[48];
	fill(small, sizeof(small), 7);
	struct ibv_sge is = { (uintptr_t)small, sizeof(small), 0 };
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 8, &is, 1, p->info.addr + 100, p->info.rkey,
		   IBV_SEND_SIGNALED | IBV_SEND_INLINE) == 0,
	      "inline post");
	wc = wait_wc(nd->cq);
	CHECK(wc.status == IBV_WC_SUCCESS, "inline WRITE");
	CHECK(remote_csum(p, 100, sizeof(small), 0) == fnv(small, sizeof(small)),
	      "inline data");
	say("gather (3 SGEs), unsignaled chain, inline WRITE");
}

static void test_extended(struct peer *p, struct node *nd, unsigned char *buf,
			  struct ibv_mr *mr)
{
	struct ibv_cq_init_attr_ex ca = {
		.cqe = 64,
		.wc_flags = IBV_WC_STANDARD_FLAGS | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP,
	};
	struct ibv_cq_ex *cq = ibv_create_cq_ex(nd->ctx, &ca);
	CHECK(cq, "create_cq_ex: %s", strerror(errno));
	struct ibv_qp_init_attr_ex qa = {
		.send_cq = ibv_cq_ex_to_cq(cq),
		.recv_cq = ibv_cq_ex_to_cq(cq),
		.cap = { .max_send_wr = 16, .max_recv_wr = 4, .max_send_sge = 2,
			 .max_recv_sge = 1, .max_inline_data = 64 },
		.qp_type = IBV_QPT_RC,
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.pd = nd->pd,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ |
				  IBV_QP_EX_WITH_SEND,
	};
	struct ibv_qp *qp = ibv_create_qp_ex(nd->ctx, &qa);
	CHECK(qp, "create_qp_ex: %s", strerror(errno));
	struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(qp);
	CHECK(qx, "qp_to_qp_ex");
	connect_to(p, nd, qp);

	fill(buf, 8192, 321);
	ibv_wr_start(qx);
	qx->wr_id = 1;
	qx->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_rdma_write(qx, p->info.rkey, p->info.addr + 65536);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)buf, 8192);
	qx->wr_id = 2;
	ibv_wr_rdma_read(qx, p->info.rkey, p->info.addr + 65536);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)(buf + 16384), 8192);
	qx->wr_id = 3;
	ibv_wr_rdma_write(qx, p->info.rkey, p->info.addr + 200);
	ibv_wr_set_inline_data(qx, "inline-through-ibv_wr", 21);
	CHECK(ibv_wr_complete(qx) == 0, "wr_complete");

	struct ibv_poll_cq_attr pa = { 0 };
	uint64_t expect = 1;
	int ret = ibv_start_poll(cq, &pa);
	CHECK(ret == 0, "start_poll %d", ret);
	do {
		CHECK(cq->status == IBV_WC_SUCCESS && cq->wr_id == expect,
		      "ex completion %llu: %s", (unsigned long long)cq->wr_id,
		      ibv_wc_status_str(cq->status));
		CHECK(ibv_wc_read_opcode(cq) ==
			      (expect == 2 ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE),
		      "ex opcode");
		CHECK(ibv_wc_read_qp_num(cq) == qp->qp_num, "ex qp_num");
		CHECK(ibv_wc_read_completion_ts(cq) != 0, "ex timestamp");
		expect++;
	} while (ibv_next_poll(cq) == 0);
	ibv_end_poll(cq);
	CHECK(expect == 4, "3 completions in order, got %llu", (unsigned long long)expect - 1);
	CHECK(ibv_start_poll(cq, &pa) == ENOENT, "empty CQ -> ENOENT");
	CHECK(!memcmp(buf, buf + 16384, 8192), "ex READ returned the WRITE");
	CHECK(remote_csum(p, 200, 21, 0) == fnv("inline-through-ibv_wr", 21), "ex inline");

	/* SEND is accepted at creation, refused at posting */
	ibv_wr_start(qx);
	ibv_wr_send(qx);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)buf, 16);
	CHECK(ibv_wr_complete(qx) == EOPNOTSUPP, "SEND is not emulated");
	/* an opcode without an SGE is an invalid WR: nothing is posted */
	ibv_wr_start(qx);
	ibv_wr_rdma_write(qx, p->info.rkey, p->info.addr);
	CHECK(ibv_wr_complete(qx) == EINVAL, "WR without SGE");
	ibv_wr_start(qx);
	ibv_wr_rdma_write(qx, p->info.rkey, p->info.addr);
	ibv_wr_set_sge(qx, mr->lkey, (uintptr_t)buf, 16);
	ibv_wr_abort(qx);
	CHECK(ibv_start_poll(cq, &pa) == ENOENT, "aborted WR completed");

	CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)) == EBUSY, "CQ in use must be EBUSY");
	CHECK(ibv_destroy_qp(qp) == 0, "destroy ex QP");
	CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)) == 0, "destroy ex CQ");
	say("extended API: ibv_wr_* batch, ibv_start_poll/next_poll, SEND -> EOPNOTSUPP");
}

static void expect_error(struct peer *p, struct node *nd, struct ibv_qp *qp,
			 struct msg *t, enum ibv_wr_opcode op, void *laddr,
			 uint32_t len, uint32_t lkey, uint64_t raddr, uint32_t rkey,
			 enum ibv_wc_status want, int remote_errs, const char *what)
{
	uint64_t before = remote_csum(p, 0, TBUF, 0);
	uint64_t ro_before = remote_csum(p, 0, TRO, 1);
	struct msg st;

	struct ibv_wc wc = rdma(nd, qp, op, laddr, len, lkey, raddr, rkey);
	CHECK(wc.status == want, "%s: got %s, want %s", what,
	      ibv_wc_status_str(wc.status), ibv_wc_status_str(want));
	CHECK(remote_csum(p, 0, TBUF, 0) == before && remote_csum(p, 0, TRO, 1) == ro_before,
	      "%s: target memory changed", what);
	/* RC: the requester's QP is in ERR now, later WRs flush */
	CHECK(hw_state(qp) == IBV_QPS_ERR, "%s: requester QP not in ERR", what);
	CHECK(qp->state == IBV_QPS_RTS, "cached ibv_qp.state changes only in modify_qp");
	wc = rdma(nd, qp, IBV_WR_RDMA_WRITE, laddr, 0, lkey, p->info.addr, p->info.rkey);
	CHECK(wc.status == IBV_WC_WR_FLUSH_ERR, "%s: next WR %s, want flush", what,
	      ibv_wc_status_str(wc.status));
	st = call(p->out, p->in, (struct msg){ .cmd = QPSTATE, .index = t->index });
	if (remote_errs) {
		CHECK(st.value == IBV_QPS_ERR, "%s: responder QP state %llu, want ERR", what,
		      (unsigned long long)st.value);
	} else {
		CHECK(st.value == IBV_QPS_RTS, "%s: responder QP must stay RTS", what);
	}
	reconnect(p, nd, qp, t);
	say("%s -> %s, target memory unchanged, %s", what, ibv_wc_status_str(want),
	    remote_errs ? "both QPs to ERR, reconnected" : "requester QP reconnected");
}

static void test_errors(struct peer *p, struct node *nd, struct ibv_qp *qp,
			struct msg *t, unsigned char *buf, struct ibv_mr *mr)
{
	fill(buf, 65536, 5);
	uint32_t bad_rkey = p->info.rkey ^ 0x5a5a5a5a;
	if (bad_rkey == p->info.ro_rkey)
		bad_rkey ^= 1;
	expect_error(p, nd, qp, t, IBV_WR_RDMA_WRITE, buf, 4096, mr->lkey, p->info.addr,
		     bad_rkey, IBV_WC_REM_ACCESS_ERR, 1, "WRITE with a bad rkey");
	struct msg st = call(p->out, p->in, (struct msg){ .cmd = QPSTATE, .index = t->index });
	CHECK(st.value2 >= 1, "target saw no IBV_EVENT_QP_ACCESS_ERR");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_READ, buf, 4096, mr->lkey, p->info.addr,
		     bad_rkey, IBV_WC_REM_ACCESS_ERR, 1, "READ with a bad rkey");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_WRITE, buf, 64, mr->lkey,
		     p->info.addr + TBUF - 10, p->info.rkey, IBV_WC_REM_ACCESS_ERR, 1,
		     "WRITE past the end of the MR");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_READ, buf, 64, mr->lkey, p->info.addr - 8,
		     p->info.rkey, IBV_WC_REM_ACCESS_ERR, 1, "READ before the MR");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_WRITE, buf, 64, mr->lkey, p->info.ro_addr,
		     p->info.ro_rkey, IBV_WC_REM_ACCESS_ERR, 1,
		     "WRITE to an MR without REMOTE_WRITE");
	struct ibv_wc wc = rdma(nd, qp, IBV_WR_RDMA_READ, buf, TRO, mr->lkey,
				p->info.ro_addr, p->info.ro_rkey);
	CHECK(wc.status == IBV_WC_SUCCESS && fnv(buf, TRO) == remote_csum(p, 0, TRO, 1),
	      "READ from the REMOTE_READ MR");

	expect_error(p, nd, qp, t, IBV_WR_RDMA_WRITE, buf, 64, mr->lkey ^ 0x11,
		     p->info.addr, p->info.rkey, IBV_WC_LOC_PROT_ERR, 0, "WRITE with a bad lkey");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_WRITE, buf + IBUF - 32, 64, mr->lkey,
		     p->info.addr, p->info.rkey, IBV_WC_LOC_PROT_ERR, 0,
		     "WRITE from past the local MR");
	unsigned char *ro_local = page_buf(4096);
	struct ibv_mr *romr = ibv_reg_mr(nd->pd, ro_local, 4096, IBV_ACCESS_REMOTE_READ);
	CHECK(romr, "reg_mr remote-read only");
	expect_error(p, nd, qp, t, IBV_WR_RDMA_READ, ro_local, 64, romr->lkey,
		     p->info.addr, p->info.rkey, IBV_WC_LOC_PROT_ERR, 0,
		     "READ into an MR without LOCAL_WRITE");
	CHECK(ibv_dereg_mr(romr) == 0, "dereg");
}

static void test_state_machine(struct node *nd, struct peer *p, unsigned char *buf,
			       struct ibv_mr *mr)
{
	struct ibv_qp *qp = make_qp(nd, 16);
	struct ibv_sge sge = { (uintptr_t)buf, 64, mr->lkey };
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_RTR };

	CHECK(qp->state == IBV_QPS_RESET, "new QP in RESET");
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 1, &sge, 1, p->info.addr, p->info.rkey,
		   IBV_SEND_SIGNALED) == EINVAL,
	      "post in RESET");
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == EINVAL, "RESET -> RTR");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_INIT, .pkey_index = 0,
				  .qp_access_flags = RW_ACCESS };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
					    IBV_QP_ACCESS_FLAGS) == EINVAL,
	      "RESET -> INIT without IBV_QP_PORT");
	a.port_num = 2;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
					    IBV_QP_ACCESS_FLAGS) == EINVAL,
	      "port 2 of a one-port device");
	CHECK(to_init(qp) == 0 && qp->state == IBV_QPS_INIT, "RESET -> INIT");
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 1, &sge, 1, p->info.addr, p->info.rkey,
		   IBV_SEND_SIGNALED) == EINVAL,
	      "post in INIT");
	CHECK(to_rts(qp) == EINVAL, "INIT -> RTS");
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_4096,
				  .max_dest_rd_atomic = 1,
				  .ah_attr = { .dlid = 1, .port_num = 1 } };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					    IBV_QP_MIN_RNR_TIMER) == EINVAL,
	      "INIT -> RTR without IBV_QP_DEST_QPN");
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
					    IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
					    IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER |
					    IBV_QP_SQ_PSN) == EINVAL,
	      "INIT -> RTR with an RTS-only attribute");
	CHECK(to_rtr(qp, 0x123456, 1, NULL) == 0 && qp->state == IBV_QPS_RTR,
	      "INIT -> RTR");
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 1, &sge, 1, p->info.addr, p->info.rkey,
		   IBV_SEND_SIGNALED) == EINVAL,
	      "post in RTR");
	CHECK(to_rts(qp) == 0 && hw_state(qp) == IBV_QPS_RTS, "RTR -> RTS");
	/* connected to a QPN nobody owns: the requester retries and gives up */
	struct ibv_wc wc = rdma(nd, qp, IBV_WR_RDMA_WRITE, buf, 64, mr->lkey, p->info.addr,
				p->info.rkey);
	CHECK(wc.status == IBV_WC_RETRY_EXC_ERR, "write to a missing QP: %s",
	      ibv_wc_status_str(wc.status));
	a = (struct ibv_qp_attr){ .qp_state = IBV_QPS_RESET };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0, "ERR -> RESET");
	CHECK(ibv_poll_cq(nd->cq, 1, &wc) == 0, "no completion left");
	CHECK(ibv_destroy_qp(qp) == 0, "destroy");
	say("state machine: wrong transitions and masks -> EINVAL, posts before RTS -> EINVAL");
}

static void test_send_queue_full(struct peer *p, struct node *nd, unsigned char *buf,
				 struct ibv_mr *mr)
{
	struct ibv_qp *qp = make_qp(nd, 4);
	struct ibv_sge sge = { (uintptr_t)buf, 8, mr->lkey };

	connect_to(p, nd, qp);
	for (int i = 0; i < 4; i++)
		CHECK(post(qp, IBV_WR_RDMA_WRITE, 1, &sge, 1, p->info.addr, p->info.rkey,
			   0) == 0,
		      "unsignaled %d", i);
	CHECK(post(qp, IBV_WR_RDMA_WRITE, 1, &sge, 1, p->info.addr, p->info.rkey,
		   IBV_SEND_SIGNALED) == ENOMEM,
	      "5th WR on a 4-deep send queue without a signaled completion");
	CHECK(ibv_destroy_qp(qp) == 0, "destroy");
	say("send queue of 4 without signaled WRs -> ENOMEM on the 5th");
}

static void run_initiator(int in, int out, pid_t target)
{
	role = "initiator";
	struct peer p = { in, out };
	struct node nd = open_node("mlx5_3");
	unsigned char *buf = page_buf(IBUF);
	struct ibv_mr *mr = ibv_reg_mr(nd.pd, buf, IBUF, RW_ACCESS);
	struct ibv_qp *qp = make_qp(&nd, 64);

	CHECK(mr, "reg_mr");
	p.info = call(out, in, (struct msg){ .cmd = HELLO });
	struct msg t = connect_to(&p, &nd, qp);
	say("connected: QP 0x%06x (mlx5_3) <-> QP 0x%06x (mlx5_0, pid %d)", qp->qp_num,
	    t.qpn, (int)target);

	test_write_read(&p, &nd, qp, buf, mr);
	test_extended(&p, &nd, buf, mr);
	test_errors(&p, &nd, qp, &t, buf, mr);
	test_state_machine(&nd, &p, buf, mr);
	test_send_queue_full(&p, &nd, buf, mr);

	CHECK(ibv_dealloc_pd(nd.pd) == EBUSY, "PD with MRs and QPs -> EBUSY");

	/* The target dies without cleaning up. */
	call(out, in, (struct msg){ .cmd = BYE_EXIT });
	for (int i = 0; i < 500; i++) {
		char path[64], st[256];
		snprintf(path, sizeof(path), "/proc/%d/stat", (int)target);
		FILE *f = fopen(path, "r");
		if (!f)
			break;
		char *ok = fgets(st, sizeof(st), f);
		fclose(f);
		char *paren = ok ? strrchr(st, ')') : NULL;
		if (paren && (paren[2] == 'Z' || paren[2] == 'X'))
			break;
		usleep(10000);
	}
	struct ibv_wc wc = rdma(&nd, qp, IBV_WR_RDMA_WRITE, buf, 64, mr->lkey, p.info.addr,
				p.info.rkey);
	CHECK(wc.status == IBV_WC_RETRY_EXC_ERR, "write to a dead peer: %s",
	      ibv_wc_status_str(wc.status));
	say("target died -> RETRY_EXC_ERR");

	CHECK(ibv_destroy_qp(qp) == 0, "destroy qp");
	CHECK(ibv_dereg_mr(mr) == 0, "dereg");
	CHECK(ibv_destroy_cq(nd.cq) == 0, "destroy cq");
	CHECK(ibv_dealloc_pd(nd.pd) == 0, "dealloc pd");
	CHECK(ibv_close_device(nd.ctx) == 0, "close");
	say("ok (%d checks)", checks);
	exit(0);
}

/* ---- single-process children -------------------------------------------- */

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	CHECK(f && fputs(text, f) >= 0 && fclose(f) == 0, "write %s", path);
}

static void run_listing(void)
{
	role = "devices";
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	static const char *const names[] = { "mlx5_0", "mlx5_3", "mlx5_4",  "mlx5_5",
					     "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11" };

	CHECK(list && n == 8, "8 devices, got %d", n);
	for (int i = 0; i < n; i++) {
		CHECK(!strcmp(ibv_get_device_name(list[i]), names[i]), "name %d", i);
		CHECK(ibv_get_device_index(list[i]) == i, "index");
		CHECK(list[i]->transport_type == IBV_TRANSPORT_IB, "transport");
	}
	CHECK(list[n] == NULL, "NULL-terminated");
	CHECK(be64toh(ibv_get_device_guid(list[0])) == 0xb83fd20300a10000ull, "guid");
	CHECK(strstr(list[0]->ibdev_path, "/class/infiniband/mlx5_0"), "ibdev_path %s",
	      list[0]->ibdev_path);

	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx, "open");
	ibv_free_device_list(list);

	struct ibv_device_attr_ex dx;
	CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0, "query_device_ex");
	CHECK(dx.orig_attr.phys_port_cnt == 1 && dx.orig_attr.vendor_id == 0x02c9 &&
		      dx.orig_attr.vendor_part_id == 4129 && dx.phys_port_cnt_ex == 1,
	      "device attributes");
	CHECK(be64toh(dx.orig_attr.node_guid) == 0xb83fd20300a10000ull, "node_guid");
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0, "query_port");
	CHECK(pa.state == IBV_PORT_ACTIVE && pa.link_layer == IBV_LINK_LAYER_INFINIBAND &&
		      pa.lid == 0x11 && pa.active_mtu == IBV_MTU_4096 && pa.gid_tbl_len == 1 &&
		      pa.active_speed == 128 && pa.active_width == 2,
	      "port attributes");
	CHECK(ibv_query_port(ctx, 2, &pa) == EINVAL, "port 2");
	union ibv_gid gid;
	CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0, "query_gid");
	char text[64];
	inet_ntop(AF_INET6, gid.raw, text, sizeof(text));
	CHECK(!strcmp(text, "fe80::b83f:d203:a1:0"), "gid %s", text);
	CHECK(ibv_query_gid(ctx, 1, 1, &gid) == -1, "gid index 1");
	struct ibv_gid_entry ge[4];
	CHECK(ibv_query_gid_ex(ctx, 1, 0, &ge[0], 0) == 0 && ge[0].gid_type == IBV_GID_TYPE_IB,
	      "query_gid_ex");
	CHECK(ibv_query_gid_table(ctx, ge, 4, 0) == 1, "gid table");
	say("8 devices of the DGX config; device, port, GID queries");

	/* Memory registration checks */
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	unsigned char *page = page_buf(3 * 4096);
	CHECK(ibv_reg_mr(pd, page, 4096, IBV_ACCESS_REMOTE_WRITE) == NULL && errno == EINVAL,
	      "REMOTE_WRITE without LOCAL_WRITE");
	CHECK(ibv_reg_mr(pd, page, 0, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EINVAL,
	      "length 0");
	munmap(page + 4096, 4096);
	CHECK(ibv_reg_mr(pd, page, 3 * 4096, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EFAULT,
	      "range with a hole");
	mprotect(page, 4096, PROT_READ);
	CHECK(ibv_reg_mr(pd, page, 4096, IBV_ACCESS_LOCAL_WRITE) == NULL && errno == EFAULT,
	      "read-only memory with LOCAL_WRITE");
	struct ibv_mr *rmr = ibv_reg_mr(pd, page, 4096, IBV_ACCESS_REMOTE_READ);
	CHECK(rmr, "read-only memory, REMOTE_READ");
	CHECK(ibv_dereg_mr(rmr) == 0, "dereg");
	say("reg_mr: access rules, unmapped and read-only memory -> EINVAL/EFAULT");

	/* DMA-BUF: the probe Ferry makes, then a registration through a memfd */
	CHECK(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EBADF,
	      "dmabuf probe fd=-1 must fail with EBADF (got %s)", strerror(errno));
	int tfd = open("/dev/null", O_RDONLY);
	CHECK(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, tfd, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EINVAL,
	      "not a dma-buf");
	close(tfd);
	int mfd = memfd_create("ferry-dmabuf-standin", 0);
	CHECK(mfd >= 0 && ftruncate(mfd, 1 << 20) == 0, "memfd");
	CHECK(ibv_reg_dmabuf_mr(pd, 1 << 20, 4096, 0, mfd, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EINVAL,
	      "offset past the buffer");
	uint64_t iova = 0x7000000000ull;
	struct ibv_mr *dmr = ibv_reg_dmabuf_mr(pd, 8192, 65536, iova, mfd, RW_ACCESS);
	CHECK(dmr, "reg_dmabuf_mr: %s", strerror(errno));
	CHECK(dmr->addr == (void *)8192 && dmr->length == 65536, "dmabuf mr addr/length");

	/* Two QPs of this process on two NICs: WRITE into the DMA-BUF MR. */
	struct ibv_context *ctx2 = open_named("mlx5_3");
	struct ibv_pd *pd2 = ibv_alloc_pd(ctx2);
	struct ibv_cq *cq1 = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_cq *cq2 = ibv_create_cq(ctx2, 16, NULL, NULL, 0);
	struct node n1 = { ctx, pd, cq1, 0x11, gid }, n2 = { ctx2, pd2, cq2, 0x14, { { 0 } } };
	CHECK(ibv_query_gid(ctx2, 1, 0, &n2.gid) == 0, "gid 2");
	struct ibv_qp *q1 = make_qp(&n1, 8), *q2 = make_qp(&n2, 8);
	CHECK(to_init(q1) == 0 && to_init(q2) == 0, "INIT");
	CHECK(to_rtr(q1, q2->qp_num, 0x14, NULL) == 0 && to_rts(q1) == 0, "q1 RTS (LID)");
	CHECK(to_rtr(q2, q1->qp_num, 0, n1.gid.raw) == 0 && to_rts(q2) == 0, "q2 RTS (GID)");
	unsigned char *src = page_buf(4096);
	struct ibv_mr *smr = ibv_reg_mr(pd2, src, 4096, IBV_ACCESS_LOCAL_WRITE);
	fill(src, 4096, 42);
	struct ibv_wc wc = rdma(&n2, q2, IBV_WR_RDMA_WRITE, src, 4096, smr->lkey, iova + 100,
				dmr->rkey);
	CHECK(wc.status == IBV_WC_SUCCESS, "WRITE into DMA-BUF MR: %s",
	      ibv_wc_status_str(wc.status));
	unsigned char *view = mmap(NULL, 1 << 20, PROT_READ, MAP_SHARED, mfd, 0);
	CHECK(view != MAP_FAILED && !memcmp(view + 8192 + 100, src, 4096),
	      "DMA-BUF content");
	/* and READ back out of it, over the LID-addressed direction */
	struct ibv_mr *lmr = ibv_reg_mr(pd, page + 2 * 4096, 4096, IBV_ACCESS_LOCAL_WRITE);
	wc = rdma(&n1, q1, IBV_WR_RDMA_READ, page + 2 * 4096, 4096, lmr->lkey, 0, 0);
	CHECK(wc.status == IBV_WC_RETRY_EXC_ERR || wc.status == IBV_WC_REM_ACCESS_ERR,
	      "READ with rkey 0 must fail");
	say("DMA-BUF: fd=-1 -> EBADF, memfd stand-in registers, WRITE lands in it");
	exit(0);
}

static void run_config_errors(const char *tmp)
{
	char path[512];
	int n;

	role = "config";
	/* a typo is an error, not silently ignored */
	snprintf(path, sizeof(path), "%s/typo.conf", tmp);
	write_file(path, "[mlx5_0]\npci = 0000:18:00.0\nport1.stat = ACTIVE\n");
	setenv("FERRY_VERBS_EMU_CONFIG", path, 1);
	CHECK(ibv_get_device_list(&n) == NULL && errno == EINVAL, "typo must fail");
	exit(0);
}

static void run_faults_error(void)
{
	int n;

	role = "faults";
	if (getenv("FERRY_TEST_NO_UVERBS")) {
		setenv("FERRY_VERBS_EMU_FAULTS", "no_uverbs", 1);
		CHECK(ibv_get_device_list(&n) == NULL && errno == ENOSYS,
		      "no_uverbs must fail with ENOSYS like rdma-core");
		exit(0);
	}
	setenv("FERRY_VERBS_EMU_FAULTS", "mlx5_0:port_down_afterr=3", 1);
	CHECK(ibv_get_device_list(&n) == NULL && errno == EINVAL, "bad fault spec must fail");
	setenv("FERRY_TEST_NO_UVERBS", "1", 1);
	execl("/proc/self/exe", "verbs_emu_test", NULL); /* a fresh library state */
	CHECK(0, "re-exec: %s", strerror(errno));
}

static void run_empty(void)
{
	int n = -1;

	role = "empty";
	unsetenv("FERRY_VERBS_EMU_CONFIG");
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 0 && list[0] == NULL, "no config -> empty list");
	ibv_free_device_list(list);
	exit(0);
}

static void run_no_dmabuf(const char *tmp)
{
	char path[512];
	int n;

	role = "no-dmabuf";
	snprintf(path, sizeof(path), "%s/roce.conf", tmp);
	write_file(path, "[rocep1s0]\npci = 0000:01:00.0\ndmabuf = no\n"
			 "port1.link_layer = Ethernet\nport1.speed = HDR\n"
			 "port1.gid3 = ::ffff:10.0.0.7 RoCEv2\n");
	setenv("FERRY_VERBS_EMU_CONFIG", path, 1);
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n == 1, "one device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(ibv_reg_dmabuf_mr(pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE) == NULL &&
		      errno == EOPNOTSUPP,
	      "dmabuf = no -> EOPNOTSUPP, got %s", strerror(errno));
	struct ibv_port_attr pa;
	CHECK(ibv_query_port(ctx, 1, &pa) == 0 && pa.link_layer == IBV_LINK_LAYER_ETHERNET &&
		      pa.gid_tbl_len == 4 && pa.lid == 0,
	      "RoCE port");
	struct ibv_gid_entry ge[8];
	CHECK(ibv_query_gid_table(ctx, ge, 8, 0) == 2 && ge[1].gid_index == 3 &&
		      ge[1].gid_type == IBV_GID_TYPE_ROCE_V2,
	      "RoCE GID table");
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	struct node nd = { ctx, pd, cq, 0, { { 0 } } };
	struct ibv_qp *qp = make_qp(&nd, 4);
	CHECK(to_init(qp) == 0, "INIT");
	CHECK(to_rtr(qp, 0x100, 5, NULL) == EINVAL, "RoCE RTR without a GRH");
	struct ibv_qp_init_attr ud = { .send_cq = cq, .recv_cq = cq,
				       .cap = { 1, 1, 1, 1, 0 }, .qp_type = IBV_QPT_UD };
	CHECK(ibv_create_qp(pd, &ud) == NULL && errno == EOPNOTSUPP, "UD not emulated");
	CHECK(ibv_create_cq(ctx, 0, NULL, NULL, 0) == NULL && errno == EINVAL, "cqe 0");
	exit(0);
}



/* ---- injected error completions, completion channel, receive flush ------ */

static void run_misc(void)
{
	role = "wc-errors";
	setenv("FERRY_VERBS_EMU_FAULTS",
	       "mlx5_9:wc_error_every=3,wc_error_status=REM_OP_ERR", 1);
	struct ibv_context *a = open_named("mlx5_9"), *b = open_named("mlx5_10");
	struct ibv_comp_channel *ch = ibv_create_comp_channel(a);
	CHECK(ch, "comp channel");
	struct ibv_pd *pda = ibv_alloc_pd(a), *pdb = ibv_alloc_pd(b);
	struct ibv_cq *ca = ibv_create_cq(a, 16, (void *)0x1234, ch, 0);
	struct ibv_cq *cb = ibv_create_cq(b, 16, NULL, NULL, 0);
	struct node na = { a, pda, ca, 0x1a, { { 0 } } }, nb = { b, pdb, cb, 0x1b, { { 0 } } };
	struct ibv_qp *qa = make_qp(&na, 8), *qb = make_qp(&nb, 8);
	unsigned char *src = page_buf(4096), *dst = page_buf(4096);
	struct ibv_mr *smr = ibv_reg_mr(pda, src, 4096, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pdb, dst, 4096, RW_ACCESS);
	struct ibv_wc wc;

	CHECK(to_init(qa) == 0 && to_init(qb) == 0, "INIT");
	CHECK(to_rtr(qa, qb->qp_num, 0x1b, NULL) == 0 && to_rts(qa) == 0, "qa");
	CHECK(to_rtr(qb, qa->qp_num, 0x1a, NULL) == 0 && to_rts(qb) == 0, "qb");

	/* completion channel: armed CQ -> one event naming it */
	CHECK(ibv_req_notify_cq(ca, 0) == 0, "req_notify");
	fill(src, 4096, 3);
	wc = rdma(&na, qa, IBV_WR_RDMA_WRITE, src, 4096, smr->lkey, (uintptr_t)dst, dmr->rkey);
	CHECK(wc.status == IBV_WC_SUCCESS && !memcmp(src, dst, 4096), "WR 1");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == ca &&
		      ev_ctx == (void *)0x1234,
	      "cq event");
	ibv_ack_cq_events(ca, 1);
	say("completion channel: req_notify_cq -> get_cq_event -> ack");

	/* two receives are held, then flushed when the QP errors */
	struct ibv_recv_wr rw[2] = { { .wr_id = 71, .next = &rw[1] }, { .wr_id = 72 } }, *rbad;
	CHECK(ibv_post_recv(qa, rw, &rbad) == 0, "post_recv");
	wc = rdma(&na, qa, IBV_WR_RDMA_WRITE, src, 64, smr->lkey, (uintptr_t)dst, dmr->rkey);
	CHECK(wc.status == IBV_WC_SUCCESS, "WR 2");
	uint64_t before = fnv(dst, 4096);
	fill(src, 4096, 4);
	wc = rdma(&na, qa, IBV_WR_RDMA_WRITE, src, 4096, smr->lkey, (uintptr_t)dst, dmr->rkey);
	CHECK(wc.status == IBV_WC_REM_OP_ERR && wc.vendor_err == 0xfe03,
	      "WR 3 must be the injected error, got %s", ibv_wc_status_str(wc.status));
	CHECK(fnv(dst, 4096) == before, "injected error touched the target");
	for (int i = 0; i < 2; i++) {
		CHECK(ibv_poll_cq(ca, 1, &wc) == 1 && wc.status == IBV_WC_WR_FLUSH_ERR &&
			      wc.opcode == IBV_WC_RECV && wc.wr_id == 71u + (unsigned)i,
		      "receive %d flushed", i);
	}
	CHECK(hw_state(qa) == IBV_QPS_ERR, "QP in ERR after an injected error");
	connect_qp(qa, qb->qp_num, 0x1b, NULL);
	for (int i = 4; i <= 6; i++) {
		wc = rdma(&na, qa, IBV_WR_RDMA_WRITE, src, 64, smr->lkey, (uintptr_t)dst,
			  dmr->rkey);
		CHECK(wc.status == (i == 6 ? IBV_WC_REM_OP_ERR : IBV_WC_SUCCESS), "WR %d", i);
	}
	CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "channel in use");
	say("wc_error_every=3: WRs 3 and 6 fail with the chosen status, receives flush");
	exit(0);
}

/* ---- threads: one process, two NICs, four QP pairs, MR churn ------------ */

#define NTHREADS 4
#define TLEN (256u << 10)

struct shared {
	struct ibv_context *a, *b;
	struct ibv_pd *pda, *pdb;
	int stop; /* atomic */
};

struct worker {
	struct shared *sh;
	int id;
	int failed;
};

static void *work(void *arg)
{
	struct worker *w = arg;
	struct shared *sh = w->sh;
	unsigned char *src = page_buf(TLEN), *dst = page_buf(TLEN);
	struct ibv_mr *smr = ibv_reg_mr(sh->pda, src, TLEN, RW_ACCESS);
	struct ibv_mr *dmr = ibv_reg_mr(sh->pdb, dst, TLEN, RW_ACCESS);
	struct ibv_cq *ca = ibv_create_cq(sh->a, 32, NULL, NULL, w->id % 4);
	struct ibv_cq *cb = ibv_create_cq(sh->b, 32, NULL, NULL, 0);
	struct node na = { sh->a, sh->pda, ca, 0, { { 0 } } }, nb = { sh->b, sh->pdb, cb, 0, { { 0 } } };
	struct ibv_port_attr pa;
	uint32_t x = 7u + (uint32_t)w->id;

	CHECK(smr && dmr && ca && cb, "thread setup");
	ibv_query_port(sh->b, 1, &pa);
	struct ibv_qp *qa = make_qp(&na, 8), *qb = make_qp(&nb, 8);
	CHECK(to_init(qa) == 0 && to_init(qb) == 0, "INIT");
	CHECK(to_rtr(qa, qb->qp_num, pa.lid, NULL) == 0 && to_rts(qa) == 0, "qa");
	ibv_query_port(sh->a, 1, &pa);
	CHECK(to_rtr(qb, qa->qp_num, pa.lid, NULL) == 0 && to_rts(qb) == 0, "qb");
	for (int i = 0; i < 300; i++) {
		x ^= x << 13, x ^= x >> 17, x ^= x << 5;
		uint32_t len = 1 + x % (TLEN / 2);
		uint32_t off = (x >> 7) % (TLEN - len);
		fill(src, len, x);
		struct ibv_wc wc = rdma(&na, qa, IBV_WR_RDMA_WRITE, src, len, smr->lkey,
					(uintptr_t)dst + off, dmr->rkey);
		CHECK(wc.status == IBV_WC_SUCCESS && !memcmp(src, dst + off, len),
		      "thread %d WRITE %d", w->id, i);
		wc = rdma(&na, qa, IBV_WR_RDMA_READ, src + TLEN / 2, len / 2 + 1, smr->lkey,
			  (uintptr_t)dst + off, dmr->rkey);
		CHECK(wc.status == IBV_WC_SUCCESS &&
			      !memcmp(src + TLEN / 2, dst + off, len / 2 + 1),
		      "thread %d READ %d", w->id, i);
	}
	CHECK(ibv_destroy_qp(qa) == 0 && ibv_destroy_qp(qb) == 0, "destroy qps");
	CHECK(ibv_destroy_cq(ca) == 0 && ibv_destroy_cq(cb) == 0, "destroy cqs");
	CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0, "dereg");
	return NULL;
}

static void *churn(void *arg)
{
	struct shared *sh = arg;
	unsigned char *scratch = page_buf(1 << 16);

	while (!__atomic_load_n(&sh->stop, __ATOMIC_ACQUIRE)) {
		struct ibv_mr *m1 = ibv_reg_mr(sh->pda, scratch, 1 << 16, RW_ACCESS);
		struct ibv_mr *m2 = ibv_reg_mr(sh->pdb, scratch, 4096, IBV_ACCESS_REMOTE_READ);
		CHECK(m1 && m2, "churn reg");
		CHECK(ibv_dereg_mr(m2) == 0 && ibv_dereg_mr(m1) == 0, "churn dereg");
	}
	return NULL;
}

static void run_threads(void)
{
	role = "threads";
	struct shared sh = { .a = open_named("mlx5_5"), .b = open_named("mlx5_6") };
	struct worker w[NTHREADS];
	pthread_t t[NTHREADS], c;

	sh.pda = ibv_alloc_pd(sh.a);
	sh.pdb = ibv_alloc_pd(sh.b);
	CHECK(pthread_create(&c, NULL, churn, &sh) == 0, "churn thread");
	for (int i = 0; i < NTHREADS; i++) {
		w[i] = (struct worker){ &sh, i, 0 };
		CHECK(pthread_create(&t[i], NULL, work, &w[i]) == 0, "thread");
	}
	for (int i = 0; i < NTHREADS; i++)
		pthread_join(t[i], NULL);
	__atomic_store_n(&sh.stop, 1, __ATOMIC_RELEASE);
	pthread_join(c, NULL);
	CHECK(ibv_dealloc_pd(sh.pda) == 0 && ibv_dealloc_pd(sh.pdb) == 0, "dealloc");
	CHECK(ibv_close_device(sh.a) == 0 && ibv_close_device(sh.b) == 0, "close");
	say("%d threads x 300 WRITE+READ on shared PDs while MRs churn", NTHREADS);
	exit(0);
}

/* ---- main --------------------------------------------------------------- */

static pid_t spawn(void (*fn)(void *), void *arg)
{
	pid_t pid = fork();

	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		alarm(60);
		fn(arg);
		exit(0);
	}
	return pid;
}

static int reap(pid_t pid, const char *name)
{
	int status;

	CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
		return 0;
	fprintf(stderr, "[main] %s failed (%s %d)\n", name,
		WIFSIGNALED(status) ? "signal" : "exit",
		WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
	return 1;
}

static const char *tmpdir;
static int pipes[3][2][2]; /* [channel][direction: 0 to target, 1 back][fds] */

static void c_listing(void *a) { (void)a; run_listing(); }
static void c_config(void *a) { (void)a; run_config_errors(tmpdir); }
static void c_faults(void *a) { (void)a; run_faults_error(); }
static void c_empty(void *a) { (void)a; run_empty(); }
static void c_nodmabuf(void *a) { (void)a; run_no_dmabuf(tmpdir); }
static void c_threads(void *a) { (void)a; run_threads(); }
static void c_misc(void *a) { (void)a; run_misc(); }
static void c_target(void *a)
{
	(void)a;
	run_target(pipes[0][0][0], pipes[0][1][1], pipes[1][0][0], pipes[1][1][1]);
}
static void c_port_down(void *a)
{
	(void)a;
	run_port_down(pipes[0][1][0], pipes[0][0][1]);
}
static pid_t target_pid;
static void c_initiator(void *a)
{
	(void)a;
	run_initiator(pipes[1][1][0], pipes[1][0][1], target_pid);
}

int main(void)
{
	int failed = 0;

	if (getenv("FERRY_TEST_NO_UVERBS")) {
		alarm(60);
		run_faults_error();
	}
	tmpdir = getenv("VERBS_TEST_TMP");
	if (!tmpdir || !getenv("FERRY_VERBS_EMU_CONFIG") || !getenv("FERRY_VERBS_EMU_DIR")) {
		fprintf(stderr, "run me through test/run-check.sh\n");
		return 2;
	}
	alarm(120);
	/* Nothing here touches verbs: each child reads its own environment. */
	failed |= reap(spawn(c_listing, NULL), "devices");
	failed |= reap(spawn(c_config, NULL), "config");
	failed |= reap(spawn(c_faults, NULL), "faults");
	failed |= reap(spawn(c_empty, NULL), "empty");
	failed |= reap(spawn(c_nodmabuf, NULL), "no-dmabuf");
	failed |= reap(spawn(c_threads, NULL), "threads");
	failed |= reap(spawn(c_misc, NULL), "wc-errors");

	for (int c = 0; c < 2; c++)
		for (int d = 0; d < 2; d++)
			CHECK(pipe(pipes[c][d]) == 0, "pipe");
	target_pid = spawn(c_target, NULL);
	pid_t pd = spawn(c_port_down, NULL);
	pid_t in = spawn(c_initiator, NULL);
	failed |= reap(pd, "port-down");
	failed |= reap(in, "initiator");
	if (failed) {
		kill(target_pid, SIGKILL);
		reap(target_pid, "target");
	} else {
		failed |= reap(target_pid, "target");
	}
	fprintf(stderr, failed ? "[main] FAILED\n" : "[main] all passed\n");
	return failed;
}
