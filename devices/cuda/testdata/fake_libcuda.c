/*
 * A test-only stand-in for libcuda.so.1, compiled by the plugin's unit tests
 * and pointed at with the cuda.library setting (FERRY_CUDA_LIBRARY). Never
 * shipped.
 *
 * It keeps "device memory" in host memory, but it is strict where the plugin
 * promises to be careful: calls that need a current context fail without one
 * (and are counted), streams must be used in their own context, pinned
 * allocations must be PORTABLE, DMA-BUF ranges must be page-aligned, and the
 * counters (fake_*) let a test check that every retain, allocation and
 * stream was given back.
 *
 * Build variants (-D):
 *   FAKE_MINIMAL            export cuInit only
 *   FAKE_INIT_RESULT=n      what cuInit returns (default 0)
 *   FAKE_DEVICES=n          how many devices (default 2)
 *   FAKE_PROC_ADDRESS       export cuGetProcAddress_v2 (else dlsym only)
 *   FAKE_DMABUF             export cuMemGetHandleForAddressRange
 *   FAKE_POINTER_NEEDS_CTX  cuPointerGetAttributes fails without a context
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKE_INIT_RESULT
#define FAKE_INIT_RESULT 0
#endif
#ifndef FAKE_DEVICES
#define FAKE_DEVICES 2
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

EXPORT CUresult cuInit(unsigned int flags) {
    return flags == 0 ? FAKE_INIT_RESULT : 1;
}

#ifndef FAKE_MINIMAL

#define SUCCESS 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_INITIALIZED 3
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define INVALID_HANDLE 400
#define NOT_FOUND 500

struct ctx {
    int device;
    int retains;
};
static struct ctx contexts[FAKE_DEVICES > 0 ? FAKE_DEVICES : 1];
static __thread struct ctx *current;

struct alloc {
    uint64_t base, size;
    int kind; /* 0 free slot, 1 pinned host, 2 device */
    int device;
};
#define MAX_ALLOCS 256
static struct alloc allocs[MAX_ALLOCS];
static int live_streams;
static int context_violations;
static int proc_address_calls;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

struct stream {
    struct ctx *ctx;
};

static int initialised(void) { return FAKE_INIT_RESULT == 0; }

static void violation(void) {
    pthread_mutex_lock(&lock);
    context_violations++;
    pthread_mutex_unlock(&lock);
}

/* The test's view. */
EXPORT int fake_live_retains(void) {
    int n = 0;
    for (int i = 0; i < FAKE_DEVICES; i++) n += contexts[i].retains;
    return n;
}
EXPORT int fake_live_allocations(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].kind != 0;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int fake_live_streams(void) { return live_streams; }
EXPORT int fake_context_violations(void) { return context_violations; }
EXPORT int fake_proc_address_calls(void) { return proc_address_calls; }
EXPORT void *fake_current_context(void) { return current; }
/* Makes `device`'s context current (or none for -1), as an application would. */
EXPORT void fake_set_current(int device) { current = device < 0 ? NULL : &contexts[device]; }

static const char *names[][2] = {
    {"CUDA_SUCCESS", "no error"},
    {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
};

static int describe(CUresult r, const char **name, const char **text) {
    switch (r) {
    case 0: case 1: case 2: case 3:
        *name = names[r][0];
        *text = names[r][1];
        return 1;
    case 100:
        *name = "CUDA_ERROR_NO_DEVICE";
        *text = "no CUDA-capable device is detected";
        return 1;
    case 201:
        *name = "CUDA_ERROR_INVALID_CONTEXT";
        *text = "invalid device context";
        return 1;
    case 804:
        *name = "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE";
        *text = "forward compatibility was attempted on non supported HW";
        return 1;
    default:
        return 0;
    }
}

EXPORT CUresult cuGetErrorName(CUresult r, const char **out) {
    const char *name, *text;
    if (!describe(r, &name, &text)) {
        *out = NULL;
        return INVALID_VALUE;
    }
    *out = name;
    return SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **out) {
    const char *name, *text;
    if (!describe(r, &name, &text)) {
        *out = NULL;
        return INVALID_VALUE;
    }
    *out = text;
    return SUCCESS;
}

EXPORT CUresult cuDriverGetVersion(int *v) {
    *v = 12040;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *n) {
    if (!initialised()) return NOT_INITIALIZED;
    *n = FAKE_DEVICES;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= FAKE_DEVICES) return INVALID_DEVICE;
    *d = ordinal;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char *buf, int len, CUdevice d) {
    snprintf(buf, (size_t)len, "Fake GPU %d", d);
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetPCIBusId(char *buf, int len, CUdevice d) {
    /* Device 1 has hex letters in its bus number, as the driver prints them. */
    snprintf(buf, (size_t)len, "00000000:%02X:00.0", 0x18 + 0x93 * d);
    return SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    *bytes = (size_t)(80 + d) << 30;
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(i * 16 + d);
    return SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attribute, CUdevice d) {
    switch (attribute) {
    case 75: *v = 9; return SUCCESS;           /* compute capability major */
    case 76: *v = 0; return SUCCESS;           /* minor */
    case 116: *v = d == 0; return SUCCESS;     /* GPU_DIRECT_RDMA_SUPPORTED */
    case 124: *v = d == 0; return SUCCESS;     /* DMA_BUF_SUPPORTED */
    default: return INVALID_VALUE;
    }
}

EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    if (d < 0 || d >= FAKE_DEVICES) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    contexts[d].device = d;
    contexts[d].retains++;
    pthread_mutex_unlock(&lock);
    *ctx = &contexts[d];
    return SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d < 0 || d >= FAKE_DEVICES) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    CUresult r = contexts[d].retains > 0 ? (contexts[d].retains--, SUCCESS) : INVALID_CONTEXT;
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuCtxGetCurrent(void **ctx) {
    *ctx = current;
    return SUCCESS;
}

EXPORT CUresult cuCtxSetCurrent(void *ctx) {
    current = ctx;
    return SUCCESS;
}

/* Returns the allocation holding p, or NULL. Call with lock held. */
static struct alloc *find(uint64_t p) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind && p >= allocs[i].base && p < allocs[i].base + allocs[i].size)
            return &allocs[i];
    return NULL;
}

static CUresult record(uint64_t base, uint64_t size, int kind, int device) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (!allocs[i].kind) {
            allocs[i] = (struct alloc){base, size, kind, device};
            pthread_mutex_unlock(&lock);
            return SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return OUT_OF_MEMORY;
}

static CUresult forget(uint64_t base, int kind) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(base);
    if (!a || a->base != base || a->kind != kind) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE;
    }
    a->kind = 0;
    pthread_mutex_unlock(&lock);
    free((void *)(uintptr_t)base);
    return SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    if (!current) return violation(), INVALID_CONTEXT;
    if (size == 0) return INVALID_VALUE;
    if (size > ((size_t)1 << 40)) return OUT_OF_MEMORY;
    void *m = NULL;
    if (posix_memalign(&m, 1 << 16, size) != 0) return OUT_OF_MEMORY;
    *p = (CUdeviceptr)(uintptr_t)m;
    return record(*p, size, 2, current->device);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    if (!current) return violation(), INVALID_CONTEXT;
    return forget(p, 2);
}

EXPORT CUresult cuMemHostAlloc(void **p, size_t size, unsigned int flags) {
    if (!current) return violation(), INVALID_CONTEXT;
    if (!(flags & 1)) return INVALID_VALUE; /* the plugin promises PORTABLE */
    void *m = NULL;
    if (posix_memalign(&m, 4096, size) != 0) return OUT_OF_MEMORY;
    *p = m;
    return record((uint64_t)(uintptr_t)m, size, 1, current->device);
}

EXPORT CUresult cuMemFreeHost(void *p) {
    if (!current) return violation(), INVALID_CONTEXT;
    return forget((uint64_t)(uintptr_t)p, 1);
}

EXPORT CUresult cuPointerGetAttributes(unsigned int n, int *attributes, void **data,
                                       CUdeviceptr p) {
#ifdef FAKE_POINTER_NEEDS_CTX
    if (!current) return INVALID_CONTEXT;
#endif
    if (p < 4096) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    struct alloc copy = a ? *a : (struct alloc){0, 0, 0, -1};
    pthread_mutex_unlock(&lock);
    for (unsigned int i = 0; i < n; i++) {
        switch (attributes[i]) {
        case 2: /* MEMORY_TYPE: 1 host, 2 device, 0 unknown */
            *(unsigned int *)data[i] = (unsigned int)copy.kind;
            break;
        case 8: /* IS_MANAGED */
            *(unsigned int *)data[i] = 0;
            break;
        case 9: /* DEVICE_ORDINAL */
            *(int *)data[i] = copy.device;
            break;
        case 11: /* RANGE_START_ADDR */
            *(CUdeviceptr *)data[i] = copy.base;
            break;
        case 12: /* RANGE_SIZE */
            *(size_t *)data[i] = copy.size;
            break;
        default:
            return INVALID_VALUE;
        }
    }
    return SUCCESS;
}

EXPORT CUresult cuStreamCreate(void **s, unsigned int flags) {
    if (!current) return violation(), INVALID_CONTEXT;
    if (flags != 1) return INVALID_VALUE; /* the plugin promises NON_BLOCKING */
    struct stream *st = malloc(sizeof *st);
    if (!st) return OUT_OF_MEMORY;
    st->ctx = current;
    __atomic_add_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
    *s = st;
    return SUCCESS;
}

static CUresult stream_check(struct stream *st) {
    if (!st) return INVALID_HANDLE;
    if (current != st->ctx) return violation(), INVALID_CONTEXT;
    return SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    free(s);
    __atomic_sub_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
    return SUCCESS;
}

EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(void *s) { return stream_check(s); }

#ifdef FAKE_DMABUF
EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size,
                                              int type, unsigned long long flags) {
    long page = sysconf(_SC_PAGESIZE);
    if (type != 1 || flags != 0) return INVALID_VALUE;
    if (p % (uint64_t)page || size % (size_t)page || size == 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int ok = a && a->kind == 2 && p + size <= a->base + a->size;
    pthread_mutex_unlock(&lock);
    if (!ok) return INVALID_VALUE;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 304;
    *(int *)handle = fd;
    return SUCCESS;
}
#endif

#ifdef FAKE_PROC_ADDRESS
struct entry {
    const char *name;
    void *fn;
};
static const struct entry table[] = {
    {"cuInit", (void *)cuInit},
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetName", (void *)cuDeviceGetName},
    {"cuDeviceGetPCIBusId", (void *)cuDeviceGetPCIBusId},
    {"cuDeviceTotalMem", (void *)cuDeviceTotalMem_v2},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid_v2},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxSetCurrent", (void *)cuCtxSetCurrent},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemHostAlloc", (void *)cuMemHostAlloc},
    {"cuMemFreeHost", (void *)cuMemFreeHost},
    {"cuPointerGetAttributes", (void *)cuPointerGetAttributes},
    {"cuStreamCreate", (void *)cuStreamCreate},
    {"cuStreamDestroy", (void *)cuStreamDestroy_v2},
    {"cuMemcpyAsync", (void *)cuMemcpyAsync},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize},
#ifdef FAKE_DMABUF
    {"cuMemGetHandleForAddressRange", (void *)cuMemGetHandleForAddressRange},
#endif
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version,
                                    unsigned long long flags, int *status) {
    __atomic_add_fetch(&proc_address_calls, 1, __ATOMIC_SEQ_CST);
    *fn = NULL;
    if (version != 12000 || flags != 0) {
        if (status) *status = 2; /* VERSION_NOT_SUFFICIENT: the plugin pins 12000 */
        return NOT_FOUND;
    }
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol) == 0) {
            *fn = table[i].fn;
            if (status) *status = 0;
            return SUCCESS;
        }
    }
    if (status) *status = 1; /* SYMBOL_NOT_FOUND */
    return NOT_FOUND;
}
#endif

#endif /* FAKE_MINIMAL */
