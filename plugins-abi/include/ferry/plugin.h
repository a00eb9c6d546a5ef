/*
 * ferry/plugin.h - the Ferry plugin ABI, major version 1.
 *
 * This header is the whole contract between Ferry and a plugin. A vendor can
 * write a transport or device plugin in C or C++ against it alone; nothing in
 * it needs Rust. The Rust definitions in plugins-abi/src/sys.rs mirror it and a
 * test compares every size and offset.
 *
 * How a plugin is found and loaded
 *   A plugin is a shared object named libferry_transport_<name>.so or
 *   libferry_device_<name>.so, placed in a directory on FERRY_PLUGIN_PATH or in
 *   <prefix>/lib/ferry/plugins. Ferry opens it with RTLD_NOW | RTLD_LOCAL and
 *   calls its entry function, one per kind and ABI major:
 *
 *     const ferry_transport_plugin_v1_t *ferry_transport_plugin_v1(void);
 *     const ferry_device_plugin_v1_t    *ferry_device_plugin_v1(void);
 *
 *   The entry function must have no side effects and return a pointer to a
 *   table that lives as long as the library is loaded. The name in the table
 *   must match the file name. Every string a plugin gives Ferry (version,
 *   description, messages, probe findings) is treated as data: Ferry escapes
 *   control characters before it prints one, and keeps it exact in JSON.
 *
 * Versioning rules
 *   - Every struct that can grow begins with a uint32_t struct_size: tables
 *     (plugin tables, host services, the probe sink, init parameters) through
 *     ferry_abi_header_t (struct_size, abi_major, abi_minor, filled with
 *     FERRY_ABI_HEADER_INIT(type)), the others (ferry_mem_region_t,
 *     ferry_peer_info_t, ferry_probe_device_t, ferry_device_info_t,
 *     ferry_pointer_info_t) as their own first field, which the producer sets
 *     to sizeof the struct as it compiled it. (ferry_nic_desc_t grows through
 *     topo_nics's elem_size instead.)
 *   - A new major version gets a new entry symbol (ferry_transport_plugin_v2);
 *     Ferry may keep serving older majors through their own symbols.
 *   - Within a major version, fields are only ever appended and the minor
 *     version is raised. Each side reads a field the other side provides only
 *     when struct_size covers it: FERRY_HAS_FIELD(ptr, type, field) works on
 *     every one of the structs above.
 *   - Function pointers documented as "optional" may be NULL.
 *
 * Variable-length output (the sizing rule)
 *   A function that writes variable-length output into a caller's (buf, cap)
 *   always sets *len to the output's full length. When *len <= cap it wrote
 *   the output; when *len > cap it wrote nothing it must keep, still returns
 *   FERRY_OK, and Ferry calls it again with a buffer of at least *len bytes
 *   (get_endpoint, describe_peer; describe_peer's *len does not count the
 *   NUL, so Ferry's next buffer holds *len + 1). Such a call must therefore
 *   have no effect beyond its output. register_memory is the exception: it
 *   is not called again for its key (see there). config_get and topo_nics,
 *   the host's, follow the same rule for the plugin.
 *
 * Crashes
 *   Ferry first loads and probes a plugin in a short-lived child process
 *   (the ferry-probe helper shipped beside the plugins): a plugin whose
 *   constructors or probe crash, or whose probe does not return within
 *   FERRY_PLUGIN_PROBE_TIMEOUT_MS, is disabled with the signal or the
 *   timeout as its reason and is never loaded into the application.
 *   Results are cached per plugin file, host boot and configuration, so a
 *   later start does not run probe again: probe must not be where a plugin
 *   sets up anything that init needs.
 *
 * Errors
 *   Every fallible function returns a ferry_status_t (FERRY_OK or a negative
 *   FERRY_ERR_* code) and, on failure, writes a human message into the
 *   caller's ferry_errbuf_t with ferry_error() / ferry_errorf(). Messages are
 *   for operators: say what is missing and what to do about it.
 *
 * Threads
 *   Ferry may call a plugin from several threads at once, but never calls
 *   probe concurrently with itself for the same plugin within one process
 *   (separate processes may probe at the same time). A probe that timed out
 *   is not called again in that process.
 */
#ifndef FERRY_PLUGIN_H
#define FERRY_PLUGIN_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_PLUGIN_ABI_MAJOR 1
#define FERRY_PLUGIN_ABI_MINOR 7

/* ------------------------------------------------------------------------ */
/* Status codes (shared with the public C API in ferry.h)                    */
/* ------------------------------------------------------------------------ */

typedef int32_t ferry_status_t;

#define FERRY_OK 0
#define FERRY_ERR_INVALID_ARGUMENT (-1) /* a caller passed something wrong */
#define FERRY_ERR_UNSUPPORTED (-2)      /* not implemented by this plugin/host */
#define FERRY_ERR_UNAVAILABLE (-3)      /* cleanly not usable here (probe) */
#define FERRY_ERR_NOT_FOUND (-4)        /* unknown segment, buffer, key */
/* Address outside registered memory. A transport answers it for a remote
 * range its peer does not serve (never registered, unregistered, or a key
 * naming a revoked registration): the engine then reads the peer's
 * descriptor again and retries the request once with the current key. */
#define FERRY_ERR_OUT_OF_BOUNDS (-5)
#define FERRY_ERR_TIMEOUT (-6)
#define FERRY_ERR_CONNECTION (-7)   /* peer unreachable, reset or gone */
#define FERRY_ERR_PROTOCOL (-8)     /* malformed or unexpected bytes */
#define FERRY_ERR_NO_MEMORY (-9)    /* out of memory or another resource */
#define FERRY_ERR_BUSY (-10)        /* try again later */
#define FERRY_ERR_ABI_MISMATCH (-11)
#define FERRY_ERR_PLUGIN (-12)      /* a plugin failed in a way it explained */
#define FERRY_ERR_PANIC (-13)       /* a panic/exception was caught at the boundary */
#define FERRY_ERR_PERMISSION (-14)  /* refused by the OS or by authentication */
#define FERRY_ERR_CANCELLED (-15)
#define FERRY_ERR_IO (-16)          /* an OS call failed */
#define FERRY_ERR_INTERNAL (-17)    /* a bug in Ferry; please report it */

/* ------------------------------------------------------------------------ */
/* Common pieces                                                             */
/* ------------------------------------------------------------------------ */

typedef struct ferry_abi_header {
    uint32_t struct_size; /* sizeof the table as the producer compiled it */
    uint16_t abi_major;
    uint16_t abi_minor;
} ferry_abi_header_t;

#define FERRY_ABI_HEADER_INIT(type) \
    { (uint32_t)sizeof(type), FERRY_PLUGIN_ABI_MAJOR, FERRY_PLUGIN_ABI_MINOR }

/* The struct_size of any struct that can grow (see "Versioning rules"): its
 * first four bytes, whether they are ferry_abi_header_t's first field or the
 * struct's own (a pointer to a struct, converted, points to its first member). */
#define FERRY_STRUCT_SIZE(ptr) (*(const uint32_t *)(const void *)(ptr))

/* True when the struct behind ptr, of the given type, is large enough to
 * contain field: FERRY_HAS_FIELD(host, ferry_host_services_t, peer_request),
 * FERRY_HAS_FIELD(region, ferry_mem_region_t, dmabuf_offset). */
#define FERRY_HAS_FIELD(ptr, type, field) \
    ((size_t)FERRY_STRUCT_SIZE(ptr) >= offsetof(type, field) + sizeof(((type *)0)->field))

/* A caller-owned buffer for an error message. The callee writes a
 * NUL-terminated message, truncated to cap - 1 bytes. */
typedef struct ferry_errbuf {
    char *msg;
    size_t cap;
} ferry_errbuf_t;

static inline ferry_status_t ferry_error(ferry_errbuf_t *err, ferry_status_t code,
                                         const char *msg) {
    if (err != NULL && err->msg != NULL && err->cap > 0) {
        size_t n = msg != NULL ? strlen(msg) : 0;
        if (n >= err->cap) n = err->cap - 1;
        if (n > 0) memcpy(err->msg, msg, n);
        err->msg[n] = '\0';
    }
    return code;
}

static inline ferry_status_t ferry_errorf(ferry_errbuf_t *err, ferry_status_t code,
                                          const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static inline ferry_status_t ferry_errorf(ferry_errbuf_t *err, ferry_status_t code,
                                          const char *fmt, ...) {
    if (err != NULL && err->msg != NULL && err->cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, err->cap, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* Log levels for ferry_host_services_t.log. */
#define FERRY_LOG_ERROR 1
#define FERRY_LOG_WARN 2
#define FERRY_LOG_INFO 3
#define FERRY_LOG_DEBUG 4
#define FERRY_LOG_TRACE 5

/* Memory kinds (bit set): what a transport can move, what a device owns. */
#define FERRY_MEM_HOST (1ull << 0)         /* ordinary (pageable or pinned) host memory */
#define FERRY_MEM_CUDA_STAGED (1ull << 1)  /* CUDA memory, through host staging buffers */
#define FERRY_MEM_CUDA_DMABUF (1ull << 2)  /* CUDA memory, registered through DMA-BUF */
#define FERRY_MEM_CUDA_PEERMEM (1ull << 3) /* CUDA memory, registered through nvidia-peermem */
/* ABI 1.2: CUDA memory moved directly between processes of one host (CUDA IPC
 * handles or VMM shareable fds, copied by the GPU's copy engines). */
#define FERRY_MEM_CUDA_IPC (1ull << 4)

/* Where the peer of a transport may be (bit set). */
#define FERRY_SCOPE_SAME_PROCESS (1u << 0)
#define FERRY_SCOPE_SAME_HOST (1u << 1)
#define FERRY_SCOPE_CROSS_HOST (1u << 2)

/* ------------------------------------------------------------------------ */
/* Topology, as the host sees it                                             */
/* ------------------------------------------------------------------------ */

#define FERRY_NIC_KIND_RDMA 1 /* an RDMA device (/sys/class/infiniband) */
#define FERRY_NIC_KIND_NET 2  /* a network interface only (/sys/class/net) */

/* Path classes between a memory location and a NIC, best first, named as
 * `nvidia-smi topo -m` names them. */
#define FERRY_PATH_UNKNOWN 0
#define FERRY_PATH_PIX 1  /* through at most one PCIe switch */
#define FERRY_PATH_PXB 2  /* through several PCIe switches, no host bridge */
#define FERRY_PATH_PHB 3  /* through a PCIe host bridge */
#define FERRY_PATH_NODE 4 /* same NUMA node, different host bridges */
#define FERRY_PATH_SYS 5  /* across NUMA nodes */

#define FERRY_PORT_UNKNOWN 0
#define FERRY_PORT_DOWN 1
#define FERRY_PORT_ACTIVE 2

#define FERRY_LINK_UNKNOWN 0
#define FERRY_LINK_INFINIBAND 1
#define FERRY_LINK_ETHERNET 2

/* One NIC as the host describes it. The host writes at most elem_size bytes
 * of each element (see topo_nics), so new fields can be appended. */
typedef struct ferry_nic_desc {
    uint32_t kind;        /* FERRY_NIC_KIND_* */
    uint32_t path_class;  /* FERRY_PATH_* from the queried location */
    char name[64];        /* "mlx5_0" or "eth0" */
    char netdev[32];      /* the NIC's network interface, "" if none */
    char pci_bus_id[32];  /* "0000:19:00.0", "" if not a PCI device */
    int32_t numa_node;    /* -1 when unknown */
    uint32_t port_state;  /* FERRY_PORT_* */
    uint32_t link_layer;  /* FERRY_LINK_* */
    uint32_t reserved;
    uint64_t speed_mbps;  /* 0 when unknown */
} ferry_nic_desc_t;

/* ------------------------------------------------------------------------ */
/* Host services: what Ferry offers every plugin                             */
/* ------------------------------------------------------------------------ */

typedef struct ferry_host_services {
    ferry_abi_header_t hdr;
    void *ctx; /* pass back as the first argument of every service */

    /* Log a message under the plugin's name. Never fails. */
    void (*log)(void *ctx, int32_t level, const char *msg);
    /* Nonzero when a message at this level would be printed. */
    int32_t (*log_enabled)(void *ctx, int32_t level);

    /* Look up a setting. Copies the value (NUL-terminated, truncated to
     * cap) and returns its full length without the NUL, or -1 when the key
     * is unset. Values are text; check them and refuse a bad one with
     * FERRY_ERR_INVALID_ARGUMENT and a message naming the key.
     *
     * Your own settings have a dot, "<plugin>.<option>" ("tcp.connections"):
     * the engine's configuration first (ferry_config_set, Python settings),
     * then the environment variable FERRY_<PLUGIN>_<OPTION>
     * (FERRY_TCP_CONNECTIONS).
     *
     * Settings the engine hands every plugin, from its own configuration
     * only (never read from the environment by this call; already checked):
     *   "timeout_ms"          deadline of a network wait, ms (default 15000)
     *   "connect_timeout_ms"  deadline of a connection attempt, ms (5000)
     *   "idle_timeout_s"      close a served connection idle this long, s (120)
     *   "sysfs_root"          where to read sysfs ("/sys"; fake trees in tests)
     *   "hostname"            the host peers reach this engine at; advertise it
     *                         when listening on every interface (unset while
     *                         `ferry info` probes)
     *   "auth.token"          the cluster's shared secret (or this user's
     *                         token when none is configured); unset with
     *                         FERRY_AUTH=off. Prove it on every connection you
     *                         accept or open, and tag what follows with the
     *                         session keys; never log or send it.
     *   "auth_timeout_ms"     a connection you accept must authenticate
     *                         within this, ms (1000)
     *   "auth.max_pending"    connections authenticating at once on your
     *                         listener (64), and per source address:
     *   "auth.max_pending_per_host"  (8); answer more with BUSY
     *   "integrity"           "payload" when payloads are to be tagged too
     *                         (unset: headers only)
     * docs/configuration.md lists the engine's own settings. */
    int64_t (*config_get)(void *ctx, const char *key, char *buf, size_t cap);

    /* NICs as seen from a memory location ("cpu:0", "cuda:3"), best first,
     * or every NIC in discovery order when location is NULL. Writes up to
     * cap elements of elem_size bytes each (pass sizeof(ferry_nic_desc_t))
     * and sets *count to the number of NICs that exist, which may exceed
     * cap. FERRY_ERR_NOT_FOUND for an unknown location. */
    ferry_status_t (*topo_nics)(void *ctx, const char *location, ferry_nic_desc_t *out,
                                size_t elem_size, uint32_t cap, uint32_t *count);

    /* --- ABI 1.1 (check with FERRY_HAS_FIELD) --- */

    /* Plugin messaging: sends `body` to the transport of the same name in the
     * engine serving segment `peer` ("host:port"), over Ferry's control
     * plane, and waits (up to the engine's timeout) for its reply, which
     * that transport's on_peer_request produced. For handshakes such as
     * exchanging queue pair numbers. body_len and the reply are at most
     * FERRY_PEER_MSG_MAX bytes: pass a reply buffer of that size. Writes at
     * most reply_cap bytes and sets *reply_len to the reply's full length
     * (a longer reply is an error: FERRY_ERR_PROTOCOL). Errors: the peer is
     * unreachable (FERRY_ERR_CONNECTION, FERRY_ERR_TIMEOUT), runs no such
     * transport (FERRY_ERR_NOT_FOUND), or the peer's transport refused (its
     * code and message). May block; never call it while holding a lock the
     * plugin's own on_peer_request needs. */
    ferry_status_t (*peer_request)(void *ctx, const char *peer, const uint8_t *body,
                                   size_t body_len, uint8_t *reply, size_t reply_cap,
                                   size_t *reply_len, ferry_errbuf_t *err);

    /* --- ABI 1.2 (check with FERRY_HAS_FIELD) --- */

    /* Adds delta to this plugin's counter `name` ("nic_pauses", "retries",
     * "refused_unauthenticated"), for one of its devices ("mlx5_0") or NULL
     * for none. Names are [a-z0-9_], at most 63 bytes; the engine exports
     * each as ferry_plugin_<name>_total, labelled with the transport and the
     * device. Cheap (no allocation once a counter exists), callable from any
     * thread, never fails; a malformed name is ignored. */
    void (*count)(void *ctx, const char *name, const char *device, uint64_t delta);
} ferry_host_services_t;

/* The largest plugin message, request or reply (see peer_request). */
#define FERRY_PEER_MSG_MAX 65536

/* ------------------------------------------------------------------------ */
/* Probe: what a plugin could do on this host                                */
/* ------------------------------------------------------------------------ */

struct ferry_device_info; /* below, with the device plugins */

/* A device a plugin would use, reported from probe. Strings are copied by
 * the host before add_device returns. */
typedef struct ferry_probe_device {
    uint32_t struct_size; /* sizeof(ferry_probe_device_t) */
    int32_t numa_node;    /* -1 when unknown */
    const char *name;     /* required: "mlx5_0", "eth0", "cuda:0" */
    const char *pci_bus_id; /* optional */
    const char *detail;     /* optional: "RoCE v2, port 1 ACTIVE, 200 Gb/s" */
    uint64_t mem_kinds;     /* FERRY_MEM_* this device can serve: the bits it moves
                             * directly (FERRY_MEM_HOST, _CUDA_DMABUF, _CUDA_PEERMEM,
                             * _CUDA_IPC), or FERRY_MEM_CUDA_STAGED for device memory
                             * it moves only through host staging buffers */
    /* --- ABI 1.2 (the host reads these only when struct_size covers them) --- */
    uint64_t bandwidth_mbps; /* what this device sustains for one peer, in Mbit/s
                              * (a 400 Gbit/s NIC: 400000); 0: unknown, and the host
                              * assumes a conservative figure for the plugin's scope */
    uint32_t latency_ns;     /* a small request's completion time, in ns; 0: unknown */
    uint32_t reserved;       /* 0 */
    /* --- ABI 1.6 (the host reads it only when struct_size covers it) --- */
    const struct ferry_device_info *gpu; /* device plugins: this device as device_info
                                          * describes it (the same facts), so that
                                          * `ferry info` knows each GPU and its GPU-direct
                                          * method without starting the plugin; NULL
                                          * for anything else. Copied before add_device
                                          * returns. */
} ferry_probe_device_t;

/* Where probe reports its findings. The host copies every string. */
typedef struct ferry_probe_sink {
    ferry_abi_header_t hdr;
    void *ctx;
    /* What the plugin can serve on this host: FERRY_MEM_* and FERRY_SCOPE_*. */
    void (*set_capabilities)(void *ctx, uint64_t mem_kinds, uint32_t scopes);
    void (*add_device)(void *ctx, const ferry_probe_device_t *device);
    /* A capability this host lacks, in words an operator can act on, e.g.
     * ("cuda-dmabuf", "the NVIDIA driver is older than 515"). */
    void (*add_missing)(void *ctx, const char *capability, const char *reason);
    /* Any other fact worth showing in `ferry info`. */
    void (*add_note)(void *ctx, const char *key, const char *value);
    /* --- ABI 1.5 (call only when hdr.struct_size covers it) --- */
    /* One way this plugin registers a kind of memory (one FERRY_MEM_* bit,
     * e.g. FERRY_MEM_CUDA_DMABUF) and whether it works on this host:
     * available 1 with how, or 0 with why not, in words an operator can act
     * on. The host decides how GPU memory is registered from these, by the
     * bit, never from a plugin's or capability's name. */
    void (*add_memory_method)(void *ctx, uint64_t mem_kind, int32_t available,
                              const char *detail);
} ferry_probe_sink_t;

/* probe has no side effects on the host (no devices opened for writing, no
 * memory registered, no threads left behind). It usually runs in a child
 * process of the application (see "Crashes" above), and its result may be
 * reused by later processes; host services answer it as they would in the
 * application. It returns:
 *   FERRY_OK               the plugin is usable here;
 *   FERRY_ERR_UNAVAILABLE  it is cleanly not usable (no device, library
 *                          missing), with the reason in err;
 *   anything else          it failed; the reason in err. */
typedef ferry_status_t (*ferry_probe_fn)(const ferry_host_services_t *host,
                                         const ferry_probe_sink_t *sink, ferry_errbuf_t *err);

/* ------------------------------------------------------------------------ */
/* Transport plugins                                                         */
/* ------------------------------------------------------------------------ */

/* Operations. */
#define FERRY_OP_READ 0  /* remote -> local */
#define FERRY_OP_WRITE 1 /* local -> remote */

/* Called by a plugin once per accepted request, from any thread, possibly
 * before submit returns. msg may be NULL on success; on failure it explains. */
typedef void (*ferry_complete_fn)(void *completion_ctx, uint64_t token, ferry_status_t status,
                                  const char *msg);

/* What the engine tells a transport instance when it creates it. */
typedef struct ferry_transport_init_params {
    ferry_abi_header_t hdr;
    const char *engine_name; /* "host:port", for log lines */
    const char *listen_host; /* host or IP the engine listens on: bind data listeners here */
    void *completion_ctx;
    ferry_complete_fn complete;
} ferry_transport_init_params_t;

/* A buffer the engine registers with a transport. mem_kind says how the
 * engine wants device memory registered: FERRY_MEM_CUDA_DMABUF (dmabuf_fd and
 * dmabuf_offset are set), or FERRY_MEM_CUDA_PEERMEM (addr is the device
 * pointer, for ibv_reg_mr through nvidia-peermem). A transport that cannot
 * register it that way fails with FERRY_ERR_UNAVAILABLE and the reason; the
 * engine then tries the next method down (DMA-BUF, nvidia-peermem, staging
 * through host memory). */
typedef struct ferry_mem_region {
    uint32_t struct_size;
    int32_t numa_node;    /* NUMA node of host memory, -1 when unknown */
    uint64_t addr;
    uint64_t len;
    uint64_t mem_kind;    /* one FERRY_MEM_* bit */
    const char *location; /* "cpu:0", "cuda:3" */
    int32_t device_ordinal; /* CUDA ordinal for device memory, else -1 */
    int32_t dmabuf_fd;      /* for FERRY_MEM_CUDA_DMABUF, else -1; owned by the engine */
    uint32_t flags;         /* FERRY_REGION_* */
    uint32_t reserved;
    /* --- ABI 1.1 (check struct_size) --- */
    uint64_t dmabuf_offset; /* addr's offset inside the dmabuf_fd's buffer: register with
                             * ibv_reg_dmabuf_mr(pd, dmabuf_offset, len, iova = addr,
                             * dmabuf_fd, access) */
    /* --- ABI 1.2 (check struct_size) --- */
    int32_t share_fd;       /* host memory the engine allocated: a file (memfd) holding
                             * it that same-host peers may map, owned by the engine
                             * (dup it to keep it past unregister_memory); else -1 */
    uint32_t reserved2;     /* 0 */
    uint64_t share_offset;  /* addr's offset inside share_fd */
} ferry_mem_region_t;

/* The engine uses the region only as a local buffer (e.g. a staging buffer):
 * peers must not be able to reach it. */
#define FERRY_REGION_LOCAL_ONLY (1u << 0)

/* A peer as the engine knows it from the peer's segment descriptor. */
typedef struct ferry_peer_info {
    uint32_t struct_size;
    uint32_t scope;          /* one FERRY_SCOPE_* bit: where the peer is */
    const char *name;        /* the peer's segment name, "host:port" */
    const uint8_t *endpoint; /* what the peer's instance returned from get_endpoint */
    size_t endpoint_len;
} ferry_peer_info_t;

/* One transfer. The engine has already checked that [local_addr, +length)
 * lies in a buffer registered locally and that the remote range lies in a
 * buffer the peer advertised; the target must check again. */
typedef struct ferry_transfer_request {
    uint32_t op;           /* FERRY_OP_* */
    uint32_t reserved;
    uint64_t local_addr;
    uint64_t local_mem;    /* handle register_memory returned for the local buffer */
    uint64_t remote_addr;
    uint64_t length;       /* > 0 */
    const uint8_t *remote_key; /* what the peer's register_memory returned for the remote buffer */
    size_t remote_key_len;
    uint64_t token;        /* hand back to complete() */
} ferry_transfer_request_t;

/* One block of a block list (ABI 1.4): its local range is the list's
 * local_addr + local_offset, its remote range the list's remote_addr +
 * remote_offset, both length bytes long. */
typedef struct ferry_block {
    uint64_t local_offset;
    uint64_t remote_offset;
    uint64_t length; /* > 0 */
} ferry_block_t;

/* Many blocks between one local buffer and one peer buffer, as a KV cache
 * moves them: the engine has checked every block against both buffers (the
 * target must check again) and coalesced blocks adjacent on both sides. The
 * list is completed once, through complete(token): FERRY_OK when every block
 * landed, else the first failure (then any block may or may not have
 * landed). blocks stays valid only for the duration of submit_blocks. */
typedef struct ferry_block_list {
    uint32_t op;           /* FERRY_OP_* */
    uint32_t reserved;     /* 0 */
    uint64_t local_addr;   /* base of the local offsets, inside the local buffer */
    uint64_t local_mem;    /* handle register_memory returned for the local buffer */
    uint64_t remote_addr;  /* base of the remote offsets, inside the peer's buffer */
    const uint8_t *remote_key; /* the peer's key for that buffer */
    size_t remote_key_len;
    const ferry_block_t *blocks;
    size_t count;          /* > 0 */
    uint64_t token;        /* hand back to complete(), once for the whole list */
} ferry_block_list_t;

/* Blocks of two block layouts by index (ABI 1.5): block i moves
 * block_size bytes between local_ids[i] of the local layout (at local_base +
 * local_ids[i] * local_stride) and remote_ids[i] of the peer's layout (at
 * remote_base + remote_ids[i] * remote_stride). The engine has checked every
 * index against its layout's block count (local_blocks, remote_blocks) and
 * both layouts against their buffers; the plugin checks again (each
 * layout's extent once against its registration, each index array by its
 * largest index) before anything moves. No blocks are coalesced. Completed
 * once, through complete(token), as a block list is. The arrays stay valid
 * only for the duration of submit_layouts. */
typedef struct ferry_layout_list {
    uint32_t op;           /* FERRY_OP_* */
    uint32_t reserved;     /* 0 */
    uint64_t local_base;   /* the local layout's block 0, inside the local buffer */
    uint64_t local_stride; /* bytes from one local block to the next */
    uint64_t local_blocks; /* the local layout's block count: indices are below it */
    uint64_t local_mem;    /* handle register_memory returned for the local buffer */
    uint64_t remote_base;  /* the peer layout's block 0, inside the peer's buffer */
    uint64_t remote_stride;
    uint64_t remote_blocks;
    const uint8_t *remote_key; /* the peer's key for that buffer */
    size_t remote_key_len;
    uint64_t block_size;   /* > 0, the same on both sides */
    const uint64_t *local_ids;
    const uint64_t *remote_ids;
    size_t count;          /* > 0: entries of each index array */
    uint64_t token;        /* hand back to complete(), once for the whole list */
} ferry_layout_list_t;

typedef struct ferry_transport_plugin_v1 {
    ferry_abi_header_t hdr; /* FERRY_ABI_HEADER_INIT(ferry_transport_plugin_v1_t) */
    const char *name;        /* "tcp": lower case, [a-z0-9-], matches the file name */
    const char *version;     /* the plugin's own version, "1.2.0" */
    const char *description; /* one line */
    ferry_probe_fn probe;    /* required */

    /* --- The data path. A transport without init cannot move data (probe-only
     * plugins are listed by `ferry info` but never selected). Once init is
     * set, fini, get_endpoint, register_memory, unregister_memory, connect,
     * disconnect and submit are required too: a table with init that lacks
     * any of them is disabled when it is loaded, with the missing ones
     * named. The rest are optional. --- */

    /* Creates an instance for one engine. host and params (and the strings in
     * them) stay valid until fini returns. */
    ferry_status_t (*init)(const ferry_host_services_t *host,
                           const ferry_transport_init_params_t *params, void **instance,
                           ferry_errbuf_t *err);
    /* Completes or fails everything in flight (through complete), then frees
     * the instance. */
    void (*fini)(void *instance);
    /* The bytes a peer needs to reach this instance (addresses, ports, QP
     * info...). Writes at most cap bytes and sets *len to the full length; the
     * engine calls again with a larger buffer when *len > cap. */
    ferry_status_t (*get_endpoint)(void *instance, uint8_t *buf, size_t cap, size_t *len,
                                   ferry_errbuf_t *err);
    /* Makes a buffer usable as a local buffer and reachable by peers. Returns
     * a handle and a key for peers (e.g. rkeys). Called once per buffer and
     * instance (every engine has its own instance), with key_cap of 65536
     * bytes; it is not called again for a key that did not fit: a key longer
     * than key_cap fails the registration and Ferry unregisters the handle.
     * The same buffer is registered again only after unregister_memory, or
     * after a failed attempt (FERRY_ERR_UNAVAILABLE for one mem_kind, then
     * the next method down). */
    ferry_status_t (*register_memory)(void *instance, const ferry_mem_region_t *region,
                                      uint64_t *mem_handle, uint8_t *key, size_t key_cap,
                                      size_t *key_len, ferry_errbuf_t *err);
    /* After it returns, peers can no longer read or write the buffer; accesses
     * in progress have finished. */
    ferry_status_t (*unregister_memory)(void *instance, uint64_t mem_handle, ferry_errbuf_t *err);
    /* Prepares to talk to a peer (may connect lazily). */
    ferry_status_t (*connect)(void *instance, const ferry_peer_info_t *peer, void **peer_handle,
                              ferry_errbuf_t *err);
    /* Fails whatever is still in flight to this peer and frees the handle. */
    void (*disconnect)(void *instance, void *peer_handle);
    /* Accepts count requests. On FERRY_OK each one is completed exactly once
     * through complete(); on an error none was accepted. Must not block for
     * long: a transfer that cannot start now is queued. */
    ferry_status_t (*submit)(void *instance, void *peer_handle,
                             const ferry_transfer_request_t *requests, size_t count,
                             ferry_errbuf_t *err);
    /* Optional: one line on how this peer is reached ("eth0 10.0.0.2 -> 10.0.0.3,
     * 4 connections"), for `ferry demo` and logs. Same sizing rule as above. */
    ferry_status_t (*describe_peer)(void *instance, void *peer_handle, char *buf, size_t cap,
                                    size_t *len, ferry_errbuf_t *err);
    /* Optional: completes, on the calling thread and without blocking, what
     * has already arrived; returns how many requests it completed. The engine
     * calls it from threads that wait for a batch, so a waiting thread picks
     * up its own completion instead of waiting for another thread to wake. */
    int32_t (*progress)(void *instance);
    /* Optional: allocates `len` bytes of host memory that this transport can
     * share best (e.g. a file peers map), near NUMA node `numa_node` (-1: any).
     * The engine then registers it as usual. */
    ferry_status_t (*allocate_memory)(void *instance, uint64_t len, int32_t numa_node,
                                      void **addr, ferry_errbuf_t *err);
    /* Optional: frees memory from allocate_memory (after it is unregistered). */
    ferry_status_t (*free_memory)(void *instance, void *addr, ferry_errbuf_t *err);
    /* Optional: whether this peer's buffer with this key (from the peer's
     * register_memory) can be served: FERRY_OK, or FERRY_ERR_UNAVAILABLE with
     * the reason (another user, another namespace, a permission). The engine
     * asks once per peer and key and routes refused requests to the next
     * transport. connect may likewise refuse a whole peer with
     * FERRY_ERR_UNAVAILABLE. */
    ferry_status_t (*accepts)(void *instance, void *peer_handle, const uint8_t *remote_key,
                              size_t key_len, ferry_errbuf_t *err);

    /* --- ABI 1.1 (the host checks struct_size) --- */

    /* Optional: answers a message the same-named transport of the engine
     * `from` sent with the host's peer_request. `from` is the segment name
     * the sender claims (not authenticated); every byte of body is untrusted
     * input (at most FERRY_PEER_MSG_MAX bytes). Writes the reply into
     * reply (reply_cap is FERRY_PEER_MSG_MAX) and sets *reply_len; an error
     * is returned to the sender as its code and message. */
    ferry_status_t (*on_peer_request)(void *instance, const char *from, const uint8_t *body,
                                      size_t body_len, uint8_t *reply, size_t reply_cap,
                                      size_t *reply_len, ferry_errbuf_t *err);

    /* --- ABI 1.2 (the host checks struct_size) --- */

    /* Optional: like accepts, for one pair of buffers: whether requests between
     * the local buffer `local_mem` (a handle from register_memory) and the
     * peer's buffer with this key can be served: FERRY_OK, or
     * FERRY_ERR_UNAVAILABLE with the reason (a copy-engine transport that moves
     * device memory, asked for two host buffers). The engine asks once per
     * pair and, where it is set, instead of accepts. */
    ferry_status_t (*accepts_pair)(void *instance, void *peer_handle, uint64_t local_mem,
                                   const uint8_t *remote_key, size_t key_len,
                                   ferry_errbuf_t *err);

    /* --- ABI 1.3 (the host checks struct_size) --- */

    /* FERRY_TRANSPORT_* facts about how this transport works (0: none). */
    uint64_t flags;

    /* --- ABI 1.4 (the host checks struct_size) --- */

    /* Optional: accepts one block list (see ferry_block_list_t) and completes
     * it once. On an error nothing was accepted, and the requests the list
     * stands for fail with that error. Without it, the engine hands the same
     * blocks to submit as single requests. A transport sets it
     * where moving many blocks costs less together than one by one (one
     * kernel launch for all of them, one iovec list, one frame). */
    ferry_status_t (*submit_blocks)(void *instance, void *peer_handle,
                                    const ferry_block_list_t *list, ferry_errbuf_t *err);

    /* --- ABI 1.5 (the host checks struct_size) --- */

    /* Optional: accepts blocks by layout and index (see ferry_layout_list_t)
     * and completes them once. On an error nothing was accepted. Without it,
     * the engine turns the indices into a block list (submit_blocks) or
     * single requests. A transport sets it where addresses are best computed
     * where the bytes move (a GPU kernel reading the index arrays). */
    ferry_status_t (*submit_layouts)(void *instance, void *peer_handle,
                                     const ferry_layout_list_t *list, ferry_errbuf_t *err);
} ferry_transport_plugin_v1_t;

/* submit moves local memory that was never registered with this transport
 * (local_mem is then 0): the transport reads and writes the local range as
 * plain memory of the process (send/recv, process_vm_writev, memcpy), so the
 * engine may hand it the application's unregistered host memory, as
 * Mooncake's TCP transport takes it. Transports that need a registration
 * (RDMA memory regions) leave it clear; the engine then tells the
 * application to register the memory. The target side is unchanged: a
 * target serves only memory it registered. */
#define FERRY_TRANSPORT_LOCAL_UNREGISTERED (1ull << 0)

#define FERRY_TRANSPORT_PLUGIN_V1_SYMBOL "ferry_transport_plugin_v1"
typedef const ferry_transport_plugin_v1_t *(*ferry_transport_plugin_v1_entry_fn)(void);

/* ------------------------------------------------------------------------ */
/* Device plugins (memory owners: cuda, later rocm, ...)                     */
/* ------------------------------------------------------------------------ */

/* One device as its plugin describes it. */
typedef struct ferry_device_info {
    uint32_t struct_size;  /* set by the caller to sizeof(ferry_device_info_t) */
    int32_t ordinal;       /* as the driver numbers it (after CUDA_VISIBLE_DEVICES) */
    char name[96];         /* "NVIDIA H200" */
    char pci_bus_id[32];   /* "0000:18:00.0" (lower case, 4-digit domain) */
    char uuid[48];         /* "GPU-8c6f..." or "" */
    uint64_t total_memory; /* bytes */
    int32_t gpu_direct_rdma; /* CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: 1, 0, -1 unknown */
    int32_t dmabuf;          /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: 1, 0, -1 unknown */
    int32_t dmabuf_export;   /* the driver can export a DMA-BUF fd: 1, 0 (symbol missing) */
    int32_t reserved;
} ferry_device_info_t;

/* What a pointer is. */
#define FERRY_PTR_HOST 0        /* not this plugin's: ordinary host memory */
#define FERRY_PTR_DEVICE 1      /* device memory of `ordinal` */
#define FERRY_PTR_HOST_PINNED 2 /* host memory the driver allocated or pinned */
#define FERRY_PTR_MANAGED 3     /* managed (unified) memory */

typedef struct ferry_pointer_info {
    uint32_t struct_size; /* set by the caller */
    uint32_t kind;        /* FERRY_PTR_* */
    int32_t ordinal;      /* device of DEVICE / MANAGED memory, else -1 */
    uint32_t reserved;
    uint64_t base;        /* start of the allocation holding the pointer (0: unknown) */
    uint64_t size;        /* its size (0: unknown) */
} ferry_pointer_info_t;

/* One copy of a device copy list (ABI 1.5): len bytes from src to dst. */
typedef struct ferry_device_copy {
    uint64_t src;
    uint64_t dst;
    uint64_t len; /* > 0 */
} ferry_device_copy_t;

typedef struct ferry_device_plugin_v1 {
    ferry_abi_header_t hdr; /* FERRY_ABI_HEADER_INIT(ferry_device_plugin_v1_t) */
    const char *name;        /* "cuda" */
    const char *version;
    const char *description;
    ferry_probe_fn probe; /* required */

    /* --- The device interface. A device plugin without init is listed by
     * `ferry info` but not used. Once init is set, fini, device_count,
     * device_info, query_pointer, alloc_pinned, free_pinned, alloc_device,
     * free_device, stream_create, stream_destroy, copy_async and stream_sync
     * are required too: a table with init that lacks any of them is disabled
     * when it is loaded, with the missing ones named. Functions marked
     * optional may be NULL. --- */

    ferry_status_t (*init)(const ferry_host_services_t *host, void **instance,
                           ferry_errbuf_t *err);
    void (*fini)(void *instance);
    ferry_status_t (*device_count)(void *instance, uint32_t *count, ferry_errbuf_t *err);
    ferry_status_t (*device_info)(void *instance, int32_t ordinal, ferry_device_info_t *out,
                                  ferry_errbuf_t *err);
    /* Classifies any pointer; FERRY_PTR_HOST for memory that is not the
     * driver's. Must be cheap: the engine calls it on every registration. */
    ferry_status_t (*query_pointer)(void *instance, uint64_t addr, ferry_pointer_info_t *out,
                                    ferry_errbuf_t *err);
    /* Optional: a DMA-BUF fd for [addr, addr + len) of device memory, for
     * RDMA registration. The caller owns (and closes) the fd; *offset is
     * addr's offset inside the exported range. */
    ferry_status_t (*export_dmabuf)(void *instance, uint64_t addr, uint64_t len, int32_t *fd,
                                    uint64_t *offset, ferry_errbuf_t *err);
    /* Host memory the device copies to and from fastest (pinned). */
    ferry_status_t (*alloc_pinned)(void *instance, uint64_t len, void **out, ferry_errbuf_t *err);
    void (*free_pinned)(void *instance, void *ptr);
    /* Device memory (for tools and tests; applications bring their own). */
    ferry_status_t (*alloc_device)(void *instance, int32_t ordinal, uint64_t len, uint64_t *out,
                                   ferry_errbuf_t *err);
    void (*free_device)(void *instance, uint64_t ptr);
    /* Streams of copies: a copy is queued on a stream and runs
     * asynchronously; stream_sync waits for everything queued on it.
     * Direction follows from the pointers (unified addressing). */
    ferry_status_t (*stream_create)(void *instance, int32_t ordinal, void **stream,
                                    ferry_errbuf_t *err);
    void (*stream_destroy)(void *instance, void *stream);
    ferry_status_t (*copy_async)(void *instance, void *stream, uint64_t dst, uint64_t src,
                                 uint64_t len, ferry_errbuf_t *err);
    ferry_status_t (*stream_sync)(void *instance, void *stream, ferry_errbuf_t *err);
    /* Optional: pins existing host memory so copies to and from it run at
     * full speed (cuMemHostRegister), and undoes it. */
    ferry_status_t (*pin_host)(void *instance, uint64_t addr, uint64_t len, ferry_errbuf_t *err);
    void (*unpin_host)(void *instance, uint64_t addr);
    /* Optional (ABI 1.5): queues every copy of copies[0, count) on stream, as
     * few device operations as the device allows (one launch of a copy
     * kernel): how the engine gathers many small blocks of device memory
     * into one staging slot and scatters them out of one. Every range is
     * device memory of the stream's device or host memory that alloc_pinned
     * or pin_host of this instance returned or pinned, checked by the engine
     * against its registrations, and stays so until stream_sync. The
     * copies may run in any order and at once (where ranges of one list
     * overlap, what lands there is unspecified). copies is valid only for
     * the call. Without it (or on FERRY_ERR_UNSUPPORTED) the
     * engine queues one copy_async per copy. */
    ferry_status_t (*copy_list_async)(void *instance, void *stream,
                                      const ferry_device_copy_t *copies, size_t count,
                                      ferry_errbuf_t *err);
    /* --- ABI 1.7 (the host reads it only when struct_size covers it) --- */
    /* Optional: whether everything queued on stream has finished, without
     * waiting: *done = 1 when it has (and then reports a failed copy as
     * stream_sync would), 0 while work is still queued. Lets the engine
     * keep other chunks moving while a device copy runs. Without it (or on
     * FERRY_ERR_UNSUPPORTED) the engine waits with stream_sync. */
    ferry_status_t (*stream_query)(void *instance, void *stream, uint32_t *done,
                                   ferry_errbuf_t *err);
} ferry_device_plugin_v1_t;

#define FERRY_DEVICE_PLUGIN_V1_SYMBOL "ferry_device_plugin_v1"
typedef const ferry_device_plugin_v1_t *(*ferry_device_plugin_v1_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FERRY_PLUGIN_H */
