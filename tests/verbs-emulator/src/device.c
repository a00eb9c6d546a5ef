/*
 * Devices, contexts, queries, async events, and the small exported helpers
 * of libibverbs (strings, sysfs, fork).
 */
#include "emu.h"

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- ports and faults --------------------------------------------------- */

static int fault_port_down(struct emu_device *dev, int port)
{
	const struct emu_fault_cfg *f = &dev->fault;

	if (f->port_down_after < 0 || f->port_down_port != port)
		return 0;
	return __atomic_load_n(&dev->wr_counter, __ATOMIC_RELAXED) >=
	       (uint64_t)f->port_down_after;
}

/* The port's state right now: config, our injected fault, or a fault that
 * another process injected on the same NIC (same node GUID). */
int emu_port_is_down(struct emu_device *dev, int port)
{
	if (port < 1 || port > dev->port_count)
		return 1;
	if (fault_port_down(dev, port)) {
		int expected = 0;
		if (__atomic_compare_exchange_n(&dev->port_fault_announced[port],
						&expected, 1, 0, __ATOMIC_ACQ_REL,
						__ATOMIC_ACQUIRE)) {
			emu_log("fault injected: %s port %d is DOWN after %ld work "
				"request(s)",
				dev->ibdev.name, port, dev->fault.port_down_after);
			if (emu_g.fabric_ready) {
				emu_fabric_set_port_down(dev->node_guid, port);
				emu_fabric_broadcast_port_event(dev->node_guid,
								IBV_EVENT_PORT_ERR,
								(uint32_t)port);
			}
		}
		return 1;
	}
	if (dev->ports[port].state != IBV_PORT_ACTIVE)
		return 1;
	return emu_fabric_port_down(dev->node_guid, port);
}

void emu_fill_port_attr(struct emu_device *dev, int port, struct ibv_port_attr *a)
{
	const struct emu_port_cfg *pc = &dev->ports[port];
	int ib = pc->link_layer == IBV_LINK_LAYER_INFINIBAND;
	int down = emu_port_is_down(dev, port);

	memset(a, 0, sizeof(*a));
	a->state = down ? (pc->state == IBV_PORT_ACTIVE ? IBV_PORT_DOWN : pc->state)
			: IBV_PORT_ACTIVE;
	a->max_mtu = IBV_MTU_4096;
	a->active_mtu = pc->active_mtu;
	a->gid_tbl_len = pc->gid_tbl_len;
	a->port_cap_flags = ib ? 0x2651e848 : 0x04010000;
	a->max_msg_sz = EMU_MAX_MSG_SZ;
	a->pkey_tbl_len = 1;
	a->lid = ib ? pc->lid : 0;
	a->sm_lid = ib ? 1 : 0;
	a->max_vl_num = ib ? 4 : 0;
	a->subnet_timeout = ib ? 18 : 0;
	a->active_width = pc->active_width;
	a->active_speed = pc->active_speed;
	a->phys_state = a->state == IBV_PORT_ACTIVE ? 5 /* LinkUp */ : 3 /* Disabled */;
	a->link_layer = pc->link_layer;
	a->flags = ib ? 0 : IBV_QPF_GRH_REQUIRED;
}

/* ---- device list -------------------------------------------------------- */

static struct emu_device *find_device(struct ibv_device *d)
{
	for (int i = 0; i < emu_g.ndevs; i++)
		if (&emu_g.devs[i].ibdev == d)
			return &emu_g.devs[i];
	return NULL;
}

EMU_EXPORT struct ibv_device **ibv_get_device_list(int *num_devices)
{
	struct ibv_device **list;
	int err = emu_init();

	if (num_devices)
		*num_devices = 0;
	if (err) {
		errno = err;
		return NULL;
	}
	if (emu_g.no_uverbs) {
		/* rdma-core when /sys/class/infiniband_verbs is missing */
		errno = ENOSYS;
		return NULL;
	}
	list = calloc((size_t)emu_g.ndevs + 1, sizeof(*list));
	if (!list) {
		errno = ENOMEM;
		return NULL;
	}
	for (int i = 0; i < emu_g.ndevs; i++)
		list[i] = &emu_g.devs[i].ibdev;
	if (num_devices)
		*num_devices = emu_g.ndevs;
	return list;
}

EMU_EXPORT void ibv_free_device_list(struct ibv_device **list)
{
	free(list);
}

EMU_EXPORT const char *ibv_get_device_name(struct ibv_device *device)
{
	return device ? device->name : NULL;
}

EMU_EXPORT __be64 ibv_get_device_guid(struct ibv_device *device)
{
	struct emu_device *d = device ? find_device(device) : NULL;

	return d ? htobe64(d->node_guid) : 0;
}

EMU_EXPORT int ibv_get_device_index(struct ibv_device *device)
{
	struct emu_device *d = device ? find_device(device) : NULL;

	return d ? d->index : -1;
}

/* ---- contexts ----------------------------------------------------------- */

int emu_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
int emu_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
int emu_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
int emu_req_notify_cq(struct ibv_cq *cq, int solicited_only);
struct ibv_cq_ex *emu_create_cq_ex(struct ibv_context *c, struct ibv_cq_init_attr_ex *a);
struct ibv_qp *emu_create_qp_ex(struct ibv_context *c, struct ibv_qp_init_attr_ex *a);
static int emu_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a,
			  size_t len);
static int emu_query_device_ex(struct ibv_context *c,
			       const struct ibv_query_device_ex_input *in,
			       struct ibv_device_attr_ex *a, size_t len);
static int emu_query_rt_values(struct ibv_context *c, struct ibv_values_ex *v);

static int emu_post_srq_recv(struct ibv_srq *srq, struct ibv_recv_wr *wr,
			     struct ibv_recv_wr **bad)
{
	(void)srq;
	if (bad)
		*bad = wr;
	return EOPNOTSUPP;
}

EMU_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	static unsigned ctx_counter;
	struct emu_device *dev;
	struct emu_context *ctx;
	struct ibv_context *c;
	int err, afd = -1;

	if (emu_init() || !device || !(dev = find_device(device))) {
		errno = ENODEV;
		return NULL;
	}
	err = emu_fabric_prepare();
	if (err) {
		errno = err;
		return NULL;
	}
	ctx = calloc(1, sizeof(*ctx));
	if (!ctx) {
		errno = ENOMEM;
		return NULL;
	}
	ctx->dev = dev;
	ctx->ctx_no = __atomic_fetch_add(&ctx_counter, 1, __ATOMIC_RELAXED);
	err = emu_fabric_make_fifo(dev->node_guid, ctx->ctx_no, ctx->fifo,
				   sizeof(ctx->fifo), &afd);
	if (err) {
		emu_log("cannot create the async event FIFO in %s/ctx: %s",
			emu_g.fabric_dir, strerror(err));
		free(ctx);
		errno = err;
		return NULL;
	}
	ctx->null_fd = open("/dev/null", O_RDWR | O_CLOEXEC);

	c = &ctx->vctx.context;
	c->device = device;
	c->cmd_fd = ctx->null_fd;
	c->async_fd = afd;
	c->num_comp_vectors = EMU_NUM_COMP_VECTORS;
	pthread_mutex_init(&c->mutex, NULL);
	c->abi_compat = __VERBS_ABI_IS_EXTENDED;
	c->ops.post_send = emu_post_send;
	c->ops.post_recv = emu_post_recv;
	c->ops.poll_cq = emu_poll_cq;
	c->ops.req_notify_cq = emu_req_notify_cq;
	c->ops.post_srq_recv = emu_post_srq_recv;

	ctx->vctx.sz = sizeof(struct verbs_context);
	ctx->vctx.query_port = emu_query_port;
	ctx->vctx.query_device_ex = emu_query_device_ex;
	ctx->vctx.query_rt_values = emu_query_rt_values;
	ctx->vctx.create_cq_ex = emu_create_cq_ex;
	ctx->vctx.create_qp_ex = emu_create_qp_ex;
	emu_debug("opened %s (context %u)", dev->ibdev.name, ctx->ctx_no);
	return c;
}

EMU_EXPORT int ibv_close_device(struct ibv_context *context)
{
	struct emu_context *ctx;

	if (!context)
		return EINVAL;
	ctx = emu_ctx(context);
	close(context->async_fd);
	if (ctx->null_fd >= 0)
		close(ctx->null_fd);
	emu_fabric_remove_fifo(ctx->fifo);
	pthread_mutex_destroy(&context->mutex);
	free(ctx);
	return 0;
}

/* ---- async events ------------------------------------------------------- */

EMU_EXPORT int ibv_get_async_event(struct ibv_context *context,
				   struct ibv_async_event *event)
{
	struct emu_context *ctx = emu_ctx(context);

	for (;;) {
		uint32_t rec[2];
		ssize_t n = read(context->async_fd, rec, sizeof(rec));

		if (n < 0)
			return -1; /* errno: EAGAIN when non-blocking */
		if (n != (ssize_t)sizeof(rec)) {
			errno = EIO;
			return -1;
		}
		memset(event, 0, sizeof(*event));
		event->event_type = (enum ibv_event_type)rec[0];
		switch (rec[0]) {
		case IBV_EVENT_QP_FATAL:
		case IBV_EVENT_QP_REQ_ERR:
		case IBV_EVENT_QP_ACCESS_ERR:
		case IBV_EVENT_COMM_EST:
		case IBV_EVENT_SQ_DRAINED:
		case IBV_EVENT_PATH_MIG:
		case IBV_EVENT_PATH_MIG_ERR:
		case IBV_EVENT_QP_LAST_WQE_REACHED: {
			struct emu_qp *qp;
			emu_qp_table_lock();
			qp = emu_qp_table_lookup_locked(rec[1]);
			if (qp && qp->ctx == ctx)
				event->element.qp = &qp->qpx.qp_base;
			emu_qp_table_unlock();
			if (!event->element.qp)
				continue; /* QP destroyed meanwhile */
			return 0;
		}
		case IBV_EVENT_CQ_ERR: {
			struct emu_cq *cq;
			emu_cq_table_lock();
			cq = emu_cq_table_lookup_locked(rec[1]);
			if (cq && cq->ctx == ctx)
				event->element.cq = (struct ibv_cq *)&cq->cq;
			emu_cq_table_unlock();
			if (!event->element.cq)
				continue;
			return 0;
		}
		default:
			event->element.port_num = (int)rec[1];
			return 0;
		}
	}
}

EMU_EXPORT void ibv_ack_async_event(struct ibv_async_event *event)
{
	switch (event->event_type) {
	case IBV_EVENT_QP_FATAL:
	case IBV_EVENT_QP_REQ_ERR:
	case IBV_EVENT_QP_ACCESS_ERR:
	case IBV_EVENT_COMM_EST:
	case IBV_EVENT_SQ_DRAINED:
	case IBV_EVENT_PATH_MIG:
	case IBV_EVENT_PATH_MIG_ERR:
	case IBV_EVENT_QP_LAST_WQE_REACHED: {
		struct ibv_qp *qp = event->element.qp;
		pthread_mutex_lock(&qp->mutex);
		qp->events_completed++;
		pthread_cond_signal(&qp->cond);
		pthread_mutex_unlock(&qp->mutex);
		break;
	}
	case IBV_EVENT_CQ_ERR: {
		struct ibv_cq *cq = event->element.cq;
		pthread_mutex_lock(&cq->mutex);
		cq->async_events_completed++;
		pthread_cond_signal(&cq->cond);
		pthread_mutex_unlock(&cq->mutex);
		break;
	}
	default:
		break;
	}
}

/* ---- queries ------------------------------------------------------------ */

static void fill_device_attr(struct emu_device *d, struct ibv_device_attr *a)
{
	memset(a, 0, sizeof(*a));
	snprintf(a->fw_ver, sizeof(a->fw_ver), "%s", d->fw_ver);
	a->node_guid = htobe64(d->node_guid);
	a->sys_image_guid = htobe64(d->node_guid);
	a->max_mr_size = ~0ull;
	a->page_size_cap = 0xfffffffffffff000ull;
	a->vendor_id = d->vendor_id;
	a->vendor_part_id = d->vendor_part_id;
	a->max_qp = 262144;
	a->max_qp_wr = EMU_MAX_QP_WR;
	a->device_cap_flags = IBV_DEVICE_BAD_PKEY_CNTR | IBV_DEVICE_BAD_QKEY_CNTR |
			      IBV_DEVICE_CHANGE_PHY_PORT | IBV_DEVICE_PORT_ACTIVE_EVENT |
			      IBV_DEVICE_SYS_IMAGE_GUID | IBV_DEVICE_RC_RNR_NAK_GEN;
	a->max_sge = EMU_MAX_SGE;
	a->max_sge_rd = EMU_MAX_SGE;
	a->max_cq = 16777216;
	a->max_cqe = EMU_MAX_CQE;
	a->max_mr = 16777216;
	a->max_pd = 16777216;
	a->max_qp_rd_atom = EMU_MAX_RD_ATOMIC;
	a->max_res_rd_atom = EMU_MAX_RD_ATOMIC * 262144;
	a->max_qp_init_rd_atom = EMU_MAX_RD_ATOMIC;
	a->atomic_cap = IBV_ATOMIC_NONE; /* atomics are not emulated */
	a->max_pkeys = 1;
	a->local_ca_ack_delay = 16;
	a->phys_port_cnt = (uint8_t)d->port_count;
}

EMU_EXPORT int ibv_query_device(struct ibv_context *context,
				struct ibv_device_attr *device_attr)
{
	if (!context || !device_attr)
		return EINVAL;
	fill_device_attr(emu_ctx(context)->dev, device_attr);
	return 0;
}

static int emu_query_device_ex(struct ibv_context *c,
			       const struct ibv_query_device_ex_input *in,
			       struct ibv_device_attr_ex *a, size_t len)
{
	struct ibv_device_attr_ex full;
	struct emu_device *d = emu_ctx(c)->dev;

	if (in && in->comp_mask)
		return EINVAL;
	if (len < sizeof(struct ibv_device_attr))
		return EINVAL;
	memset(&full, 0, sizeof(full));
	fill_device_attr(d, &full.orig_attr);
	full.completion_timestamp_mask = 0x7fffffffffffffffull;
	full.hca_core_clock = 1000000; /* kHz: timestamps are nanoseconds */
	full.phys_port_cnt_ex = (uint32_t)d->port_count;
	/* Callers built against other headers pass their own size. */
	memset(a, 0, len);
	memcpy(a, &full, len < sizeof(full) ? len : sizeof(full));
	return 0;
}

static int emu_query_rt_values(struct ibv_context *c, struct ibv_values_ex *v)
{
	struct timespec ts;

	(void)c;
	if (v->comp_mask & ~(uint32_t)IBV_VALUES_MASK_RAW_CLOCK)
		return EINVAL;
	if (v->comp_mask & IBV_VALUES_MASK_RAW_CLOCK) {
		clock_gettime(CLOCK_MONOTONIC, &ts);
		v->raw_clock = ts;
	}
	return 0;
}

static int emu_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a,
			  size_t len)
{
	struct emu_device *d = emu_ctx(c)->dev;
	struct ibv_port_attr full;

	if (port < 1 || port > d->port_count || !a)
		return EINVAL;
	emu_fill_port_attr(d, port, &full);
	memset(a, 0, len);
	memcpy(a, &full, len < sizeof(full) ? len : sizeof(full));
	return 0;
}

/* The exported symbol takes the pre-port_cap_flags2 layout. verbs.h makes
 * ibv_query_port a macro for an inline that prefers verbs_context. */
#undef ibv_query_port
EMU_EXPORT int ibv_query_port(struct ibv_context *context, uint8_t port_num,
			      struct _compat_ibv_port_attr *port_attr)
{
	if (!context)
		return EINVAL;
	return emu_query_port(context, port_num, (struct ibv_port_attr *)port_attr,
			      offsetof(struct ibv_port_attr, port_cap_flags2));
}

static const struct emu_gid_cfg *gid_at(struct ibv_context *c, uint32_t port,
					uint32_t index, int *err)
{
	struct emu_device *d = emu_ctx(c)->dev;

	if (port < 1 || port > (uint32_t)d->port_count ||
	    index >= (uint32_t)d->ports[port].gid_tbl_len) {
		*err = EINVAL;
		return NULL;
	}
	if (!d->ports[port].gids[index].valid) {
		*err = ENODATA;
		return NULL;
	}
	*err = 0;
	return &d->ports[port].gids[index];
}

EMU_EXPORT int ibv_query_gid(struct ibv_context *context, uint8_t port_num,
			     int index, union ibv_gid *gid)
{
	const struct emu_gid_cfg *g;
	int err;

	if (!context || index < 0) {
		errno = EINVAL;
		return -1;
	}
	g = gid_at(context, port_num, (uint32_t)index, &err);
	if (err == ENODATA) {
		memset(gid, 0, sizeof(*gid));
		return 0;
	}
	if (err) {
		errno = err;
		return -1;
	}
	*gid = g->gid;
	return 0;
}

EMU_EXPORT int _ibv_query_gid_ex(struct ibv_context *context, uint32_t port_num,
				 uint32_t gid_index, struct ibv_gid_entry *entry,
				 uint32_t flags, size_t entry_size)
{
	const struct emu_gid_cfg *g;
	int err;

	if (!context || !entry || flags || entry_size < sizeof(*entry))
		return EINVAL;
	g = gid_at(context, port_num, gid_index, &err);
	if (err)
		return err;
	memset(entry, 0, entry_size);
	entry->gid = g->gid;
	entry->gid_index = gid_index;
	entry->port_num = port_num;
	entry->gid_type = g->type;
	entry->ndev_ifindex = 0;
	return 0;
}

EMU_EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *context,
					struct ibv_gid_entry *entries,
					size_t max_entries, uint32_t flags,
					size_t entry_size)
{
	struct emu_device *d;
	size_t n = 0;

	if (!context || flags || entry_size < sizeof(struct ibv_gid_entry))
		return -EINVAL;
	d = emu_ctx(context)->dev;
	for (int p = 1; p <= d->port_count; p++) {
		for (int i = 0; i < d->ports[p].gid_tbl_len; i++) {
			const struct emu_gid_cfg *g = &d->ports[p].gids[i];
			struct ibv_gid_entry *e;
			if (!g->valid)
				continue;
			if (n == max_entries)
				return -EINVAL;
			e = (struct ibv_gid_entry *)((char *)entries + n * entry_size);
			memset(e, 0, entry_size);
			e->gid = g->gid;
			e->gid_index = (uint32_t)i;
			e->port_num = (uint32_t)p;
			e->gid_type = g->type;
			n++;
		}
	}
	return (ssize_t)n;
}

/* driver.h (IBVERBS_PRIVATE): the sysfs view of a GID's type. */
EMU_EXPORT int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num,
				  unsigned int index, unsigned int *type)
{
	const struct emu_gid_cfg *g;
	int err;

	if (!context || !type)
		return EINVAL;
	g = gid_at(context, port_num, index, &err);
	if (err) {
		errno = err;
		return -1;
	}
	*type = g->type == IBV_GID_TYPE_ROCE_V2 ? EMU_GID_TYPE_SYSFS_ROCE_V2
						 : EMU_GID_TYPE_SYSFS_IB_ROCE_V1;
	return 0;
}

EMU_EXPORT int ibv_query_pkey(struct ibv_context *context, uint8_t port_num,
			      int index, __be16 *pkey)
{
	struct emu_device *d;

	if (!context || !pkey)
		return -1;
	d = emu_ctx(context)->dev;
	if (port_num < 1 || port_num > d->port_count || index != 0) {
		errno = EINVAL;
		return -1;
	}
	*pkey = htobe16(0xffff);
	return 0;
}

EMU_EXPORT int ibv_get_pkey_index(struct ibv_context *context, uint8_t port_num,
				  __be16 pkey)
{
	(void)context;
	(void)port_num;
	if ((be16toh(pkey) & 0x7fff) == 0x7fff)
		return 0;
	errno = ENOENT;
	return -1;
}

/* ---- strings ------------------------------------------------------------ */

EMU_EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status)
{
	static const char *const s[] = {
		[IBV_WC_SUCCESS] = "success",
		[IBV_WC_LOC_LEN_ERR] = "local length error",
		[IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
		[IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
		[IBV_WC_LOC_PROT_ERR] = "local protection error",
		[IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
		[IBV_WC_MW_BIND_ERR] = "memory management operation error",
		[IBV_WC_BAD_RESP_ERR] = "bad response error",
		[IBV_WC_LOC_ACCESS_ERR] = "local access error",
		[IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
		[IBV_WC_REM_ACCESS_ERR] = "remote access error",
		[IBV_WC_REM_OP_ERR] = "remote operation error",
		[IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
		[IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
		[IBV_WC_LOC_RDD_VIOL_ERR] = "local RDD violation error",
		[IBV_WC_REM_INV_RD_REQ_ERR] = "remote invalid RD request",
		[IBV_WC_REM_ABORT_ERR] = "aborted error",
		[IBV_WC_INV_EECN_ERR] = "invalid EE context number",
		[IBV_WC_INV_EEC_STATE_ERR] = "invalid EE context state",
		[IBV_WC_FATAL_ERR] = "fatal error",
		[IBV_WC_RESP_TIMEOUT_ERR] = "response timeout error",
		[IBV_WC_GENERAL_ERR] = "general error",
		[IBV_WC_TM_ERR] = "TM error",
		[IBV_WC_TM_RNDV_INCOMPLETE] = "TM software rendezvous",
	};
	if ((unsigned)status < sizeof(s) / sizeof(s[0]) && s[status])
		return s[status];
	return "unknown";
}

EMU_EXPORT const char *ibv_node_type_str(enum ibv_node_type node_type)
{
	switch (node_type) {
	case IBV_NODE_CA: return "InfiniBand channel adapter";
	case IBV_NODE_SWITCH: return "InfiniBand switch";
	case IBV_NODE_ROUTER: return "InfiniBand router";
	case IBV_NODE_RNIC: return "iWARP NIC";
	case IBV_NODE_USNIC: return "usNIC";
	case IBV_NODE_USNIC_UDP: return "usNIC UDP";
	case IBV_NODE_UNSPECIFIED: return "unspecified";
	default: return "unknown";
	}
}

EMU_EXPORT const char *ibv_port_state_str(enum ibv_port_state port_state)
{
	switch (port_state) {
	case IBV_PORT_NOP: return "PORT_NOP";
	case IBV_PORT_DOWN: return "PORT_DOWN";
	case IBV_PORT_INIT: return "PORT_INIT";
	case IBV_PORT_ARMED: return "PORT_ARMED";
	case IBV_PORT_ACTIVE: return "PORT_ACTIVE";
	case IBV_PORT_ACTIVE_DEFER: return "PORT_ACTIVE_DEFER";
	default: return "invalid state";
	}
}

EMU_EXPORT const char *ibv_event_type_str(enum ibv_event_type event)
{
	switch (event) {
	case IBV_EVENT_CQ_ERR: return "CQ error";
	case IBV_EVENT_QP_FATAL: return "local work queue catastrophic error";
	case IBV_EVENT_QP_REQ_ERR: return "invalid request local work queue error";
	case IBV_EVENT_QP_ACCESS_ERR: return "local access violation work queue error";
	case IBV_EVENT_COMM_EST: return "communication established";
	case IBV_EVENT_SQ_DRAINED: return "send queue drained";
	case IBV_EVENT_PATH_MIG: return "path migrated";
	case IBV_EVENT_PATH_MIG_ERR: return "path migration request error";
	case IBV_EVENT_DEVICE_FATAL: return "local catastrophic error";
	case IBV_EVENT_PORT_ACTIVE: return "port active";
	case IBV_EVENT_PORT_ERR: return "port error";
	case IBV_EVENT_LID_CHANGE: return "LID change";
	case IBV_EVENT_PKEY_CHANGE: return "P_Key change";
	case IBV_EVENT_SM_CHANGE: return "SM change";
	case IBV_EVENT_SRQ_ERR: return "SRQ catastrophic error";
	case IBV_EVENT_SRQ_LIMIT_REACHED: return "SRQ limit reached";
	case IBV_EVENT_QP_LAST_WQE_REACHED: return "last WQE reached";
	case IBV_EVENT_CLIENT_REREGISTER: return "client reregistration";
	case IBV_EVENT_GID_CHANGE: return "GID table change";
	case IBV_EVENT_WQ_FATAL: return "WQ fatal";
	default: return "unknown";
	}
}

/* ---- fork, sysfs -------------------------------------------------------- */

EMU_EXPORT int ibv_fork_init(void)
{
	return 0;
}

EMU_EXPORT enum ibv_fork_status ibv_is_fork_initialized(void)
{
	return IBV_FORK_UNNEEDED;
}

EMU_EXPORT const char *ibv_get_sysfs_path(void)
{
	emu_init();
	return emu_g.sysfs_root;
}

EMU_EXPORT int ibv_read_sysfs_file(const char *dir, const char *file, char *buf,
				   size_t size)
{
	char path[PATH_MAX];
	int fd;
	ssize_t n;

	if (!dir || !file || !buf || size == 0)
		return -1;
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	n = read(fd, buf, size);
	close(fd);
	if (n <= 0)
		return -1;
	if ((size_t)n == size)
		n--;
	buf[n] = '\0';
	if (n > 0 && buf[n - 1] == '\n')
		buf[--n] = '\0';
	return (int)n;
}

/* ---- what the emulator does not do ------------------------------------- */

EMU_EXPORT struct ibv_srq *ibv_create_srq(struct ibv_pd *pd,
					  struct ibv_srq_init_attr *srq_init_attr)
{
	(void)pd;
	(void)srq_init_attr;
	errno = EOPNOTSUPP;
	return NULL;
}

EMU_EXPORT int ibv_destroy_srq(struct ibv_srq *srq)
{
	(void)srq;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *attr,
			      int mask)
{
	(void)srq;
	(void)attr;
	(void)mask;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *attr)
{
	(void)srq;
	(void)attr;
	return EOPNOTSUPP;
}

EMU_EXPORT struct ibv_ah *ibv_create_ah(struct ibv_pd *pd, struct ibv_ah_attr *attr)
{
	(void)pd;
	(void)attr;
	errno = EOPNOTSUPP;
	return NULL;
}

EMU_EXPORT int ibv_destroy_ah(struct ibv_ah *ah)
{
	(void)ah;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_init_ah_from_wc(struct ibv_context *context, uint8_t port_num,
				   struct ibv_wc *wc, struct ibv_grh *grh,
				   struct ibv_ah_attr *ah_attr)
{
	(void)context, (void)port_num, (void)wc, (void)grh, (void)ah_attr;
	errno = EOPNOTSUPP;
	return -1;
}

EMU_EXPORT struct ibv_ah *ibv_create_ah_from_wc(struct ibv_pd *pd, struct ibv_wc *wc,
						struct ibv_grh *grh, uint8_t port_num)
{
	(void)pd, (void)wc, (void)grh, (void)port_num;
	errno = EOPNOTSUPP;
	return NULL;
}

EMU_EXPORT int ibv_resolve_eth_l2_from_gid(struct ibv_context *context,
					   struct ibv_ah_attr *attr,
					   uint8_t eth_mac[ETHERNET_LL_SIZE],
					   uint16_t *vid)
{
	(void)context, (void)attr, (void)eth_mac, (void)vid;
	return EOPNOTSUPP;
}

/*
 * librdmacm is linked with immediate binding and needs these to load at
 * all (rdma-mummy-sys dlopens it next to us). They convert structs that
 * only a kernel RDMA-CM ioctl fills, which cannot succeed here, so they
 * are never reached with data; they leave the destination untouched.
 */
EMU_EXPORT void ibv_copy_qp_attr_from_kern(void *dst, const void *src);
EMU_EXPORT void ibv_copy_ah_attr_from_kern(void *dst, const void *src);
EMU_EXPORT void ibv_copy_path_rec_from_kern(void *dst, const void *src);
void ibv_copy_qp_attr_from_kern(void *dst, const void *src)
{
	(void)dst, (void)src;
}
void ibv_copy_ah_attr_from_kern(void *dst, const void *src)
{
	(void)dst, (void)src;
}
void ibv_copy_path_rec_from_kern(void *dst, const void *src)
{
	(void)dst, (void)src;
}

EMU_EXPORT int ibv_attach_mcast(struct ibv_qp *qp, const union ibv_gid *gid,
				uint16_t lid)
{
	(void)qp;
	(void)gid;
	(void)lid;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_detach_mcast(struct ibv_qp *qp, const union ibv_gid *gid,
				uint16_t lid)
{
	(void)qp;
	(void)gid;
	(void)lid;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_resize_cq(struct ibv_cq *cq, int cqe)
{
	(void)cq;
	(void)cqe;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_set_ece(struct ibv_qp *qp, struct ibv_ece *ece)
{
	(void)qp;
	(void)ece;
	errno = EOPNOTSUPP;
	return EOPNOTSUPP;
}

EMU_EXPORT int ibv_query_ece(struct ibv_qp *qp, struct ibv_ece *ece)
{
	(void)qp;
	(void)ece;
	errno = EOPNOTSUPP;
	return EOPNOTSUPP;
}
