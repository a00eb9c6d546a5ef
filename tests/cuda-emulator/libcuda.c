/*
 * Ferry's CUDA emulator: a test-only libcuda.so.1 that runs the cuda device
 * plugin and the cuda-ipc transport's real code on a machine without a GPU
 * (as tests/verbs-emulator does for RDMA). Never shipped. Pointed at with
 * FERRY_CUDA_LIBRARY (tests/cuda_ipc.rs) or the plugin's cuda.library
 * setting (the plugin's unit tests, devices/cuda/src/tests.rs).
 *
 * "Device memory" is host memory in memfds, so that another process can
 * open it as a real driver lets it open GPU memory:
 *   - cuMemAlloc memory: one memfd per allocation. cuIpcGetMemHandle puts
 *     (pid, fd, size, nonce) in the 64-byte handle; cuIpcOpenMemHandle maps
 *     /proc/<pid>/fd/<fd> after checking that the file is that allocation
 *     (its name carries the nonce), so a forged or stale handle fails with
 *     CUDA_ERROR_INVALID_HANDLE. Opening a handle twice in one process fails
 *     with CUDA_ERROR_ALREADY_MAPPED, and in the exporting process with
 *     CUDA_ERROR_INVALID_CONTEXT, as the driver does.
 *   - with FERRY_CUDA_EMU_VMM_CHUNK=<bytes>, cuMemAlloc builds the
 *     allocation as PyTorch's expandable segments do: one reserved range
 *     with a VMM chunk (its own memfd) mapped every <bytes>. Such memory has
 *     no IPC handle; cuMemRetainAllocationHandle + cuMemExportToShareableHandle
 *     give an fd per chunk (unless FERRY_CUDA_EMU_NO_POSIX_FD is set), and
 *     cuMemImportFromShareableHandle + cuMemAddressReserve + cuMemMap open it.
 *
 * Strict where the real driver is, and where Ferry promises to be careful:
 * calls that need a context fail without a current one, streams are used in
 * their own context (both counted as context violations), pinned
 * allocations and registrations must be PORTABLE, DMA-BUF ranges must be
 * page-aligned. Copies happen when queued; events report done
 * FERRY_CUDA_EMU_COPY_DELAY_US after they are recorded (default 0), and
 * a stream with work queued reads as busy to cuStreamQuery (and
 * cuStreamSynchronize waits) for FERRY_CUDA_EMU_STREAM_DELAY_US (default
 * 0), so completion polling is exercised.
 *
 * Settings, read from the environment when used; a build fixes one with
 * -D<name>=<value> (then the environment is not asked for it), and
 * -DFERRY_CUDA_EMU_NO_ENV leaves every setting it does not fix at its
 * default (the plugin's unit tests share one process environment):
 *   FERRY_CUDA_EMU_DEVICES=n         how many devices (default 1)
 *   FERRY_CUDA_EMU_INIT_RESULT=n     what cuInit returns (default 0, or 100,
 *                                    CUDA_ERROR_NO_DEVICE, with no device);
 *                                    anything but 0 leaves the driver
 *                                    uninitialised
 *   FERRY_CUDA_EMU_DRIVER_VERSION=n  cuDriverGetVersion (default 13000)
 *   FERRY_CUDA_EMU_PCI_BUS=b0,b1...  each device's PCI bus number in hex
 *                                    (default 18, 28, 38...: 0x18 + 0x10 d)
 *   FERRY_CUDA_EMU_GPU_DIRECT=mask   devices (bit d: device d) that report
 *                                    GPUDirect RDMA and DMA-BUF support,
 *                                    attributes 116 and 124 (default 0)
 *   FERRY_CUDA_EMU_PEER=0            no peer access between devices
 *   FERRY_CUDA_EMU_NO_KERNEL=1       cuModuleLoadData refuses every image,
 *                                    as a driver too old for the PTX
 *   FERRY_CUDA_EMU_KERNEL_NOOP=1     launches of the copy kernel check their
 *                                    arguments and move nothing (to time
 *                                    the host's side of a launch alone;
 *                                    the bytes are then wrong)
 *   FERRY_CUDA_EMU_POINTER_NEEDS_CTX=1  cuPointerGetAttributes fails with
 *                                    CUDA_ERROR_INVALID_CONTEXT without a
 *                                    current context, as some drivers do
 *   FERRY_CUDA_EMU_VMM_CHUNK, FERRY_CUDA_EMU_NO_POSIX_FD,
 *   FERRY_CUDA_EMU_COPY_DELAY_US, FERRY_CUDA_EMU_STREAM_DELAY_US  above
 *
 * Build options (-D only: they decide what the library exports):
 *   FERRY_CUDA_EMU_MINIMAL       export cuInit only
 *   FERRY_CUDA_EMU_PROC_ADDRESS  export cuGetProcAddress_v2, which resolves
 *                                every function below at the CUDA version
 *                                whose ABI it has here (12000; 12080 for
 *                                cuMemcpyBatchAsync) and no other; without
 *                                it a loader finds functions by dlsym
 *   FERRY_CUDA_EMU_DMABUF        export cuMemGetHandleForAddressRange
 *                                (DMA-BUF fds of cuMemAlloc memory)
 *
 * Ferry's copy kernel: cuModuleLoadData accepts an image that declares the
 * entry ferry_copy_list (the cuda-ipc plugin's PTX) and nothing else;
 * cuLaunchKernel of it performs the copies its descriptor array names
 * (struct ferry_copy: src, dst, len) on the CPU, in stream order (as every
 * copy here, when queued). Its second entry, ferry_copy_layouts (found when
 * the image declares it), moves blocks of two layouts by index arrays,
 * piece by piece as the kernel splits them. cuMemcpyBatchAsync (the CUDA 12.8 ABI, with
 * failIdx) copies each entry likewise.
 *
 * Test hooks (exported, so dlsym finds them in the loaded emulator):
 *   ferry_cuda_emu_open_imports()        what this process has open of
 *                                        other processes' memory (IPC
 *                                        handles, mapped VMM chunks)
 *   ferry_cuda_emu_host_registrations()  its cuMemHostRegister ranges
 *   ferry_cuda_emu_calls(kind)           copy calls so far: 0 cuMemcpyAsync,
 *                                        1 kernel launches, 2
 *                                        cuMemcpyBatchAsync, 3 launches of
 *                                        ferry_copy_layouts; 4 counts
 *                                        cuStreamQuery's "not ready" answers
 *   ferry_cuda_emu_live_retains()        primary context retains not yet
 *                                        released, all devices
 *   ferry_cuda_emu_live_allocations()    allocations, registrations,
 *                                        mappings, reservations and
 *                                        allocation handles still held
 *   ferry_cuda_emu_live_streams()        streams not yet destroyed
 *   ferry_cuda_emu_context_violations()  calls refused for want of the
 *                                        right current context
 *   ferry_cuda_emu_proc_address_calls()  cuGetProcAddress_v2 calls
 *   ferry_cuda_emu_current_context()     this thread's current context
 *   ferry_cuda_emu_set_current(device)   makes device's primary context
 *                                        current on this thread (-1: none),
 *                                        as an application would
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

#define SUCCESS 0
#define INVALID_VALUE 1
#define OUT_OF_MEMORY 2
#define NOT_INITIALIZED 3
#define NO_DEVICE 100
#define INVALID_DEVICE 101
#define INVALID_CONTEXT 201
#define ALREADY_MAPPED 208
#define INVALID_HANDLE 400
#define NOT_READY 600
#define NOT_SUPPORTED 801

#define MAX_DEVICES 8
#define MAX_ALLOCS 4096

/* Settings fixed by the build (-DFERRY_CUDA_EMU_DEVICES=2): their values
 * as text, as the environment would give them. */
#define EMU_TEXT_(...) #__VA_ARGS__
#define EMU_TEXT(...) EMU_TEXT_(__VA_ARGS__)
static const struct {
    const char *name, *value;
} fixed_settings[] = {
#ifdef FERRY_CUDA_EMU_DEVICES
    {"FERRY_CUDA_EMU_DEVICES", EMU_TEXT(FERRY_CUDA_EMU_DEVICES)},
#endif
#ifdef FERRY_CUDA_EMU_INIT_RESULT
    {"FERRY_CUDA_EMU_INIT_RESULT", EMU_TEXT(FERRY_CUDA_EMU_INIT_RESULT)},
#endif
#ifdef FERRY_CUDA_EMU_DRIVER_VERSION
    {"FERRY_CUDA_EMU_DRIVER_VERSION", EMU_TEXT(FERRY_CUDA_EMU_DRIVER_VERSION)},
#endif
#ifdef FERRY_CUDA_EMU_PCI_BUS
    {"FERRY_CUDA_EMU_PCI_BUS", EMU_TEXT(FERRY_CUDA_EMU_PCI_BUS)},
#endif
#ifdef FERRY_CUDA_EMU_GPU_DIRECT
    {"FERRY_CUDA_EMU_GPU_DIRECT", EMU_TEXT(FERRY_CUDA_EMU_GPU_DIRECT)},
#endif
#ifdef FERRY_CUDA_EMU_PEER
    {"FERRY_CUDA_EMU_PEER", EMU_TEXT(FERRY_CUDA_EMU_PEER)},
#endif
#ifdef FERRY_CUDA_EMU_NO_KERNEL
    {"FERRY_CUDA_EMU_NO_KERNEL", EMU_TEXT(FERRY_CUDA_EMU_NO_KERNEL)},
#endif
#ifdef FERRY_CUDA_EMU_KERNEL_NOOP
    {"FERRY_CUDA_EMU_KERNEL_NOOP", EMU_TEXT(FERRY_CUDA_EMU_KERNEL_NOOP)},
#endif
#ifdef FERRY_CUDA_EMU_POINTER_NEEDS_CTX
    {"FERRY_CUDA_EMU_POINTER_NEEDS_CTX", EMU_TEXT(FERRY_CUDA_EMU_POINTER_NEEDS_CTX)},
#endif
#ifdef FERRY_CUDA_EMU_VMM_CHUNK
    {"FERRY_CUDA_EMU_VMM_CHUNK", EMU_TEXT(FERRY_CUDA_EMU_VMM_CHUNK)},
#endif
#ifdef FERRY_CUDA_EMU_NO_POSIX_FD
    {"FERRY_CUDA_EMU_NO_POSIX_FD", EMU_TEXT(FERRY_CUDA_EMU_NO_POSIX_FD)},
#endif
#ifdef FERRY_CUDA_EMU_COPY_DELAY_US
    {"FERRY_CUDA_EMU_COPY_DELAY_US", EMU_TEXT(FERRY_CUDA_EMU_COPY_DELAY_US)},
#endif
    {NULL, NULL},
};

/* A setting's value: fixed by the build, else the environment's; NULL when
 * unset. */
static const char *setting(const char *name) {
    for (int i = 0; fixed_settings[i].name; i++)
        if (strcmp(fixed_settings[i].name, name) == 0) return fixed_settings[i].value;
#ifdef FERRY_CUDA_EMU_NO_ENV
    return NULL;
#else
    return getenv(name);
#endif
}
static long env_long(const char *name, long dflt) {
    const char *v = setting(name);
    return v && *v ? strtol(v, NULL, 0) : dflt;
}
static int devices(void) {
    long n = env_long("FERRY_CUDA_EMU_DEVICES", 1);
    return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}
static int initialised;

EXPORT CUresult cuInit(unsigned int flags) {
    if (flags != 0) return INVALID_VALUE;
    long r = env_long("FERRY_CUDA_EMU_INIT_RESULT", devices() == 0 ? NO_DEVICE : SUCCESS);
    initialised = r == SUCCESS;
    return (CUresult)r;
}

#ifndef FERRY_CUDA_EMU_MINIMAL

struct ctx {
    int device;
    int retains;
};
static struct ctx contexts[MAX_DEVICES];
static __thread struct ctx *current;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

enum kind {
    FREE = 0,
    HOST_PINNED = 1,   /* cuMemHostAlloc */
    DEVICE = 2,        /* cuMemAlloc: one memfd */
    DEVICE_CHUNK = 3,  /* one VMM chunk of a cuMemAlloc in VMM mode */
    IMPORT_IPC = 4,    /* another process's cuMemAlloc, opened */
    IMPORT_CHUNK = 5,  /* a VMM chunk mapped by cuMemMap */
    RESERVED = 6,      /* cuMemAddressReserve, or a VMM-mode allocation's whole range */
    HOST_REGISTERED = 7,
};

struct alloc {
    uint64_t base, size;
    enum kind kind;
    int device;
    int fd;           /* DEVICE, DEVICE_CHUNK: the memfd */
    uint64_t nonce;   /* DEVICE: names the memfd; IMPORT_IPC: the handle's */
    uint64_t group;   /* DEVICE_CHUNK: the allocation's base */
    int posix_fd;     /* DEVICE_CHUNK: exportable */
};
static struct alloc allocs[MAX_ALLOCS];

/* VMM physical allocation handles: index + 1. */
struct handle {
    int fd; /* -1: free slot */
    uint64_t size;
    int device;
    int posix_fd;
    int refs;
};
static struct handle handles[MAX_ALLOCS];

struct ipc_handle {
    char magic[8]; /* "FERRYEMU" */
    int32_t pid;
    int32_t fd;
    uint64_t size;
    uint64_t nonce;
    int32_t device;
    char pad[64 - 8 - 4 - 4 - 8 - 8 - 4];
};
_Static_assert(sizeof(struct ipc_handle) == 64, "CUipcMemHandle is 64 bytes");

typedef struct {
    char reserved[64];
} CUipcMemHandle;

struct stream {
    struct ctx *ctx;
    /* Copies run at once here; with FERRY_CUDA_EMU_STREAM_DELAY_US, work
     * queued on a stream reads as unfinished (cuStreamQuery) until then. */
    uint64_t ready_at;
};
struct event {
    struct ctx *ctx;
    uint64_t ready_at;
};

static int live_streams;
static int context_violations;
static int proc_address_calls;

/* A call refused for want of the right current context: counted, so a
 * test sees the plugin's context discipline fail even where an error is
 * handled. */
static CUresult violation(void) {
    __atomic_add_fetch(&context_violations, 1, __ATOMIC_SEQ_CST);
    return INVALID_CONTEXT;
}
#define NEED_CONTEXT()                    \
    do {                                  \
        if (!current) return violation(); \
    } while (0)

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
static uint64_t random_u64(void) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != sizeof v) v = now_ns();
        close(fd);
    }
    return v | 1;
}

/* ------------------------------------------------------------- test hooks */

EXPORT int ferry_cuda_emu_open_imports(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++)
        n += allocs[i].kind == IMPORT_IPC || allocs[i].kind == IMPORT_CHUNK;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int ferry_cuda_emu_host_registrations(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].kind == HOST_REGISTERED;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int ferry_cuda_emu_live_retains(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_DEVICES; i++) n += contexts[i].retains;
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int ferry_cuda_emu_live_allocations(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += (allocs[i].kind != FREE) + (handles[i].refs > 0);
    pthread_mutex_unlock(&lock);
    return n;
}
EXPORT int ferry_cuda_emu_live_streams(void) {
    return __atomic_load_n(&live_streams, __ATOMIC_SEQ_CST);
}
EXPORT int ferry_cuda_emu_context_violations(void) {
    return __atomic_load_n(&context_violations, __ATOMIC_SEQ_CST);
}
EXPORT int ferry_cuda_emu_proc_address_calls(void) {
    return __atomic_load_n(&proc_address_calls, __ATOMIC_SEQ_CST);
}
EXPORT void *ferry_cuda_emu_current_context(void) { return current; }
EXPORT void ferry_cuda_emu_set_current(int device) {
    current = device < 0 || device >= MAX_DEVICES ? NULL : &contexts[device];
}

/* ----------------------------------------------------------------- basics */

static const char *error_name(CUresult r, const char **text) {
    switch (r) {
    case SUCCESS: *text = "no error"; return "CUDA_SUCCESS";
    case INVALID_VALUE: *text = "invalid argument"; return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: *text = "out of memory"; return "CUDA_ERROR_OUT_OF_MEMORY";
    case NOT_INITIALIZED: *text = "initialization error"; return "CUDA_ERROR_NOT_INITIALIZED";
    case NO_DEVICE: *text = "no CUDA-capable device is detected"; return "CUDA_ERROR_NO_DEVICE";
    case INVALID_DEVICE: *text = "invalid device ordinal"; return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_CONTEXT: *text = "invalid device context"; return "CUDA_ERROR_INVALID_CONTEXT";
    case ALREADY_MAPPED: *text = "resource already mapped"; return "CUDA_ERROR_ALREADY_MAPPED";
    case INVALID_HANDLE: *text = "invalid resource handle"; return "CUDA_ERROR_INVALID_HANDLE";
    case NOT_READY: *text = "device not ready"; return "CUDA_ERROR_NOT_READY";
    case NOT_SUPPORTED: *text = "operation not supported"; return "CUDA_ERROR_NOT_SUPPORTED";
    case 804: /* for FERRY_CUDA_EMU_INIT_RESULT=804 */
        *text = "forward compatibility was attempted on non supported HW";
        return "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE";
    default: return NULL;
    }
}
EXPORT CUresult cuGetErrorName(CUresult r, const char **out) {
    const char *text;
    *out = error_name(r, &text);
    return *out ? SUCCESS : INVALID_VALUE;
}
EXPORT CUresult cuGetErrorString(CUresult r, const char **out) {
    const char *text = NULL;
    if (!error_name(r, &text)) return *out = NULL, INVALID_VALUE;
    *out = text;
    return SUCCESS;
}
EXPORT CUresult cuDriverGetVersion(int *v) {
    *v = (int)env_long("FERRY_CUDA_EMU_DRIVER_VERSION", 13000);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
    if (!initialised) return NOT_INITIALIZED;
    *n = devices();
    return SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
    *d = ordinal;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char *buf, int len, CUdevice d) {
    snprintf(buf, (size_t)len, "Emulated GPU %d", d);
    return SUCCESS;
}
/* Device d's PCI bus number: the d-th of FERRY_CUDA_EMU_PCI_BUS, else
 * 0x18 + 0x10 d. */
static long pci_bus(int d) {
    const char *v = setting("FERRY_CUDA_EMU_PCI_BUS");
    for (int i = 0; v && *v; i++) {
        char *end;
        long bus = strtol(v, &end, 16);
        if (end == v) break;
        if (i == d) return bus;
        v = *end == ',' ? end + 1 : end;
    }
    return 0x18 + 0x10 * d;
}
EXPORT CUresult cuDeviceGetPCIBusId(char *buf, int len, CUdevice d) {
    snprintf(buf, (size_t)len, "00000000:%02lX:00.0", pci_bus(d));
    return SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) {
    *bytes = (size_t)(80 + d) << 30;
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) {
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xe0 + i + 16 * d);
    return SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int *v, int attribute, CUdevice d) {
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    switch (attribute) {
    case 36: *v = 2619000; return SUCCESS; /* memory clock, kHz (H200-like) */
    case 37: *v = 6144; return SUCCESS;    /* memory bus width, bits */
    case 75: *v = 9; return SUCCESS;
    case 76: *v = 0; return SUCCESS;
    case 91: *v = 1; return SUCCESS; /* CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM */
    case 116: /* GPU_DIRECT_RDMA_SUPPORTED */
    case 124: /* DMA_BUF_SUPPORTED */
        *v = (int)((env_long("FERRY_CUDA_EMU_GPU_DIRECT", 0) >> d) & 1);
        return SUCCESS;
    default: return INVALID_VALUE;
    }
}
EXPORT CUresult cuDeviceCanAccessPeer(int *can, CUdevice a, CUdevice b) {
    if (a < 0 || a >= devices() || b < 0 || b >= devices()) return INVALID_DEVICE;
    *can = a != b && env_long("FERRY_CUDA_EMU_PEER", 1) != 0;
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
    pthread_mutex_lock(&lock);
    contexts[d].device = d;
    contexts[d].retains++;
    pthread_mutex_unlock(&lock);
    *ctx = &contexts[d];
    return SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d < 0 || d >= devices()) return INVALID_DEVICE;
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

/* ---------------------------------------------------------- allocations */

/* The allocation holding p (innermost: chunks before their whole range).
 * Call with lock held. */
static struct alloc *find(uint64_t p) {
    struct alloc *outer = NULL;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &allocs[i];
        if (a->kind == FREE || p < a->base || p >= a->base + a->size) continue;
        if (a->kind != RESERVED) return a;
        outer = a;
    }
    return outer;
}
static struct alloc *slot(void) {
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind == FREE) return &allocs[i];
    return NULL;
}
static int is_device(enum kind k) {
    return k == DEVICE || k == DEVICE_CHUNK || k == IMPORT_IPC || k == IMPORT_CHUNK;
}

/* A memfd of `size` bytes named for `nonce`, mapped shared at `at` (or
 * anywhere when at is 0). */
static CUresult memfd_map(uint64_t size, uint64_t nonce, uint64_t at, int *fd_out, uint64_t *addr) {
    char name[64];
    snprintf(name, sizeof name, "ferry-cuda-emu-%016llx", (unsigned long long)nonce);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    void *m = mmap((void *)(uintptr_t)at, size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (at ? MAP_FIXED : 0), fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    *fd_out = fd;
    *addr = (uint64_t)(uintptr_t)m;
    return SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t size) {
    NEED_CONTEXT();
    if (size == 0) return INVALID_VALUE;
    if (size > ((size_t)1 << 40)) return OUT_OF_MEMORY;
    long chunk = env_long("FERRY_CUDA_EMU_VMM_CHUNK", 0);
    long page = sysconf(_SC_PAGESIZE);
    uint64_t total = (size + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;
    pthread_mutex_lock(&lock);
    if (chunk <= 0) {
        struct alloc *a = slot();
        uint64_t nonce = random_u64(), addr;
        int fd;
        CUresult r = a ? memfd_map(total, nonce, 0, &fd, &addr) : OUT_OF_MEMORY;
        if (r == SUCCESS) {
            *a = (struct alloc){addr, total, DEVICE, current->device, fd, nonce, 0, 0};
            *p = addr;
        }
        pthread_mutex_unlock(&lock);
        return r;
    }
    /* VMM mode: reserve, then a chunk (its own memfd) every `chunk` bytes. */
    uint64_t c = ((uint64_t)chunk + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;
    total = (total + c - 1) / c * c;
    void *range = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    struct alloc *whole = slot();
    if (range == MAP_FAILED || !whole) {
        pthread_mutex_unlock(&lock);
        return OUT_OF_MEMORY;
    }
    uint64_t base = (uint64_t)(uintptr_t)range;
    *whole = (struct alloc){base, total, RESERVED, current->device, -1, 0, base, 0};
    int posix = setting("FERRY_CUDA_EMU_NO_POSIX_FD") == NULL;
    for (uint64_t off = 0; off < total; off += c) {
        struct alloc *a = slot();
        uint64_t addr;
        int fd;
        if (!a || memfd_map(c, random_u64(), base + off, &fd, &addr) != SUCCESS) {
            pthread_mutex_unlock(&lock);
            return OUT_OF_MEMORY; /* a test machine out of memory: the test fails */
        }
        *a = (struct alloc){addr, c, DEVICE_CHUNK, current->device, fd, 0, base, posix};
    }
    pthread_mutex_unlock(&lock);
    *p = base;
    return SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    CUresult r = INVALID_VALUE;
    if (a && a->base == p && a->kind == DEVICE) {
        munmap((void *)(uintptr_t)a->base, a->size);
        close(a->fd);
        a->kind = FREE;
        r = SUCCESS;
    } else if (a && a->kind == DEVICE_CHUNK && a->group == p) {
        for (int i = 0; i < MAX_ALLOCS; i++) {
            struct alloc *b = &allocs[i];
            if (b->group != p || (b->kind != DEVICE_CHUNK && b->kind != RESERVED)) continue;
            if (b->kind == DEVICE_CHUNK) close(b->fd);
            else munmap((void *)(uintptr_t)b->base, b->size);
            b->kind = FREE;
        }
        r = SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuMemHostAlloc(void **p, size_t size, unsigned int flags) {
    NEED_CONTEXT();
    if (!(flags & 1)) return INVALID_VALUE; /* Ferry promises PORTABLE */
    void *m = NULL;
    if (size == 0 || posix_memalign(&m, 4096, size) != 0) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct alloc *a = slot();
    if (a) *a = (struct alloc){(uint64_t)(uintptr_t)m, size, HOST_PINNED, current->device, -1, 0, 0, 0};
    pthread_mutex_unlock(&lock);
    if (!a) return free(m), OUT_OF_MEMORY;
    *p = m;
    return SUCCESS;
}
EXPORT CUresult cuMemFreeHost(void *p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct alloc *a = find((uint64_t)(uintptr_t)p);
    int ok = a && a->kind == HOST_PINNED && a->base == (uint64_t)(uintptr_t)p;
    if (ok) a->kind = FREE;
    pthread_mutex_unlock(&lock);
    if (!ok) return INVALID_VALUE;
    free(p);
    return SUCCESS;
}
EXPORT CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
    NEED_CONTEXT();
    if (!(flags & 1) || size == 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = slot();
    if (a) *a = (struct alloc){(uint64_t)(uintptr_t)p, size, HOST_REGISTERED, current->device, -1, 0, 0, 0};
    pthread_mutex_unlock(&lock);
    return a ? SUCCESS : OUT_OF_MEMORY;
}
EXPORT CUresult cuMemHostUnregister(void *p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct alloc *a = find((uint64_t)(uintptr_t)p);
    int ok = a && a->kind == HOST_REGISTERED && a->base == (uint64_t)(uintptr_t)p;
    if (ok) a->kind = FREE;
    pthread_mutex_unlock(&lock);
    return ok ? SUCCESS : INVALID_VALUE;
}

EXPORT CUresult cuPointerGetAttributes(unsigned int n, int *attributes, void **data,
                                       CUdeviceptr p) {
    if (!current && env_long("FERRY_CUDA_EMU_POINTER_NEEDS_CTX", 0)) return INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    struct alloc copy = a ? *a : (struct alloc){0};
    pthread_mutex_unlock(&lock);
    if (!a || copy.kind == RESERVED) return INVALID_VALUE;
    for (unsigned int i = 0; i < n; i++) {
        switch (attributes[i]) {
        case 2: /* MEMORY_TYPE */
            *(unsigned int *)data[i] = is_device(copy.kind) ? 2 : 1;
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
        case 19: /* IS_LEGACY_CUDA_IPC_CAPABLE */
            *(unsigned int *)data[i] = copy.kind == DEVICE;
            break;
        default:
            return INVALID_VALUE;
        }
    }
    return SUCCESS;
}
EXPORT CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int ok = a && is_device(a->kind);
    if (ok) {
        if (base) *base = a->base;
        if (size) *size = a->size;
    }
    pthread_mutex_unlock(&lock);
    return ok ? SUCCESS : INVALID_VALUE;
}

/* ---------------------------------------------------------- legacy IPC */

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    if (!a || a->kind != DEVICE) {
        pthread_mutex_unlock(&lock);
        return INVALID_VALUE; /* VMM memory has no legacy IPC handle */
    }
    struct ipc_handle h = {{'F', 'E', 'R', 'R', 'Y', 'E', 'M', 'U'}, getpid(), a->fd, a->size,
                           a->nonce, a->device, {0}};
    pthread_mutex_unlock(&lock);
    memcpy(out, &h, sizeof h);
    return SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle handle, unsigned int flags) {
    NEED_CONTEXT();
    (void)flags;
    struct ipc_handle h;
    memcpy(&h, &handle, sizeof h);
    if (memcmp(h.magic, "FERRYEMU", 8) != 0 || h.size == 0) return INVALID_HANDLE;
    if (h.pid == getpid()) return INVALID_CONTEXT; /* the driver refuses the exporter itself */
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].kind == IMPORT_IPC && allocs[i].nonce == h.nonce) {
            pthread_mutex_unlock(&lock);
            return ALREADY_MAPPED;
        }
    }
    pthread_mutex_unlock(&lock);
    char path[64], link[256], want[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n < 0) return INVALID_HANDLE;
    link[n] = 0;
    snprintf(want, sizeof want, "/memfd:ferry-cuda-emu-%016llx", (unsigned long long)h.nonce);
    if (strncmp(link, want, strlen(want)) != 0) return INVALID_HANDLE;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != h.size) {
        close(fd);
        return INVALID_HANDLE;
    }
    void *m = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct alloc *a = slot();
    if (a) *a = (struct alloc){(uint64_t)(uintptr_t)m, h.size, IMPORT_IPC, h.device, -1, h.nonce, 0, 0};
    pthread_mutex_unlock(&lock);
    if (!a) return munmap(m, h.size), OUT_OF_MEMORY;
    *p = (uint64_t)(uintptr_t)m;
    return SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    NEED_CONTEXT();
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int ok = a && a->kind == IMPORT_IPC && a->base == p;
    if (ok) {
        munmap((void *)(uintptr_t)a->base, a->size);
        a->kind = FREE;
    }
    pthread_mutex_unlock(&lock);
    return ok ? SUCCESS : INVALID_VALUE;
}

/* ------------------------------------------------------------------ VMM */

static struct handle *handle_of(CUmemGenericAllocationHandle h) {
    if (h == 0 || h > MAX_ALLOCS || handles[h - 1].refs <= 0) return NULL;
    return &handles[h - 1];
}
static CUmemGenericAllocationHandle new_handle(int fd, uint64_t size, int device, int posix) {
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (handles[i].refs <= 0) {
            handles[i] = (struct handle){fd, size, device, posix, 1};
            return (CUmemGenericAllocationHandle)i + 1;
        }
    }
    return 0;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *p) {
    pthread_mutex_lock(&lock);
    struct alloc *a = find((uint64_t)(uintptr_t)p);
    CUresult r = INVALID_VALUE;
    if (a && (a->kind == DEVICE_CHUNK || a->kind == IMPORT_CHUNK)) {
        int fd = dup(a->fd);
        *out = fd >= 0 ? new_handle(fd, a->size, a->device, a->posix_fd) : 0;
        r = *out ? SUCCESS : (fd >= 0 ? close(fd) : 0, OUT_OF_MEMORY);
    }
    pthread_mutex_unlock(&lock);
    return r;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&lock);
    struct handle *x = handle_of(h);
    if (x && --x->refs == 0) close(x->fd);
    pthread_mutex_unlock(&lock);
    return x ? SUCCESS : INVALID_VALUE;
}
EXPORT CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) {
    if (type != 1 || flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct handle *x = handle_of(h);
    int posix = x && x->posix_fd;
    int fd = posix ? fcntl(x->fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&lock);
    if (!x) return INVALID_VALUE;
    if (!posix) return NOT_SUPPORTED; /* created without the POSIX fd handle type */
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)out = fd;
    return SUCCESS;
}
EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle,
                                               int type) {
    if (type != 1) return INVALID_VALUE;
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return INVALID_HANDLE;
    char path[64], link[256];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, link, sizeof link - 1);
    struct stat st;
    if (n < 0 || fstat(fd, &st) != 0) return close(fd), INVALID_HANDLE;
    link[n] = 0;
    if (strncmp(link, "/memfd:ferry-cuda-emu-", 22) != 0) return close(fd), INVALID_HANDLE;
    pthread_mutex_lock(&lock);
    *out = new_handle(fd, (uint64_t)st.st_size, 0, 1);
    pthread_mutex_unlock(&lock);
    return *out ? SUCCESS : (close(fd), OUT_OF_MEMORY);
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr,
                                    unsigned long long flags) {
    (void)align;
    if (size == 0 || addr != 0 || flags != 0) return INVALID_VALUE;
    void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    struct alloc *a = slot();
    if (a) *a = (struct alloc){(uint64_t)(uintptr_t)m, size, RESERVED, -1, -1, 0, 0, 0};
    pthread_mutex_unlock(&lock);
    if (!a) return munmap(m, size), OUT_OF_MEMORY;
    *p = (uint64_t)(uintptr_t)m;
    return SUCCESS;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    pthread_mutex_lock(&lock);
    struct alloc *a = NULL;
    for (int i = 0; i < MAX_ALLOCS; i++)
        if (allocs[i].kind == RESERVED && allocs[i].base == p && allocs[i].size == size) a = &allocs[i];
    if (a) {
        munmap((void *)(uintptr_t)p, size);
        a->kind = FREE;
    }
    pthread_mutex_unlock(&lock);
    return a ? SUCCESS : INVALID_VALUE;
}
EXPORT CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
    if (flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct handle *x = handle_of(h);
    struct alloc *r = find(p);
    CUresult res = INVALID_VALUE;
    if (x && r && r->kind == RESERVED && p + size <= r->base + r->size && offset + size <= x->size) {
        struct alloc *a = slot();
        void *m = a ? mmap((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                           x->fd, (off_t)offset)
                    : MAP_FAILED;
        if (m != MAP_FAILED) {
            *a = (struct alloc){p, size, IMPORT_CHUNK, x->device, dup(x->fd), 0, r->base, 1};
            res = SUCCESS;
        } else {
            res = OUT_OF_MEMORY;
        }
    }
    pthread_mutex_unlock(&lock);
    return res;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    pthread_mutex_lock(&lock);
    int found = 0;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        struct alloc *a = &allocs[i];
        if (a->kind == IMPORT_CHUNK && a->base >= p && a->base + a->size <= p + size) {
            mmap((void *)(uintptr_t)a->base, a->size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
            close(a->fd);
            a->kind = FREE;
            found = 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return found ? SUCCESS : INVALID_VALUE;
}
typedef struct {
    struct {
        int type, id;
    } location;
    int flags;
} CUmemAccessDesc;
EXPORT CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (count == 0 || !desc) return INVALID_VALUE;
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type != 1 || desc[i].location.id < 0 ||
            desc[i].location.id >= devices() || desc[i].flags != 3)
            return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    int ok = a && a->kind == IMPORT_CHUNK;
    (void)size;
    pthread_mutex_unlock(&lock);
    return ok ? SUCCESS : INVALID_VALUE;
}

/* ------------------------------------------------------ streams, events */

EXPORT CUresult cuStreamCreate(void **s, unsigned int flags) {
    NEED_CONTEXT();
    if (flags != 1) return INVALID_VALUE;
    struct stream *st = malloc(sizeof *st);
    if (!st) return OUT_OF_MEMORY;
    st->ctx = current;
    st->ready_at = 0;
    __atomic_add_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
    *s = st;
    return SUCCESS;
}
static CUresult stream_check(struct stream *st) {
    if (!st) return INVALID_HANDLE;
    return current == st->ctx ? SUCCESS : violation();
}
/* Work was queued on st: it finishes FERRY_CUDA_EMU_STREAM_DELAY_US from
 * now, as far as cuStreamQuery and cuStreamSynchronize tell. */
static void stream_queued(struct stream *st) {
    long delay = env_long("FERRY_CUDA_EMU_STREAM_DELAY_US", 0);
    if (st && delay > 0) st->ready_at = now_ns() + (uint64_t)delay * 1000;
}
EXPORT CUresult cuStreamDestroy_v2(void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    free(s);
    __atomic_sub_fetch(&live_streams, 1, __ATOMIC_SEQ_CST);
    return SUCCESS;
}
/* Both ranges must be memory this process may touch: host memory or
 * "device" memory (ours, or opened from a peer). */
/* Counted calls by kind; kind 4 counts cuStreamQuery's "not ready"
 * answers, so a test sees that the engine polled a stream. */
static long copy_calls[5];
EXPORT long ferry_cuda_emu_calls(int kind) {
    if (kind < 0 || kind > 4) return -1;
    pthread_mutex_lock(&lock);
    long n = copy_calls[kind];
    pthread_mutex_unlock(&lock);
    return n;
}
static void count_call(int kind) {
    pthread_mutex_lock(&lock);
    copy_calls[kind]++;
    pthread_mutex_unlock(&lock);
}
EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    stream_queued(s);
    count_call(0);
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return SUCCESS;
}
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    stream_queued(s);
    memcpy((void *)(uintptr_t)dst, src, n);
    return SUCCESS;
}

typedef struct {
    int type, id;
} CUmemLocation;
typedef struct {
    int srcAccessOrder;
    CUmemLocation srcLocHint, dstLocHint;
    unsigned int flags;
} CUmemcpyAttributes;

EXPORT CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                   CUmemcpyAttributes *attrs, size_t *attrsIdxs, size_t numAttrs,
                                   size_t *failIdx, void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    stream_queued(s);
    if (!dsts || !srcs || !sizes || !count || !attrs || !attrsIdxs || !numAttrs || numAttrs > count ||
        attrsIdxs[0] != 0)
        return INVALID_VALUE;
    for (size_t i = 0; i < numAttrs; i++)
        if (attrs[i].srcAccessOrder < 1 || attrs[i].srcAccessOrder > 3) return INVALID_VALUE;
    count_call(2);
    for (size_t i = 0; i < count; i++) {
        if (!sizes[i]) {
            if (failIdx) *failIdx = i;
            return INVALID_VALUE;
        }
        memmove((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
    }
    return SUCCESS;
}

/* ------------------------------------------------ modules, the copy kernel */

struct module {
    char magic[8]; /* "FERRYMOD" */
    struct ctx *ctx;
    int has_layouts; /* the image declares ferry_copy_layouts */
};
struct function {
    char magic[8]; /* "FERRYFUN" */
    struct module *module;
    int layouts; /* ferry_copy_layouts, not ferry_copy_list */
};
struct ferry_copy {
    uint64_t src, dst, len;
};

EXPORT CUresult cuModuleLoadData(void **m, const void *image) {
    NEED_CONTEXT();
    if (!m || !image) return INVALID_VALUE;
    if (setting("FERRY_CUDA_EMU_NO_KERNEL")) return 218; /* CUDA_ERROR_INVALID_PTX */
    if (!strstr(image, ".entry ferry_copy_list(")) return 218;
    struct module *mod = calloc(1, sizeof *mod);
    if (!mod) return OUT_OF_MEMORY;
    memcpy(mod->magic, "FERRYMOD", 8);
    mod->ctx = current;
    mod->has_layouts = strstr(image, ".entry ferry_copy_layouts(") != NULL;
    *m = mod;
    return SUCCESS;
}
EXPORT CUresult cuModuleUnload(void *m) {
    struct module *mod = m;
    if (!mod || memcmp(mod->magic, "FERRYMOD", 8)) return INVALID_HANDLE;
    memset(mod->magic, 0, 8);
    free(mod);
    return SUCCESS;
}
EXPORT CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    struct module *mod = m;
    if (!f || !name) return INVALID_VALUE;
    if (!mod || memcmp(mod->magic, "FERRYMOD", 8)) return INVALID_HANDLE;
    int layouts = !strcmp(name, "ferry_copy_layouts");
    if (layouts ? !mod->has_layouts : strcmp(name, "ferry_copy_list") != 0)
        return 500; /* CUDA_ERROR_NOT_FOUND */
    struct function *fn = calloc(1, sizeof *fn);
    if (!fn) return OUT_OF_MEMORY;
    memcpy(fn->magic, "FERRYFUN", 8);
    fn->module = mod;
    fn->layouts = layouts;
    *f = fn;
    return SUCCESS;
}
/* ferry_copy_layouts(const u64 *src_ids, const u64 *dst_ids, u64 src_base,
 * u64 src_stride, u64 dst_base, u64 dst_stride, u64 block, u64 piece,
 * unsigned count, unsigned pieces): item i of count * pieces is piece
 * i % pieces of block i / pieces, as the kernel splits them; refused when
 * pieces does not cover a block or the grid is not what the host computes
 * for that many items. */
static CUresult launch_layouts(unsigned gx, void **params) {
    const uint64_t *src_ids = *(const uint64_t **)params[0];
    const uint64_t *dst_ids = *(const uint64_t **)params[1];
    uint64_t src_base = *(const uint64_t *)params[2], src_stride = *(const uint64_t *)params[3];
    uint64_t dst_base = *(const uint64_t *)params[4], dst_stride = *(const uint64_t *)params[5];
    uint64_t block = *(const uint64_t *)params[6], piece = *(const uint64_t *)params[7];
    unsigned count = *(const unsigned *)params[8], pieces = *(const unsigned *)params[9];
    uint64_t items = (uint64_t)count * pieces;
    if (!src_ids || !dst_ids || !count || !block || !piece || pieces != (block + piece - 1) / piece)
        return INVALID_VALUE;
    if (gx > 65535 || (uint64_t)gx * 8 < (items < 65535 * 8 ? items : 65535 * 8)) return INVALID_VALUE;
    count_call(3);
    if (setting("FERRY_CUDA_EMU_KERNEL_NOOP")) return SUCCESS;
    for (uint64_t i = 0; i < items; i++) {
        uint64_t b = i / pieces, at = (i % pieces) * piece;
        uint64_t len = block - at < piece ? block - at : piece;
        memmove((void *)(uintptr_t)(dst_base + dst_ids[b] * dst_stride + at),
                (const void *)(uintptr_t)(src_base + src_ids[b] * src_stride + at), len);
    }
    return SUCCESS;
}

/* ferry_copy_list(const struct ferry_copy *list, unsigned int count). */
EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, void *s, void **params, void **extra) {
    struct function *fn = f;
    CUresult r = stream_check(s);
    if (r) return r;
    stream_queued(s);
    if (!fn || memcmp(fn->magic, "FERRYFUN", 8) || fn->module->ctx != current) return INVALID_HANDLE;
    if (!gx || gy != 1 || gz != 1 || bx != 256 || by != 1 || bz != 1 || shared || !params || extra)
        return INVALID_VALUE;
    if (fn->layouts) return launch_layouts(gx, params);
    const struct ferry_copy *list = *(const struct ferry_copy **)params[0];
    unsigned count = *(const unsigned *)params[1];
    if (!list || !count || gx > 65535 || (uint64_t)gx * 8 < (count < 65535 * 8 ? count : 65535 * 8))
        return INVALID_VALUE;
    count_call(1);
    if (setting("FERRY_CUDA_EMU_KERNEL_NOOP")) return SUCCESS;
    for (unsigned i = 0; i < count; i++)
        memmove((void *)(uintptr_t)list[i].dst, (const void *)(uintptr_t)list[i].src, list[i].len);
    return SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    while (now_ns() < ((struct stream *)s)->ready_at) usleep(50);
    return SUCCESS;
}
EXPORT CUresult cuStreamQuery(void *s) {
    CUresult r = stream_check(s);
    if (r) return r;
    if (now_ns() >= ((struct stream *)s)->ready_at) return SUCCESS;
    count_call(4);
    return NOT_READY;
}
EXPORT CUresult cuEventCreate(void **e, unsigned int flags) {
    (void)flags;
    NEED_CONTEXT();
    struct event *ev = calloc(1, sizeof *ev);
    if (!ev) return OUT_OF_MEMORY;
    ev->ctx = current;
    *e = ev;
    return SUCCESS;
}
EXPORT CUresult cuEventRecord(void *e, void *s) {
    struct event *ev = e;
    CUresult r = stream_check(s);
    if (r) return r;
    if (!ev || ev->ctx != current) return INVALID_HANDLE;
    ev->ready_at = now_ns() + (uint64_t)env_long("FERRY_CUDA_EMU_COPY_DELAY_US", 0) * 1000;
    return SUCCESS;
}
EXPORT CUresult cuEventQuery(void *e) {
    struct event *ev = e;
    if (!ev) return INVALID_HANDLE;
    return now_ns() >= ev->ready_at ? SUCCESS : NOT_READY;
}
EXPORT CUresult cuEventSynchronize(void *e) {
    struct event *ev = e;
    if (!ev) return INVALID_HANDLE;
    while (now_ns() < ev->ready_at) usleep(50);
    return SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(void *e) {
    if (!e) return INVALID_HANDLE;
    free(e);
    return SUCCESS;
}

/* --------------------------------------------------------------- DMA-BUF */

#ifdef FERRY_CUDA_EMU_DMABUF
/* A DMA-BUF fd (type 1, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) for a
 * page-aligned range of this process's cuMemAlloc memory, as the driver
 * requires; here a duplicate of the memfd holding its start. */
EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size, int type,
                                              unsigned long long flags) {
    NEED_CONTEXT();
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if (!handle || type != 1 || flags != 0) return INVALID_VALUE;
    if (size == 0 || p % page || size % page) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = find(p);
    uint64_t base = 0, end = 0;
    if (a && a->kind == DEVICE) {
        base = a->base;
        end = a->base + a->size;
    } else if (a && a->kind == DEVICE_CHUNK) { /* the whole VMM-mode allocation */
        for (int i = 0; i < MAX_ALLOCS; i++) {
            if (allocs[i].kind == RESERVED && allocs[i].base == a->group) {
                base = allocs[i].base;
                end = allocs[i].base + allocs[i].size;
            }
        }
    }
    int fd = base && p + size <= end ? fcntl(a->fd, F_DUPFD_CLOEXEC, 0) : -2;
    pthread_mutex_unlock(&lock);
    if (fd == -2) return INVALID_VALUE;
    if (fd < 0) return OUT_OF_MEMORY;
    *(int *)handle = fd;
    return SUCCESS;
}
#endif

/* ----------------------------------------------------- cuGetProcAddress */

#ifdef FERRY_CUDA_EMU_PROC_ADDRESS
/* Every function above by the name cuda.h gives it, with the CUDA version
 * whose ABI of it is implemented here. */
static const struct {
    const char *name;
    int version;
    void *fn;
} proc_table[] = {
    {"cuInit", 12000, (void *)(uintptr_t)cuInit},
    {"cuGetErrorName", 12000, (void *)(uintptr_t)cuGetErrorName},
    {"cuGetErrorString", 12000, (void *)(uintptr_t)cuGetErrorString},
    {"cuDriverGetVersion", 12000, (void *)(uintptr_t)cuDriverGetVersion},
    {"cuDeviceGetCount", 12000, (void *)(uintptr_t)cuDeviceGetCount},
    {"cuDeviceGet", 12000, (void *)(uintptr_t)cuDeviceGet},
    {"cuDeviceGetName", 12000, (void *)(uintptr_t)cuDeviceGetName},
    {"cuDeviceGetPCIBusId", 12000, (void *)(uintptr_t)cuDeviceGetPCIBusId},
    {"cuDeviceTotalMem", 12000, (void *)(uintptr_t)cuDeviceTotalMem_v2},
    {"cuDeviceGetUuid", 12000, (void *)(uintptr_t)cuDeviceGetUuid_v2},
    {"cuDeviceGetAttribute", 12000, (void *)(uintptr_t)cuDeviceGetAttribute},
    {"cuDeviceCanAccessPeer", 12000, (void *)(uintptr_t)cuDeviceCanAccessPeer},
    {"cuDevicePrimaryCtxRetain", 12000, (void *)(uintptr_t)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 12000, (void *)(uintptr_t)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", 12000, (void *)(uintptr_t)cuCtxGetCurrent},
    {"cuCtxSetCurrent", 12000, (void *)(uintptr_t)cuCtxSetCurrent},
    {"cuMemAlloc", 12000, (void *)(uintptr_t)cuMemAlloc_v2},
    {"cuMemFree", 12000, (void *)(uintptr_t)cuMemFree_v2},
    {"cuMemHostAlloc", 12000, (void *)(uintptr_t)cuMemHostAlloc},
    {"cuMemFreeHost", 12000, (void *)(uintptr_t)cuMemFreeHost},
    {"cuMemHostRegister", 12000, (void *)(uintptr_t)cuMemHostRegister_v2},
    {"cuMemHostUnregister", 12000, (void *)(uintptr_t)cuMemHostUnregister},
    {"cuPointerGetAttributes", 12000, (void *)(uintptr_t)cuPointerGetAttributes},
    {"cuMemGetAddressRange", 12000, (void *)(uintptr_t)cuMemGetAddressRange_v2},
    {"cuIpcGetMemHandle", 12000, (void *)(uintptr_t)cuIpcGetMemHandle},
    {"cuIpcOpenMemHandle", 12000, (void *)(uintptr_t)cuIpcOpenMemHandle_v2},
    {"cuIpcCloseMemHandle", 12000, (void *)(uintptr_t)cuIpcCloseMemHandle},
    {"cuMemRetainAllocationHandle", 12000, (void *)(uintptr_t)cuMemRetainAllocationHandle},
    {"cuMemRelease", 12000, (void *)(uintptr_t)cuMemRelease},
    {"cuMemExportToShareableHandle", 12000, (void *)(uintptr_t)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", 12000, (void *)(uintptr_t)cuMemImportFromShareableHandle},
    {"cuMemAddressReserve", 12000, (void *)(uintptr_t)cuMemAddressReserve},
    {"cuMemAddressFree", 12000, (void *)(uintptr_t)cuMemAddressFree},
    {"cuMemMap", 12000, (void *)(uintptr_t)cuMemMap},
    {"cuMemUnmap", 12000, (void *)(uintptr_t)cuMemUnmap},
    {"cuMemSetAccess", 12000, (void *)(uintptr_t)cuMemSetAccess},
    {"cuStreamCreate", 12000, (void *)(uintptr_t)cuStreamCreate},
    {"cuStreamDestroy", 12000, (void *)(uintptr_t)cuStreamDestroy_v2},
    {"cuMemcpyAsync", 12000, (void *)(uintptr_t)cuMemcpyAsync},
    {"cuMemcpyHtoDAsync", 12000, (void *)(uintptr_t)cuMemcpyHtoDAsync_v2},
    {"cuMemcpyBatchAsync", 12080, (void *)(uintptr_t)cuMemcpyBatchAsync},
    {"cuModuleLoadData", 12000, (void *)(uintptr_t)cuModuleLoadData},
    {"cuModuleUnload", 12000, (void *)(uintptr_t)cuModuleUnload},
    {"cuModuleGetFunction", 12000, (void *)(uintptr_t)cuModuleGetFunction},
    {"cuLaunchKernel", 12000, (void *)(uintptr_t)cuLaunchKernel},
    {"cuStreamSynchronize", 12000, (void *)(uintptr_t)cuStreamSynchronize},
    {"cuStreamQuery", 12000, (void *)(uintptr_t)cuStreamQuery},
    {"cuEventCreate", 12000, (void *)(uintptr_t)cuEventCreate},
    {"cuEventRecord", 12000, (void *)(uintptr_t)cuEventRecord},
    {"cuEventQuery", 12000, (void *)(uintptr_t)cuEventQuery},
    {"cuEventSynchronize", 12000, (void *)(uintptr_t)cuEventSynchronize},
    {"cuEventDestroy", 12000, (void *)(uintptr_t)cuEventDestroy_v2},
#ifdef FERRY_CUDA_EMU_DMABUF
    {"cuMemGetHandleForAddressRange", 12000, (void *)(uintptr_t)cuMemGetHandleForAddressRange},
#endif
};

/* Strict about versions: a function is found only at the CUDA version of
 * its ABI here, so a caller that stops pinning its ABI (Ferry asks for
 * 12000, and 12080 for cuMemcpyBatchAsync) is told so. */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **fn, int version,
                                    unsigned long long flags, int *status) {
    __atomic_add_fetch(&proc_address_calls, 1, __ATOMIC_SEQ_CST);
    if (!symbol || !fn) return INVALID_VALUE;
    *fn = NULL;
    for (size_t i = 0; i < sizeof proc_table / sizeof proc_table[0]; i++) {
        if (strcmp(proc_table[i].name, symbol) != 0) continue;
        if (version != proc_table[i].version || flags != 0) {
            if (status) *status = 2; /* CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT */
            return 500;              /* CUDA_ERROR_NOT_FOUND */
        }
        *fn = proc_table[i].fn;
        if (status) *status = 0;
        return SUCCESS;
    }
    if (status) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return 500;
}
#endif

#endif /* FERRY_CUDA_EMU_MINIMAL */
