/*
 * Completion queues (legacy ibv_poll_cq and the extended ibv_start_poll
 * family) and completion channels.
 *
 * Two locks per CQ: `lock` guards the ring and is held only for short
 * moments (posting pushes completions under it); `poll_lock` is held from
 * ibv_start_poll to ibv_end_poll so two pollers do not interleave. Because
 * the ring lock is not held across a poll, a thread may post from inside
 * its own poll loop (sideway's rc_pingpong does), as it can on mlx5.
 */
#include "emu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

void emu_cq_table_insert(struct emu_cq *cq);
void emu_cq_table_remove(struct emu_cq *cq);

/* ---- completion channels ------------------------------------------------ */

EMU_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context)
{
	struct emu_channel *ch;
	int fds[2];

	if (!context) {
		errno = EINVAL;
		return NULL;
	}
	ch = calloc(1, sizeof(*ch));
	if (!ch) {
		errno = ENOMEM;
		return NULL;
	}
	if (pipe2(fds, O_CLOEXEC)) {
		free(ch);
		return NULL;
	}
	/* The writer side never blocks: a full pipe drops the wakeup. */
	fcntl(fds[1], F_SETFL, O_NONBLOCK);
	ch->ch.context = context;
	ch->ch.fd = fds[0];
	ch->ch.refcnt = 0;
	ch->wfd = fds[1];
	return &ch->ch;
}

EMU_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *channel)
{
	struct emu_channel *ch = (struct emu_channel *)channel;

	if (!channel)
		return EINVAL;
	if (__atomic_load_n(&ch->refs, __ATOMIC_ACQUIRE))
		return EBUSY;
	close(ch->ch.fd);
	close(ch->wfd);
	free(ch);
	return 0;
}

EMU_EXPORT int ibv_get_cq_event(struct ibv_comp_channel *channel,
				struct ibv_cq **cq, void **cq_context)
{
	for (;;) {
		uint32_t handle;
		ssize_t n = read(channel->fd, &handle, sizeof(handle));
		struct emu_cq *c;

		if (n < 0)
			return -1;
		if (n != (ssize_t)sizeof(handle)) {
			errno = EIO;
			return -1;
		}
		emu_cq_table_lock();
		c = emu_cq_table_lookup_locked(handle);
		if (c) {
			*cq = (struct ibv_cq *)&c->cq;
			*cq_context = c->cq.cq_context;
		}
		emu_cq_table_unlock();
		if (c)
			return 0;
		/* destroyed with an event pending: skip it */
	}
}

EMU_EXPORT void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents)
{
	pthread_mutex_lock(&cq->mutex);
	cq->comp_events_completed += nevents;
	pthread_cond_signal(&cq->cond);
	pthread_mutex_unlock(&cq->mutex);
}

int emu_req_notify_cq(struct ibv_cq *ibcq, int solicited_only)
{
	struct emu_cq *cq = emu_cq_of(ibcq);

	(void)solicited_only; /* every completion here is a send completion */
	pthread_mutex_lock(&cq->lock);
	cq->armed = 1;
	pthread_mutex_unlock(&cq->lock);
	return 0;
}

/* ---- ring --------------------------------------------------------------- */

void emu_cq_push(struct emu_cq *cq, const struct emu_cqe *cqe)
{
	int notify = 0;

	pthread_mutex_lock(&cq->lock);
	if (cq->count == cq->cap) {
		if (!cq->overflow_reported) {
			cq->overflow_reported = 1;
			emu_log("CQ overrun: CQ %u holds %u completions and a new one "
				"arrived; it is dropped (real hardware raises "
				"IBV_EVENT_CQ_ERR and errors the QPs). Poll more "
				"often or create a bigger CQ.",
				cq->handle, cq->cap);
			emu_fabric_send_event(cq->ctx->fifo, IBV_EVENT_CQ_ERR, cq->handle);
		}
		pthread_mutex_unlock(&cq->lock);
		return;
	}
	cq->ring[(cq->head + cq->count) % cq->cap] = *cqe;
	cq->count++;
	if (cq->armed && cq->channel) {
		cq->armed = 0;
		notify = 1;
	}
	pthread_mutex_unlock(&cq->lock);
	if (notify) {
		uint32_t h = cq->handle;
		ssize_t w = write(cq->channel->wfd, &h, sizeof(h));
		(void)w;
	}
}

/* Pops the oldest completion; retires the send queue slots it stands for. */
static int pop(struct emu_cq *cq, struct emu_cqe *out)
{
	pthread_mutex_lock(&cq->lock);
	if (cq->count == 0) {
		pthread_mutex_unlock(&cq->lock);
		return 0;
	}
	*out = cq->ring[cq->head];
	cq->head = (cq->head + 1) % cq->cap;
	cq->count--;
	if (out->qp && out->wqe_count)
		__atomic_sub_fetch(&out->qp->sq_inflight, out->wqe_count,
				   __ATOMIC_ACQ_REL);
	pthread_mutex_unlock(&cq->lock);
	return 1;
}

/* A destroyed or reset QP leaves no completions behind (mlx5_cq_clean). */
void emu_cq_scrub_qp(struct emu_cq *cq, struct emu_qp *qp)
{
	uint32_t kept = 0;

	pthread_mutex_lock(&cq->lock);
	for (uint32_t i = 0; i < cq->count; i++) {
		struct emu_cqe e = cq->ring[(cq->head + i) % cq->cap];
		if (e.qp == qp)
			continue;
		cq->ring[(cq->head + kept) % cq->cap] = e;
		kept++;
	}
	cq->count = kept;
	pthread_mutex_unlock(&cq->lock);
}

int emu_poll_cq(struct ibv_cq *ibcq, int n, struct ibv_wc *wc)
{
	struct emu_cq *cq = emu_cq_of(ibcq);
	int got = 0;

	if (n < 0)
		return -EINVAL;
	while (got < n) {
		struct emu_cqe e;
		if (!pop(cq, &e))
			break;
		memset(&wc[got], 0, sizeof(wc[got]));
		wc[got].wr_id = e.wr_id;
		wc[got].status = (enum ibv_wc_status)e.status;
		wc[got].opcode = (enum ibv_wc_opcode)e.opcode;
		wc[got].vendor_err = e.vendor_err;
		wc[got].byte_len = e.byte_len;
		wc[got].qp_num = e.qp_num;
		got++;
	}
	return got;
}

/* ---- extended polling --------------------------------------------------- */

static void load_current(struct emu_cq *cq)
{
	cq->cq.wr_id = cq->cur.wr_id;
	cq->cq.status = (enum ibv_wc_status)cq->cur.status;
}

static int x_start_poll(struct ibv_cq_ex *ibcq, struct ibv_poll_cq_attr *attr)
{
	struct emu_cq *cq = emu_cq_of_ex(ibcq);

	if (attr && attr->comp_mask)
		return EINVAL;
	pthread_mutex_lock(&cq->poll_lock);
	if (!pop(cq, &cq->cur)) {
		pthread_mutex_unlock(&cq->poll_lock);
		return ENOENT; /* and the caller must not call end_poll */
	}
	load_current(cq);
	return 0;
}

static int x_next_poll(struct ibv_cq_ex *ibcq)
{
	struct emu_cq *cq = emu_cq_of_ex(ibcq);

	if (!pop(cq, &cq->cur))
		return ENOENT;
	load_current(cq);
	return 0;
}

static void x_end_poll(struct ibv_cq_ex *ibcq)
{
	pthread_mutex_unlock(&emu_cq_of_ex(ibcq)->poll_lock);
}

static enum ibv_wc_opcode x_read_opcode(struct ibv_cq_ex *c)
{
	return (enum ibv_wc_opcode)emu_cq_of_ex(c)->cur.opcode;
}
static uint32_t x_read_vendor_err(struct ibv_cq_ex *c)
{
	return emu_cq_of_ex(c)->cur.vendor_err;
}
static uint32_t x_read_byte_len(struct ibv_cq_ex *c)
{
	return emu_cq_of_ex(c)->cur.byte_len;
}
static __be32 x_read_imm_data(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}
static uint32_t x_read_qp_num(struct ibv_cq_ex *c)
{
	return emu_cq_of_ex(c)->cur.qp_num;
}
static uint32_t x_read_zero32(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}
static unsigned int x_read_wc_flags(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}
static uint8_t x_read_zero8(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}
static uint64_t x_read_completion_ts(struct ibv_cq_ex *c)
{
	return emu_cq_of_ex(c)->cur.ts_ns;
}
static uint64_t x_read_wallclock(struct ibv_cq_ex *c)
{
	return emu_cq_of_ex(c)->cur.wallclock_ns;
}
static uint16_t x_read_cvlan(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}
static void x_read_tm_info(struct ibv_cq_ex *c, struct ibv_wc_tm_info *tm)
{
	(void)c;
	memset(tm, 0, sizeof(*tm));
}

/* ---- create / destroy --------------------------------------------------- */

static uint32_t round_queue(uint32_t n)
{
	uint32_t p = 1;

	while (p < n + 1)
		p <<= 1;
	return p - 1; /* mlx5 reports 2^k - 1 */
}

int emu_create_cq_common(struct emu_context *ctx, int cqe, void *cq_context,
			 struct ibv_comp_channel *channel, int comp_vector,
			 int is_ex, uint64_t wc_flags, struct emu_cq **out)
{
	static uint32_t handle_counter;
	struct emu_cq *cq;

	if (cqe < 1 || cqe > EMU_MAX_CQE || comp_vector < 0 ||
	    comp_vector >= EMU_NUM_COMP_VECTORS)
		return EINVAL;
	cq = calloc(1, sizeof(*cq));
	if (!cq)
		return ENOMEM;
	cq->cap = round_queue((uint32_t)cqe);
	cq->ring = calloc(cq->cap, sizeof(*cq->ring));
	if (!cq->ring) {
		free(cq);
		return ENOMEM;
	}
	cq->ctx = ctx;
	cq->is_ex = is_ex;
	cq->wc_flags = wc_flags;
	cq->handle = __atomic_add_fetch(&handle_counter, 1, __ATOMIC_RELAXED);
	pthread_mutex_init(&cq->lock, NULL);
	pthread_mutex_init(&cq->poll_lock, NULL);

	struct ibv_cq_ex *x = &cq->cq;
	x->context = &ctx->vctx.context;
	x->channel = channel;
	x->cq_context = cq_context;
	x->handle = cq->handle;
	x->cqe = (int)cq->cap;
	pthread_mutex_init(&x->mutex, NULL);
	pthread_cond_init(&x->cond, NULL);
	/* Every reader is set whatever wc_flags asked for, so a caller that
	 * reads a field it did not request gets 0 instead of a NULL call. */
	x->start_poll = x_start_poll;
	x->next_poll = x_next_poll;
	x->end_poll = x_end_poll;
	x->read_opcode = x_read_opcode;
	x->read_vendor_err = x_read_vendor_err;
	x->read_byte_len = x_read_byte_len;
	x->read_imm_data = x_read_imm_data;
	x->read_qp_num = x_read_qp_num;
	x->read_src_qp = x_read_zero32;
	x->read_wc_flags = x_read_wc_flags;
	x->read_slid = x_read_zero32;
	x->read_sl = x_read_zero8;
	x->read_dlid_path_bits = x_read_zero8;
	x->read_completion_ts = x_read_completion_ts;
	x->read_cvlan = x_read_cvlan;
	x->read_flow_tag = x_read_zero32;
	x->read_tm_info = x_read_tm_info;
	x->read_completion_wallclock_ns = x_read_wallclock;

	if (channel) {
		cq->channel = (struct emu_channel *)channel;
		__atomic_add_fetch(&cq->channel->refs, 1, __ATOMIC_ACQ_REL);
	}
	emu_cq_table_insert(cq);
	*out = cq;
	return 0;
}

EMU_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe,
					void *cq_context,
					struct ibv_comp_channel *channel,
					int comp_vector)
{
	struct emu_cq *cq;
	int err;

	if (!context) {
		errno = EINVAL;
		return NULL;
	}
	err = emu_create_cq_common(emu_ctx(context), cqe, cq_context, channel,
				   comp_vector, 0, IBV_WC_STANDARD_FLAGS, &cq);
	if (err) {
		errno = err;
		return NULL;
	}
	return (struct ibv_cq *)&cq->cq;
}

struct ibv_cq_ex *emu_create_cq_ex(struct ibv_context *c, struct ibv_cq_init_attr_ex *a)
{
	struct emu_cq *cq;
	int err;

	if (!a) {
		errno = EINVAL;
		return NULL;
	}
	if (a->comp_mask & ~(uint32_t)(IBV_CQ_INIT_ATTR_MASK_FLAGS |
				       IBV_CQ_INIT_ATTR_MASK_PD)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (a->wc_flags & ~(uint64_t)(IBV_WC_STANDARD_FLAGS |
				      IBV_WC_EX_WITH_COMPLETION_TIMESTAMP |
				      IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK)) {
		errno = EOPNOTSUPP;
		return NULL;
	}
	err = emu_create_cq_common(emu_ctx(c), (int)a->cqe, a->cq_context, a->channel,
				   (int)a->comp_vector, 1, a->wc_flags, &cq);
	if (err) {
		errno = err;
		return NULL;
	}
	return &cq->cq;
}

EMU_EXPORT int ibv_destroy_cq(struct ibv_cq *ibcq)
{
	struct emu_cq *cq;

	if (!ibcq)
		return EINVAL;
	cq = emu_cq_of(ibcq);
	if (__atomic_load_n(&cq->refs, __ATOMIC_ACQUIRE))
		return EBUSY; /* a QP still uses it */
	emu_cq_table_remove(cq);
	if (cq->channel)
		__atomic_sub_fetch(&cq->channel->refs, 1, __ATOMIC_ACQ_REL);
	pthread_mutex_destroy(&cq->lock);
	pthread_mutex_destroy(&cq->poll_lock);
	free(cq->ring);
	free(cq);
	return 0;
}
