/*
 * Protection domains and memory regions (host memory, iova, DMA-BUF), and
 * the process-wide lookup tables for MRs, QPs and CQs.
 */
#include "emu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HASH_BUCKETS 1024

/* ---- tables ------------------------------------------------------------- */

static pthread_rwlock_t mr_lock = PTHREAD_RWLOCK_INITIALIZER;
static struct emu_mr *mr_hash[HASH_BUCKETS];
static pthread_mutex_t qp_lock = PTHREAD_MUTEX_INITIALIZER;
static struct emu_qp *qp_hash[HASH_BUCKETS];
static pthread_mutex_t cq_lock = PTHREAD_MUTEX_INITIALIZER;
static struct emu_cq *cq_hash[HASH_BUCKETS];

static unsigned bucket(uint32_t key)
{
	return (key * 2654435761u) >> 22; /* top 10 bits */
}

void emu_mr_table_rdlock(void)
{
	pthread_rwlock_rdlock(&mr_lock);
}

void emu_mr_table_unlock(void)
{
	pthread_rwlock_unlock(&mr_lock);
}

struct emu_mr *emu_mr_lookup_locked(uint32_t lkey)
{
	for (struct emu_mr *m = mr_hash[bucket(lkey)]; m; m = m->hash_next)
		if (m->mr.lkey == lkey)
			return m;
	return NULL;
}

void emu_qp_table_lock(void)
{
	pthread_mutex_lock(&qp_lock);
}

void emu_qp_table_unlock(void)
{
	pthread_mutex_unlock(&qp_lock);
}

struct emu_qp *emu_qp_table_lookup_locked(uint32_t qpn)
{
	for (struct emu_qp *q = qp_hash[bucket(qpn)]; q; q = q->hash_next)
		if (q->qpx.qp_base.qp_num == qpn)
			return q;
	return NULL;
}

void emu_qp_table_insert(struct emu_qp *qp)
{
	unsigned b = bucket(qp->qpx.qp_base.qp_num);

	pthread_mutex_lock(&qp_lock);
	qp->hash_next = qp_hash[b];
	qp_hash[b] = qp;
	pthread_mutex_unlock(&qp_lock);
}

void emu_qp_table_remove(struct emu_qp *qp)
{
	unsigned b = bucket(qp->qpx.qp_base.qp_num);

	pthread_mutex_lock(&qp_lock);
	for (struct emu_qp **p = &qp_hash[b]; *p; p = &(*p)->hash_next) {
		if (*p == qp) {
			*p = qp->hash_next;
			break;
		}
	}
	pthread_mutex_unlock(&qp_lock);
}

void emu_cq_table_lock(void)
{
	pthread_mutex_lock(&cq_lock);
}

void emu_cq_table_unlock(void)
{
	pthread_mutex_unlock(&cq_lock);
}

struct emu_cq *emu_cq_table_lookup_locked(uint32_t handle)
{
	for (struct emu_cq *c = cq_hash[bucket(handle)]; c; c = c->hash_next)
		if (c->handle == handle)
			return c;
	return NULL;
}

void emu_cq_table_insert(struct emu_cq *cq)
{
	unsigned b = bucket(cq->handle);

	pthread_mutex_lock(&cq_lock);
	cq->hash_next = cq_hash[b];
	cq_hash[b] = cq;
	pthread_mutex_unlock(&cq_lock);
}

void emu_cq_table_remove(struct emu_cq *cq)
{
	unsigned b = bucket(cq->handle);

	pthread_mutex_lock(&cq_lock);
	for (struct emu_cq **p = &cq_hash[b]; *p; p = &(*p)->hash_next) {
		if (*p == cq) {
			*p = cq->hash_next;
			break;
		}
	}
	pthread_mutex_unlock(&cq_lock);
}

/* ---- protection domains ------------------------------------------------- */

EMU_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *context)
{
	static uint32_t pd_counter;
	struct emu_pd *pd;

	if (!context) {
		errno = EINVAL;
		return NULL;
	}
	pd = calloc(1, sizeof(*pd));
	if (!pd) {
		errno = ENOMEM;
		return NULL;
	}
	pd->ctx = emu_ctx(context);
	pd->id = __atomic_add_fetch(&pd_counter, 1, __ATOMIC_RELAXED);
	pd->pd.context = context;
	pd->pd.handle = pd->id;
	return &pd->pd;
}

EMU_EXPORT int ibv_dealloc_pd(struct ibv_pd *ibpd)
{
	struct emu_pd *pd = (struct emu_pd *)ibpd;

	if (!ibpd)
		return EINVAL;
	if (__atomic_load_n(&pd->refs, __ATOMIC_ACQUIRE) != 0)
		return EBUSY; /* MRs or QPs still use it, as on real hardware */
	free(pd);
	return 0;
}

/* ---- memory regions ----------------------------------------------------- */

#define SUPPORTED_ACCESS                                                       \
	(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |                    \
	 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |                   \
	 IBV_ACCESS_MW_BIND | IBV_ACCESS_ZERO_BASED | IBV_ACCESS_HUGETLB)

static int check_access(unsigned access)
{
	/* Optional bits (relaxed ordering, ...) may be ignored, as rdma-core does. */
	access &= ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE;
	if (access & IBV_ACCESS_ON_DEMAND)
		return EOPNOTSUPP;
	if (access & ~(unsigned)SUPPORTED_ACCESS)
		return EINVAL;
	/* The IB spec: remote write or atomic needs local write. */
	if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
	    !(access & IBV_ACCESS_LOCAL_WRITE))
		return EINVAL;
	return 0;
}

static struct ibv_mr *register_region(struct emu_pd *pd, int kind, uint64_t iova,
				      uint64_t length, uintptr_t host,
				      unsigned access, void *map_base,
				      size_t map_len)
{
	struct emu_mr *mr = calloc(1, sizeof(*mr));
	struct emu_mr_rec rec;
	uint32_t key;
	int err;

	if (!mr) {
		errno = ENOMEM;
		return NULL;
	}
	memset(&rec, 0, sizeof(rec));
	rec.owner = emu_self();
	rec.pd = pd->id;
	rec.iova = iova;
	rec.length = length;
	rec.host = host;
	rec.access = access & ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE;
	rec.kind = kind;
	err = emu_fabric_alloc_rkey(&rec, &key);
	if (err) {
		emu_log("cannot publish a memory region in %s/mr: %s",
			emu_g.fabric_dir, strerror(err));
		free(mr);
		errno = err;
		return NULL;
	}
	mr->pd = pd;
	mr->kind = kind;
	mr->iova = iova;
	mr->length = length;
	mr->host = host;
	mr->access = rec.access;
	mr->map_base = map_base;
	mr->map_len = map_len;
	mr->mr.context = pd->pd.context;
	mr->mr.pd = &pd->pd;
	mr->mr.addr = (void *)host;
	mr->mr.length = length;
	mr->mr.handle = key;
	mr->mr.lkey = key; /* lkey == rkey, as mlx5 does */
	mr->mr.rkey = key;

	pthread_rwlock_wrlock(&mr_lock);
	mr->hash_next = mr_hash[bucket(key)];
	mr_hash[bucket(key)] = mr;
	pthread_rwlock_unlock(&mr_lock);
	__atomic_add_fetch(&pd->refs, 1, __ATOMIC_ACQ_REL);
	emu_debug("registered MR key 0x%08x iova 0x%llx len %llu access 0x%x kind %d",
		  key, (unsigned long long)iova, (unsigned long long)length,
		  rec.access, kind);
	return &mr->mr;
}

EMU_EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *ibpd, void *addr,
					   size_t length, uint64_t iova,
					   unsigned int access)
{
	struct emu_pd *pd = (struct emu_pd *)ibpd;
	int err;

	if (!ibpd || length == 0) {
		errno = EINVAL;
		return NULL;
	}
	err = check_access(access);
	if (err) {
		errno = err;
		return NULL;
	}
	/* Like the kernel pinning pages: the range must exist, and be
	 * writable if anyone may write it. */
	err = emu_range_mapped((uintptr_t)addr, length,
			       access & (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE));
	if (err) {
		errno = err;
		return NULL;
	}
	if (access & IBV_ACCESS_ZERO_BASED)
		iova = 0;
	return register_region(pd, EMU_MR_HOST, iova, length, (uintptr_t)addr,
			       access, NULL, 0);
}

/* verbs.h turns these into macros around inlines; export the functions. */
#undef ibv_reg_mr
#undef ibv_reg_mr_iova
EMU_EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length,
				     int access)
{
	return ibv_reg_mr_iova2(pd, addr, length, (uintptr_t)addr, (unsigned)access);
}

EMU_EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr,
					  size_t length, uint64_t iova, int access)
{
	return ibv_reg_mr_iova2(pd, addr, length, iova, (unsigned)access);
}

/*
 * DMA-BUF registration. What a real HCA does with the fd, the emulator can
 * only do if the buffer can be mmap()ed into this process: then peers reach
 * it through that mapping like any host memory. GPU memory exported by
 * CUDA usually cannot be mapped; the MR is still registered (the verbs call
 * succeeds, as it would on a NIC), and only a WRITE/READ that touches it
 * fails: LOC_ACCESS_ERR on the local side, REM_ACCESS_ERR for a peer, with
 * vendor_err EMU_VENDOR_ERR_DMABUF_UNMAPPED.
 */
EMU_EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *ibpd, uint64_t offset,
					    size_t length, uint64_t iova, int fd,
					    int access)
{
	struct emu_pd *pd = (struct emu_pd *)ibpd;
	char link[64], target[256];
	struct stat st;
	uint64_t size;
	ssize_t n;
	int err;

	if (!ibpd) {
		errno = EINVAL;
		return NULL;
	}
	if (!pd->ctx->dev->dmabuf) {
		/* What a kernel or provider without DMA-BUF support answers. */
		errno = EOPNOTSUPP;
		return NULL;
	}
	if (fd < 0 || fcntl(fd, F_GETFD) < 0) {
		errno = EBADF;
		return NULL;
	}
	err = check_access((unsigned)access);
	if (err || length == 0) {
		errno = err ? err : EINVAL;
		return NULL;
	}
	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	n = readlink(link, target, sizeof(target) - 1);
	if (n < 0) {
		errno = EBADF;
		return NULL;
	}
	target[n] = '\0';
	/* A real dma-buf ("/dmabuf:..." or "anon_inode:dmabuf"), or a memfd
	 * standing in for one on machines without an exporter. */
	if (!strstr(target, "dmabuf") && strncmp(target, "/memfd:", 7) != 0) {
		emu_debug("reg_dmabuf_mr: fd %d is %s, not a dma-buf", fd, target);
		errno = EINVAL;
		return NULL;
	}
	if (fstat(fd, &st)) {
		errno = EBADF;
		return NULL;
	}
	size = (uint64_t)st.st_size;
	if (size == 0 && strstr(target, "dmabuf")) {
		off_t end = lseek(fd, 0, SEEK_END); /* dma-buf reports its size */
		size = end > 0 ? (uint64_t)end : 0;
	}
	if (offset + length < offset || offset + length > size) {
		errno = EINVAL;
		return NULL;
	}

	long page = sysconf(_SC_PAGESIZE);
	uint64_t aligned = offset & ~((uint64_t)page - 1);
	size_t map_len = (size_t)(offset + length - aligned);
	void *map = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
			 (off_t)aligned);
	if (map == MAP_FAILED)
		map = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, (off_t)aligned);
	struct ibv_mr *mr;
	if (map == MAP_FAILED) {
		static int told;
		if (!__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED))
			emu_log("note: DMA-BUF fd %d (%s) cannot be mapped here (%s); "
				"its MRs register, but a WRITE/READ touching them "
				"fails (vendor_err 0x%x)",
				fd, target, strerror(errno),
				EMU_VENDOR_ERR_DMABUF_UNMAPPED);
		mr = register_region(pd, EMU_MR_DMABUF_UNMAPPED, iova, length, 0,
				     (unsigned)access, NULL, 0);
	} else {
		uintptr_t host = (uintptr_t)map + (uintptr_t)(offset - aligned);
		mr = register_region(pd, EMU_MR_DMABUF_MAPPED, iova, length, host,
				     (unsigned)access, map, map_len);
		if (!mr)
			munmap(map, map_len);
	}
	if (mr)
		mr->addr = (void *)(uintptr_t)offset; /* what rdma-core reports */
	return mr;
}

EMU_EXPORT int ibv_dereg_mr(struct ibv_mr *ibmr)
{
	struct emu_mr *mr = (struct emu_mr *)ibmr;
	unsigned b;

	if (!ibmr)
		return EINVAL;
	b = bucket(ibmr->lkey);
	/* The write lock waits for our own posts that use this MR; the
	 * fabric removal waits for peers inside a transfer to it. */
	pthread_rwlock_wrlock(&mr_lock);
	for (struct emu_mr **p = &mr_hash[b]; *p; p = &(*p)->hash_next) {
		if (*p == mr) {
			*p = mr->hash_next;
			break;
		}
	}
	emu_fabric_remove_mr(ibmr->rkey);
	pthread_rwlock_unlock(&mr_lock);
	if (mr->map_base)
		munmap(mr->map_base, mr->map_len);
	__atomic_sub_fetch(&mr->pd->refs, 1, __ATOMIC_ACQ_REL);
	free(mr);
	return 0;
}
