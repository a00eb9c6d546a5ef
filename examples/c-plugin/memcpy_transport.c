/*
 * A Ferry transport plugin written in C, from ferry/plugin.h alone.
 *
 * It moves host memory between two engines of the same process with memcpy:
 * the smallest real transport, and the template for a vendor's own. Build:
 *
 *   cc -shared -fPIC -O2 -I <ferry>/include -o libferry_transport_memcpy.so memcpy_transport.c
 *
 * and put the .so in a directory named by FERRY_PLUGIN_PATH (or in
 * <prefix>/lib/ferry/plugins). `ferry info` then lists it.
 */
#include <ferry/plugin.h>

#define PLUGIN_NAME "memcpy"
#define PLUGIN_VERSION "1.0.0"

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

    if (host->log != NULL) host->log(host->ctx, FERRY_LOG_DEBUG, "memcpy probe done");
    return FERRY_OK;
}

static const ferry_transport_plugin_v1_t memcpy_plugin = {
    FERRY_ABI_HEADER_INIT(ferry_transport_plugin_v1_t),
    PLUGIN_NAME,
    PLUGIN_VERSION,
    "Example C plugin: host memory within one process, by memcpy",
    memcpy_probe,
};

__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    return &memcpy_plugin;
}
