/*
 * Transport plugins that are wrong in one way each, for the loader's tests.
 * Each variant is selected with -D at build time:
 *
 *   -DNO_ENTRY            exports no ferry_transport_plugin_v1 symbol
 *   -DENTRY_V2_ONLY       exports only ferry_transport_plugin_v2 (a newer major)
 *   -DTABLE_ABI_MAJOR=N   exports v1 but its table claims ABI major N
 *   -DNEEDS_TESTDEP       calls into libferrytestdep.so (which the test deletes)
 *   -DPROBE_FAILS         probe returns FERRY_ERR_IO with a message
 *   -DPROBE_UNAVAILABLE   probe says the plugin cannot run here
 *   -DPROBE_HANGS         probe never returns
 *   -DPLUGIN_NAME=\"x\"   the name the table reports
 */
#define _POSIX_C_SOURCE 200809L
#include <ferry/plugin.h>
#include <unistd.h>

#ifndef PLUGIN_NAME
#define PLUGIN_NAME "misbehaving"
#endif
#ifndef TABLE_ABI_MAJOR
#define TABLE_ABI_MAJOR FERRY_PLUGIN_ABI_MAJOR
#endif

#ifdef NEEDS_TESTDEP
extern int ferry_testdep_answer(void);
#endif

static ferry_status_t probe(const ferry_host_services_t *host, const ferry_probe_sink_t *sink,
                            ferry_errbuf_t *err) {
    (void)host;
#if defined(PROBE_FAILS)
    (void)sink;
    return ferry_errorf(err, FERRY_ERR_IO, "cannot open /dev/vendor%d: %s", 0,
                        "Permission denied");
#elif defined(PROBE_UNAVAILABLE)
    (void)sink;
    return ferry_error(err, FERRY_ERR_UNAVAILABLE, "no vendor NIC on this host");
#elif defined(PROBE_HANGS)
    (void)sink;
    (void)err;
    for (;;) pause();
    return FERRY_OK;
#else
#ifdef NEEDS_TESTDEP
    if (ferry_testdep_answer() != 42) return ferry_error(err, FERRY_ERR_INTERNAL, "bad dep");
#endif
    (void)err;
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, FERRY_SCOPE_SAME_HOST);
    return FERRY_OK;
#endif
}

static const ferry_transport_plugin_v1_t table = {
    .hdr = {(uint32_t)sizeof(ferry_transport_plugin_v1_t), TABLE_ABI_MAJOR, 0},
    .name = PLUGIN_NAME,
    .version = "0.0.1",
    .description = "a plugin for the loader's tests",
    .probe = probe,
};

#if defined(NO_ENTRY)
__attribute__((visibility("default"))) const void *ferry_unrelated_function(void) {
    return &table;
}
#elif defined(ENTRY_V2_ONLY)
__attribute__((visibility("default"))) const void *ferry_transport_plugin_v2(void) {
    return &table;
}
#else
__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    return &table;
}
#endif
