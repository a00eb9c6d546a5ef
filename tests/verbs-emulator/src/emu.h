/*
 * Ferry verbs emulator: internal declarations.
 *
 * A test-only libibverbs.so.1. It exposes the rdma-core ABI (struct layouts
 * from <infiniband/verbs.h>, the exported symbols and their versions) and
 * emulates RC queue pairs between processes of one host: metadata peers
 * must see lives in a "fabric" directory, bytes move with
 * process_vm_readv/process_vm_writev. Never shipped.
 */
#ifndef FERRY_VERBS_EMU_H
#define FERRY_VERBS_EMU_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <infiniband/verbs.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define EMU_EXPORT __attribute__((visibility("default")))
#define EMU_UNUSED __attribute__((unused))

#define EMU_MAX_DEVICES 64
#define EMU_MAX_PORTS 4
#define EMU_MAX_GIDS 16
#define EMU_MAX_SGE 30
#define EMU_MAX_INLINE 256
#define EMU_MAX_QP_WR 32768
#define EMU_MAX_CQE 4194303
#define EMU_MAX_RD_ATOMIC 16
#define EMU_MAX_MSG_SZ (1u << 30)
#define EMU_NUM_COMP_VECTORS 4

/* vendor_err values that say "this is the emulator's limit, not a bug". */
#define EMU_VENDOR_ERR_DMABUF_UNMAPPED 0xfe01u
#define EMU_VENDOR_ERR_PROCESS_VM_DENIED 0xfe02u
#define EMU_VENDOR_ERR_INJECTED 0xfe03u

/* The sysfs GID type values of rdma-core's driver.h (not installed by Debian). */
#define EMU_GID_TYPE_SYSFS_IB_ROCE_V1 0
#define EMU_GID_TYPE_SYSFS_ROCE_V2 1

/* ---- logging (log.c) ---------------------------------------------------- */

extern int emu_debug_enabled;
void emu_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define emu_debug(...)                                                         \
	do {                                                                   \
		if (emu_debug_enabled)                                         \
			emu_log(__VA_ARGS__);                                  \
	} while (0)

/* ---- configuration (config.c) ------------------------------------------- */

struct emu_gid_cfg {
	union ibv_gid gid;
	uint32_t type; /* enum ibv_gid_type: IBV_GID_TYPE_IB / ROCE_V1 / ROCE_V2 */
	int valid;
};

struct emu_port_cfg {
	int state;         /* enum ibv_port_state */
	uint8_t link_layer; /* IBV_LINK_LAYER_INFINIBAND / _ETHERNET */
	uint16_t lid;
	int active_mtu; /* enum ibv_mtu */
	uint8_t active_speed;
	uint8_t active_width;
	int gid_tbl_len;
	struct emu_gid_cfg gids[EMU_MAX_GIDS];
};

struct emu_fault_cfg {
	long port_down_after; /* -1: never */
	int port_down_port;
	long wc_error_every; /* 0: never */
	int wc_error_status; /* enum ibv_wc_status */
};

/* One configured device. ibdev must stay first: ibv_device pointers handed
 * out are &emu_device.ibdev. Lives for the whole process. */
struct emu_device {
	struct ibv_device ibdev;
	int index;
	char pci[32];
	uint64_t node_guid; /* host order */
	int dmabuf;
	uint32_t vendor_id;
	uint32_t vendor_part_id;
	char fw_ver[64];
	int port_count;
	struct emu_port_cfg ports[EMU_MAX_PORTS + 1]; /* 1-based */
	struct emu_fault_cfg fault;
	/* run time, process-wide */
	uint64_t wr_counter;                        /* atomic */
	int port_fault_announced[EMU_MAX_PORTS + 1]; /* atomic */
};

struct emu_global {
	pthread_mutex_t init_lock;
	int initialized;
	int init_errno; /* non-zero: config or fault spec was bad */
	struct emu_device *devs;
	int ndevs;
	char fabric_dir[PATH_MAX];
	int fabric_ready;
	int no_uverbs; /* fault: behave like a host without ib_uverbs */
	char sysfs_root[160]; /* device paths must fit IBV_SYSFS_PATH_MAX */
};

extern struct emu_global emu_g;

/* Parse config + faults from the environment. Returns 0 or an errno. */
int emu_load_config(void);
int emu_init(void); /* lazy, idempotent; returns 0 or errno */
int emu_parse_wc_status(const char *name, int *status);

/* ---- process identity and fabric (fabric.c) ----------------------------- */

struct emu_owner {
	pid_t pid;
	unsigned long long start; /* /proc/<pid>/stat field 22 */
};

struct emu_owner emu_self(void);
int emu_owner_alive(const struct emu_owner *o);
int emu_fabric_prepare(void); /* mkdir + sweep; returns 0 or errno */
void emu_fabric_forget_self(void); /* at exit */

/* A queue pair as peers see it. */
struct emu_qp_rec {
	struct emu_owner owner;
	char fifo[96]; /* async FIFO name under ctx/ */
	uint64_t guid;
	int port;
	uint16_t lid;
	uint8_t link_layer;
	int ngids;
	union ibv_gid gids[EMU_MAX_GIDS];
	int state; /* enum ibv_qp_state as the hardware sees it */
	uint32_t dest_qpn;
	uint32_t pd;
	unsigned access;
};

enum emu_mr_kind {
	EMU_MR_HOST = 0,
	EMU_MR_DMABUF_MAPPED = 1,
	EMU_MR_DMABUF_UNMAPPED = 2,
};

/* A memory region as peers see it. */
struct emu_mr_rec {
	struct emu_owner owner;
	uint32_t pd;
	uint64_t iova;
	uint64_t length;
	uint64_t host; /* owner's virtual address of iova */
	unsigned access;
	int kind;
};

int emu_fabric_alloc_qpn(const struct emu_qp_rec *rec, uint32_t *qpn);
int emu_fabric_write_qp(uint32_t qpn, const struct emu_qp_rec *rec);
int emu_fabric_read_qp(uint32_t qpn, struct emu_qp_rec *rec);
void emu_fabric_remove_qp(uint32_t qpn);
int emu_fabric_qp_error_marked(uint32_t qpn);
void emu_fabric_mark_qp_error(uint32_t qpn, const char *why);
void emu_fabric_clear_qp_error(uint32_t qpn);

int emu_fabric_alloc_rkey(const struct emu_mr_rec *rec, uint32_t *rkey);
/* Opens the MR record, takes a shared lock and parses it. On success *fd
 * holds the lock; close it after the transfer. Returns 0 or errno. */
int emu_fabric_lock_mr(uint32_t rkey, struct emu_mr_rec *rec, int *fd);
void emu_fabric_remove_mr(uint32_t rkey);

int emu_fabric_port_down(uint64_t guid, int port);
void emu_fabric_set_port_down(uint64_t guid, int port);

/* Async event FIFOs: one per open context. */
int emu_fabric_make_fifo(uint64_t guid, unsigned ctx_no, char *name, size_t len,
			 int *fd);
void emu_fabric_remove_fifo(const char *name);
void emu_fabric_send_event(const char *fifo, uint32_t type, uint32_t num);
void emu_fabric_broadcast_port_event(uint64_t guid, uint32_t type, uint32_t port);

/* Memory checks on our own address space (/proc/self/maps). */
int emu_range_mapped(uintptr_t start, size_t len, int need_write);

/* ---- objects ------------------------------------------------------------ */

struct emu_context {
	/* vctx.context is the ibv_context handed out; verbs_context keeps it
	 * last, so the ops that verbs_get_ctx_op() finds sit right before it. */
	struct verbs_context vctx;
	struct emu_device *dev;
	unsigned ctx_no;
	char fifo[96];
	int null_fd;
};

struct emu_pd {
	struct ibv_pd pd;
	struct emu_context *ctx;
	uint32_t id;
	int refs; /* atomic: MRs + QPs */
};

struct emu_mr {
	struct ibv_mr mr;
	struct emu_pd *pd;
	int kind;
	uint64_t iova;
	uint64_t length;
	uintptr_t host;
	unsigned access;
	void *map_base;
	size_t map_len;
	struct emu_mr *hash_next;
};

struct emu_cqe {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t vendor_err;
	uint32_t byte_len;
	uint32_t qp_num;
	uint32_t wqe_count; /* send WRs this completion retires */
	uint64_t ts_ns;
	uint64_t wallclock_ns;
	struct emu_qp *qp;
};

struct emu_channel {
	struct ibv_comp_channel ch;
	int wfd;
	int refs; /* atomic */
};

struct emu_cq {
	struct ibv_cq_ex cq; /* first: struct ibv_cq is its prefix */
	char abi_pad[64];    /* newer headers may append members */
	struct emu_context *ctx;
	pthread_mutex_t lock;      /* ring */
	pthread_mutex_t poll_lock; /* held from start_poll to end_poll */
	struct emu_cqe *ring;
	uint32_t cap, head, count;
	struct emu_cqe cur;
	int is_ex;
	uint64_t wc_flags;
	int armed;
	struct emu_channel *channel;
	int refs; /* atomic: QPs */
	uint32_t handle;
	int overflow_reported;
	struct emu_cq *hash_next;
};

/* One send work request, the common form of ibv_send_wr and the ibv_wr_*
 * builder. */
struct emu_wr {
	uint64_t wr_id;
	int opcode; /* enum ibv_wr_opcode, -1: unsupported builder call */
	const char *unsupported;
	unsigned flags;
	uint32_t rkey;
	uint64_t raddr;
	uint32_t num_sge;
	const struct ibv_sge *sge;
	struct ibv_sge sge_store[EMU_MAX_SGE];
	char *inline_buf; /* owned copy for ibv_wr_set_inline_data* */
	size_t inline_len;
	int has_data; /* set_sge/inline seen */
};

struct emu_recv {
	uint64_t wr_id;
};

struct emu_qp {
	struct ibv_qp_ex qpx; /* first: ibv_qp is qpx.qp_base */
	char abi_pad[64];
	struct emu_context *ctx;
	struct emu_pd *pd;
	struct emu_cq *scq, *rcq;
	pthread_mutex_t lock;
	int extended;
	uint64_t send_ops;
	struct ibv_qp_cap cap;
	int sq_sig_all;
	int hw_state; /* what the "hardware" thinks; qp_base.state is what
		       * ibv_modify_qp last set, exactly like rdma-core */
	/* attributes */
	int port;
	uint16_t pkey_index;
	unsigned access;
	int path_mtu;
	uint32_t dest_qpn, rq_psn, sq_psn, qkey;
	uint8_t timeout, retry_cnt, rnr_retry, min_rnr_timer;
	uint8_t max_rd_atomic, max_dest_rd_atomic;
	struct ibv_ah_attr ah;
	/* send queue accounting */
	uint32_t sq_inflight; /* atomic */
	uint32_t unsignaled;
	/* posted receives (held, flushed on error, never consumed) */
	struct emu_recv *rq;
	uint32_t rq_n, rq_cap;
	/* ibv_wr_* batch */
	struct emu_wr *batch;
	uint32_t batch_n, batch_cap;
	int batch_open;
	int batch_err;
	struct emu_qp *hash_next;
};

static inline struct emu_context *emu_ctx(struct ibv_context *c)
{
	return (struct emu_context *)((char *)c -
				      offsetof(struct emu_context, vctx.context));
}
static inline struct emu_qp *emu_qp_of(struct ibv_qp *qp)
{
	return (struct emu_qp *)qp;
}
static inline struct emu_qp *emu_qp_of_ex(struct ibv_qp_ex *qpx)
{
	return (struct emu_qp *)qpx;
}
static inline struct emu_cq *emu_cq_of(struct ibv_cq *cq)
{
	return (struct emu_cq *)cq;
}
static inline struct emu_cq *emu_cq_of_ex(struct ibv_cq_ex *cq)
{
	return (struct emu_cq *)cq;
}

/* Process-wide lookup tables (objects.c). */
struct emu_mr *emu_mr_lookup_locked(uint32_t lkey); /* caller holds rdlock */
void emu_mr_table_rdlock(void);
void emu_mr_table_unlock(void);
struct emu_qp *emu_qp_table_lookup_locked(uint32_t qpn);
void emu_qp_table_lock(void);
void emu_qp_table_unlock(void);
struct emu_cq *emu_cq_table_lookup_locked(uint32_t handle);
void emu_cq_table_lock(void);
void emu_cq_table_unlock(void);

/* Completion queue (cq.c). Push with the CQ's ring lock taken inside. */
void emu_cq_push(struct emu_cq *cq, const struct emu_cqe *cqe);
void emu_cq_scrub_qp(struct emu_cq *cq, struct emu_qp *qp);
int emu_create_cq_common(struct emu_context *ctx, int cqe, void *cq_context,
			 struct ibv_comp_channel *channel, int comp_vector,
			 int is_ex, uint64_t wc_flags, struct emu_cq **out);

/* Queue pairs (qp.c / datapath.c). */
void emu_qp_publish(struct emu_qp *qp);         /* rewrite fabric record */
void emu_qp_enter_error(struct emu_qp *qp);     /* qp->lock held */
void emu_qp_flush_recv(struct emu_qp *qp);      /* qp->lock held */
void emu_qp_sync_remote_error(struct emu_qp *qp); /* qp->lock held */
int emu_qp_execute(struct emu_qp *qp, struct emu_wr *wrs, uint32_t n,
		   uint32_t *failed_at); /* qp->lock held */
void emu_qp_init_ex_ops(struct emu_qp *qp);

/* Ports (device.c). */
int emu_port_is_down(struct emu_device *dev, int port);
void emu_fill_port_attr(struct emu_device *dev, int port,
			struct ibv_port_attr *attr);

/* Misc */
uint64_t emu_now_ns(int clock);
const char *emu_wc_status_name(int status);

#endif
