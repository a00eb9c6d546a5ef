/*
 * A test transport that declares its link (ABI 1.2: bandwidth_mbps and
 * latency_ns of its one device) and moves host memory between engines of
 * one process by memcpy, like examples/c-plugin. Compiled several times by
 * tests/selection.rs with different declarations:
 *
 *   -DDECL_NAME='"fast"'        the plugin's name (matches the file name)
 *   -DDECL_SCOPES=...           FERRY_SCOPE_* bits it claims
 *   -DDECL_MBPS=400000          declared bandwidth, Mbit/s (0: declares none)
 *   -DDECL_LATENCY_NS=2000      declared latency, ns
 *   -DDECL_DELAY_US=100000      each submit waits this long before it
 *                               completes: it delivers less than it declares
 *   -DDECL_ANY_PEER=1           connect accepts a peer in another process
 *                               (for route checks only: it cannot move data
 *                               there, and says so in submit)
 */
#define _POSIX_C_SOURCE 200809L
#include <ferry/plugin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef DECL_NAME
#define DECL_NAME "declared"
#endif
#ifndef DECL_SCOPES
#define DECL_SCOPES FERRY_SCOPE_SAME_PROCESS
#endif
#ifndef DECL_MBPS
#define DECL_MBPS 0
#endif
#ifndef DECL_LATENCY_NS
#define DECL_LATENCY_NS 0
#endif
#ifndef DECL_DELAY_US
#define DECL_DELAY_US 0
#endif
#ifndef DECL_ANY_PEER
#define DECL_ANY_PEER 0
#endif
#define MAX_REGIONS 1024

typedef struct instance {
    uint64_t id;
    void *completion_ctx;
    ferry_complete_fn complete;
} instance_t;

typedef struct region {
    uint64_t owner, handle, addr, len;
} region_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static region_t regions[MAX_REGIONS];
static uint64_t next_id = 1;

static ferry_status_t decl_probe(const ferry_host_services_t *host,
                                 const ferry_probe_sink_t *sink, ferry_errbuf_t *err) {
    (void)host;
    if (sink == NULL) return ferry_error(err, FERRY_ERR_INVALID_ARGUMENT, "no sink");
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, DECL_SCOPES);
    ferry_probe_device_t link = {
        .struct_size = (uint32_t)sizeof(ferry_probe_device_t),
        .numa_node = -1,
        .name = DECL_NAME "0",
        .detail = "a declared test link",
        .mem_kinds = FERRY_MEM_HOST,
        .bandwidth_mbps = DECL_MBPS,
        .latency_ns = DECL_LATENCY_NS,
    };
    sink->add_device(sink->ctx, &link);
    return FERRY_OK;
}

static ferry_status_t decl_init(const ferry_host_services_t *host,
                                const ferry_transport_init_params_t *params, void **out,
                                ferry_errbuf_t *err) {
    (void)host;
    if (params == NULL || params->complete == NULL || out == NULL) {
        return ferry_error(err, FERRY_ERR_INVALID_ARGUMENT, "init needs params");
    }
    instance_t *inst = calloc(1, sizeof *inst);
    if (inst == NULL) return ferry_error(err, FERRY_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_lock(&lock);
    inst->id = next_id++;
    pthread_mutex_unlock(&lock);
    inst->completion_ctx = params->completion_ctx;
    inst->complete = params->complete;
    *out = inst;
    return FERRY_OK;
}

static void decl_fini(void *instance) {
    instance_t *inst = instance;
    if (inst == NULL) return;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].owner == inst->id) regions[i].owner = 0;
    }
    pthread_mutex_unlock(&lock);
    free(inst);
}

static ferry_status_t decl_endpoint(void *instance, uint8_t *buf, size_t cap, size_t *len,
                                    ferry_errbuf_t *err) {
    instance_t *inst = instance;
    char text[64];
    int n = snprintf(text, sizeof text, "%ld:%llu", (long)getpid(),
                     (unsigned long long)inst->id);
    if (n < 0) return ferry_error(err, FERRY_ERR_INTERNAL, "snprintf failed");
    *len = (size_t)n;
    if (buf != NULL && cap >= (size_t)n) memcpy(buf, text, (size_t)n);
    return FERRY_OK;
}

static ferry_status_t decl_register(void *instance, const ferry_mem_region_t *region,
                                    uint64_t *handle, uint8_t *key, size_t key_cap,
                                    size_t *key_len, ferry_errbuf_t *err) {
    instance_t *inst = instance;
    if (region->mem_kind != FERRY_MEM_HOST) {
        return ferry_error(err, FERRY_ERR_UNSUPPORTED, "host memory only");
    }
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < MAX_REGIONS; i++) {
        if (regions[i].owner == 0) {
            regions[i] = (region_t){inst->id, next_id++, region->addr, region->len};
            *handle = regions[i].handle;
            pthread_mutex_unlock(&lock);
            /* A one-byte key, so the descriptor carries one for this plugin. */
            *key_len = 1;
            if (key_cap >= 1) key[0] = 'k';
            return FERRY_OK;
        }
    }
    pthread_mutex_unlock(&lock);
    return ferry_error(err, FERRY_ERR_NO_MEMORY, "too many regions");
}

static ferry_status_t decl_unregister(void *instance, uint64_t handle, ferry_errbuf_t *err) {
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
    return ferry_error(err, FERRY_ERR_NOT_FOUND, "no such region");
}

typedef struct peer {
    uint64_t target;
    int here; /* the peer is in this process */
} peer_t;

static ferry_status_t decl_connect(void *instance, const ferry_peer_info_t *info, void **out,
                                   ferry_errbuf_t *err) {
    (void)instance;
    char text[64] = {0};
    if (info->endpoint_len == 0 || info->endpoint_len >= sizeof text) {
        return ferry_error(err, FERRY_ERR_PROTOCOL, "malformed endpoint");
    }
    memcpy(text, info->endpoint, info->endpoint_len);
    long pid = 0;
    unsigned long long id = 0;
    if (sscanf(text, "%ld:%llu", &pid, &id) != 2) {
        return ferry_error(err, FERRY_ERR_PROTOCOL, "malformed endpoint");
    }
    int here = pid == (long)getpid();
    if (!here && !DECL_ANY_PEER) {
        return ferry_error(err, FERRY_ERR_UNSUPPORTED, "the peer is not in this process");
    }
    peer_t *p = calloc(1, sizeof *p);
    if (p == NULL) return ferry_error(err, FERRY_ERR_NO_MEMORY, "out of memory");
    p->target = id;
    p->here = here;
    *out = p;
    return FERRY_OK;
}

static void decl_disconnect(void *instance, void *peer) {
    (void)instance;
    free(peer);
}

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

static ferry_status_t decl_submit(void *instance, void *peer,
                                  const ferry_transfer_request_t *requests, size_t count,
                                  ferry_errbuf_t *err) {
    instance_t *inst = instance;
    const peer_t *p = peer;
    if (!p->here) {
        return ferry_error(err, FERRY_ERR_UNSUPPORTED, "moves data within one process only");
    }
    if (DECL_DELAY_US > 0) {
        struct timespec ts = {DECL_DELAY_US / 1000000, (DECL_DELAY_US % 1000000) * 1000L};
        nanosleep(&ts, NULL);
    }
    for (size_t i = 0; i < count; i++) {
        ferry_status_t s = copy_one(p->target, &requests[i]);
        inst->complete(inst->completion_ctx, requests[i].token, s,
                       s == FERRY_OK ? NULL : DECL_NAME ": outside the peer's regions");
    }
    return FERRY_OK;
}

static const ferry_transport_plugin_v1_t plugin = {
    .hdr = FERRY_ABI_HEADER_INIT(ferry_transport_plugin_v1_t),
    .name = DECL_NAME,
    .version = "1.2.0",
    .description = "Test transport with a declared link",
    .probe = decl_probe,
    .init = decl_init,
    .fini = decl_fini,
    .get_endpoint = decl_endpoint,
    .register_memory = decl_register,
    .unregister_memory = decl_unregister,
    .connect = decl_connect,
    .disconnect = decl_disconnect,
    .submit = decl_submit,
};

__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    return &plugin;
}
