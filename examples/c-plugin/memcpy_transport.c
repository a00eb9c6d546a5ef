/*
 * A Ferry transport plugin written in C, from ferry/plugin.h alone.
 *
 * It moves host memory between engines of the same process with memcpy: the
 * smallest real transport, and the template for a vendor's own. Build with
 * `make` (the Makefile beside it), or by hand:
 *
 *   cc -shared -fPIC -O2 -I <ferry>/include -o libferry_transport_memcpy.so \
 *      memcpy_transport.c -lpthread
 *
 * and put the .so in <prefix>/lib/ferry/plugins (`make install`) or in a
 * directory named by FERRY_PLUGIN_PATH. `ferry info` then lists it, and two
 * engines in one process use it for each other.
 *
 * Every engine that loads the plugin gets an instance; the instances of one
 * process share this file's globals (the dynamic loader maps the library
 * once), which is how a write from one engine finds the other's memory. A
 * request is served only when its remote range lies inside one region the
 * target instance registered.
 */
#define _POSIX_C_SOURCE 200809L
#include <ferry/plugin.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#define PLUGIN_NAME "memcpy"
#define PLUGIN_VERSION "1.0.0"
#define MAX_REGIONS 4096

typedef struct instance {
    uint64_t id;
    const ferry_host_services_t *host;
    void *completion_ctx;
    ferry_complete_fn complete;
} instance_t;

typedef struct region {
    uint64_t owner; /* instance id; 0 = free slot */
    uint64_t handle;
    uint64_t addr, len;
} region_t;

/* One table for the whole process. Copies run under the lock, so a region
 * cannot be unregistered while a copy touches it. */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static region_t regions[MAX_REGIONS];
static uint64_t next_id = 1;

static ferry_status_t memcpy_probe(const ferry_host_services_t *host,
                                   const ferry_probe_sink_t *sink, ferry_errbuf_t *err) {
    if (host == NULL || sink == NULL) {
        return ferry_error(err, FERRY_ERR_INVALID_ARGUMENT, "probe needs a host and a sink");
    }
    /* A setting the operator may give as FERRY_MEMCPY_DISABLE=1. */
    char value[16] = {0};
    if (FERRY_HAS_FIELD(host, ferry_host_services_t, config_get) && host->config_get != NULL &&
        host->config_get(host->ctx, "memcpy.disable", value, sizeof value) >= 0 &&
        value[0] == '1') {
        return ferry_error(err, FERRY_ERR_UNAVAILABLE, "disabled by FERRY_MEMCPY_DISABLE=1");
    }
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, FERRY_SCOPE_SAME_PROCESS);
    ferry_probe_device_t cpu = {0};
    cpu.struct_size = (uint32_t)sizeof cpu;
    cpu.numa_node = -1;
    cpu.name = "cpu";
    cpu.detail = "memcpy between buffers of one process";
    cpu.mem_kinds = FERRY_MEM_HOST;
    sink->add_device(sink->ctx, &cpu);
    sink->add_missing(sink->ctx, "same-host", "copies only within one process");
    sink->add_note(sink->ctx, "written-in", "C, against ferry/plugin.h only");
    return FERRY_OK;
}

static ferry_status_t memcpy_init(const ferry_host_services_t *host,
                                  const ferry_transport_init_params_t *params, void **out,
                                  ferry_errbuf_t *err) {
    if (params == NULL || params->complete == NULL || out == NULL) {
        return ferry_error(err, FERRY_ERR_INVALID_ARGUMENT, "init needs params and a completion");
    }
    instance_t *inst = calloc(1, sizeof *inst);
    if (inst == NULL) return ferry_error(err, FERRY_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_lock(&lock);
    inst->id = next_id++;
    pthread_mutex_unlock(&lock);
    inst->host = host;
    inst->completion_ctx = params->completion_ctx;
    inst->complete = params->complete;
    *out = inst;
    return FERRY_OK;
}

static void memcpy_fini(void *instance) {
    instance_t *inst = instance;
    if (inst == NULL) return;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].owner == inst->id) regions[i].owner = 0;
    }
    pthread_mutex_unlock(&lock);
    free(inst);
}

/* The endpoint names the process and the instance: "pid:instance". */
static ferry_status_t memcpy_get_endpoint(void *instance, uint8_t *buf, size_t cap, size_t *len,
                                          ferry_errbuf_t *err) {
    instance_t *inst = instance;
    char text[64];
    int n = snprintf(text, sizeof text, "%ld:%llu", (long)getpid(), (unsigned long long)inst->id);
    if (n < 0) return ferry_error(err, FERRY_ERR_INTERNAL, "snprintf failed");
    *len = (size_t)n;
    if (buf != NULL && cap >= (size_t)n) memcpy(buf, text, (size_t)n);
    return FERRY_OK;
}

static ferry_status_t memcpy_register(void *instance, const ferry_mem_region_t *region,
                                      uint64_t *handle, uint8_t *key, size_t key_cap,
                                      size_t *key_len, ferry_errbuf_t *err) {
    instance_t *inst = instance;
    (void)key;
    (void)key_cap;
    if (region->mem_kind != FERRY_MEM_HOST) {
        return ferry_error(err, FERRY_ERR_UNSUPPORTED, "memcpy moves host memory only");
    }
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].owner == 0) {
            regions[i] = (region_t){inst->id, next_id++, region->addr, region->len};
            *handle = regions[i].handle;
            pthread_mutex_unlock(&lock);
            *key_len = 0;
            return FERRY_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return ferry_errorf(err, FERRY_ERR_NO_MEMORY, "more than %d regions", MAX_REGIONS);
}

static ferry_status_t memcpy_unregister(void *instance, uint64_t handle, ferry_errbuf_t *err) {
    instance_t *inst = instance;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].owner == inst->id && regions[i].handle == handle) {
            regions[i].owner = 0;
            pthread_mutex_unlock(&lock);
            return FERRY_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return ferry_errorf(err, FERRY_ERR_NOT_FOUND, "no region with handle %llu",
                        (unsigned long long)handle);
}

typedef struct peer {
    uint64_t target; /* instance id of the peer */
} peer_t;

static ferry_status_t memcpy_connect(void *instance, const ferry_peer_info_t *info, void **out,
                                     ferry_errbuf_t *err) {
    (void)instance;
    char text[64] = {0};
    if (info->endpoint_len == 0 || info->endpoint_len >= sizeof text) {
        return ferry_error(err, FERRY_ERR_PROTOCOL, "malformed memcpy endpoint");
    }
    memcpy(text, info->endpoint, info->endpoint_len);
    long pid = 0;
    unsigned long long id = 0;
    if (sscanf(text, "%ld:%llu", &pid, &id) != 2 || pid != (long)getpid()) {
        return ferry_errorf(err, FERRY_ERR_UNSUPPORTED, "%s is not in this process",
                            info->name != NULL ? info->name : "the peer");
    }
    peer_t *p = calloc(1, sizeof *p);
    if (p == NULL) return ferry_error(err, FERRY_ERR_NO_MEMORY, "out of memory");
    p->target = id;
    *out = p;
    return FERRY_OK;
}

static void memcpy_disconnect(void *instance, void *peer) {
    (void)instance;
    free(peer);
}

/* Copies one request under the lock; returns its status. */
static ferry_status_t copy_one(uint64_t target, const ferry_transfer_request_t *r) {
    ferry_status_t status = FERRY_ERR_OUT_OF_BOUNDS;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        const region_t *g = &regions[i];
        if (g->owner == target && r->remote_addr >= g->addr && r->length <= g->len &&
            r->remote_addr - g->addr <= g->len - r->length) {
            void *remote = (void *)(uintptr_t)r->remote_addr;
            void *local = (void *)(uintptr_t)r->local_addr;
            if (r->op == FERRY_OP_WRITE) {
                memmove(remote, local, r->length);
            } else {
                memmove(local, remote, r->length);
            }
            status = FERRY_OK;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return status;
}

static ferry_status_t memcpy_submit(void *instance, void *peer,
                                    const ferry_transfer_request_t *requests, size_t count,
                                    ferry_errbuf_t *err) {
    instance_t *inst = instance;
    const peer_t *p = peer;
    (void)err;
    for (size_t i = 0; i < count; i++) {
        ferry_status_t s = copy_one(p->target, &requests[i]);
        inst->complete(inst->completion_ctx, requests[i].token, s,
                       s == FERRY_OK ? NULL : "memcpy: the range is not inside memory the peer registered");
    }
    return FERRY_OK;
}

/* ABI 1.4, optional: a whole block list in one call, completed once. The
 * peer's region is found once for the furthest block; every block then lies
 * inside it. */
static ferry_status_t memcpy_submit_blocks(void *instance, void *peer,
                                           const ferry_block_list_t *list, ferry_errbuf_t *err) {
    instance_t *inst = instance;
    const peer_t *p = peer;
    uint64_t remote_end = 0;
    for (size_t i = 0; i < list->count; i++) {
        const ferry_block_t *b = &list->blocks[i];
        if (b->length == 0 || b->remote_offset > UINT64_MAX - b->length) {
            return ferry_errorf(err, FERRY_ERR_INVALID_ARGUMENT, "block %zu is no range", i);
        }
        if (b->remote_offset + b->length > remote_end) remote_end = b->remote_offset + b->length;
    }
    ferry_status_t status = FERRY_ERR_OUT_OF_BOUNDS;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        const region_t *g = &regions[i];
        if (g->owner == p->target && list->remote_addr >= g->addr && remote_end <= g->len &&
            list->remote_addr - g->addr <= g->len - remote_end) {
            for (size_t k = 0; k < list->count; k++) {
                const ferry_block_t *b = &list->blocks[k];
                char *remote = (char *)(uintptr_t)list->remote_addr + b->remote_offset;
                char *local = (char *)(uintptr_t)list->local_addr + b->local_offset;
                if (list->op == FERRY_OP_WRITE) {
                    memmove(remote, local, b->length);
                } else {
                    memmove(local, remote, b->length);
                }
            }
            status = FERRY_OK;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    inst->complete(inst->completion_ctx, list->token, status,
                   status == FERRY_OK ? NULL : "memcpy: a block is not inside memory the peer registered");
    return FERRY_OK;
}

static ferry_status_t memcpy_describe(void *instance, void *peer, char *buf, size_t cap,
                                      size_t *len, ferry_errbuf_t *err) {
    (void)instance;
    (void)err;
    const peer_t *p = peer;
    char text[96];
    int n = snprintf(text, sizeof text, "memcpy within process %ld to instance %llu",
                     (long)getpid(), (unsigned long long)p->target);
    *len = (size_t)n;
    if (buf != NULL && cap > (size_t)n) memcpy(buf, text, (size_t)n + 1);
    return FERRY_OK;
}

/* Designated initializers: a field left out is NULL, and no field can
 * shift into another's place. Leave out what you do not implement. */
static const ferry_transport_plugin_v1_t memcpy_plugin = {
    .hdr = FERRY_ABI_HEADER_INIT(ferry_transport_plugin_v1_t),
    .name = PLUGIN_NAME,
    .version = PLUGIN_VERSION,
    .description = "Example C plugin: host memory within one process, by memcpy",
    .probe = memcpy_probe,
    /* With init, the rest of the data path is required (plugin.h). */
    .init = memcpy_init,
    .fini = memcpy_fini,
    .get_endpoint = memcpy_get_endpoint,
    .register_memory = memcpy_register,
    .unregister_memory = memcpy_unregister,
    .connect = memcpy_connect,
    .disconnect = memcpy_disconnect,
    .submit = memcpy_submit,
    /* Optional. Not here: progress (every request completes inside submit),
     * allocate_memory and free_memory (plain host memory is all it needs),
     * accepts (connect already refuses peers outside this process),
     * on_peer_request (ABI 1.1; no handshake with peers). */
    .describe_peer = memcpy_describe,
    .submit_blocks = memcpy_submit_blocks,
};

__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    return &memcpy_plugin;
}
