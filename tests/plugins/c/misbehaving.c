/*
 * Transport plugins that are wrong in one way each, for the loader's tests.
 * Each variant is selected with -D at build time:
 *
 *   -DNO_ENTRY            exports no ferry_transport_plugin_v1 symbol
 *   -DENTRY_V2_ONLY       exports only ferry_transport_plugin_v2 (a newer major)
 *   -DTABLE_ABI_MAJOR=N   exports v1 but its table claims ABI major N
 *   -DNULL_TABLE          its entry function returns NULL
 *   -DNULL_PROBE          its table has no probe
 *   -DMISSING_SYMBOL      needs a symbol no library provides (dlopen fails)
 *   -DINCOMPLETE          has init but not the rest of the data path
 *   -DNEEDS_TESTDEP       calls into libferrytestdep.so (which the test deletes)
 *   -DPROBE_FAILS         probe returns FERRY_ERR_IO with a message
 *   -DPROBE_UNAVAILABLE   probe says the plugin cannot run here
 *   -DPROBE_HANGS         probe never returns
 *   -DPROBE_SLOW_MS=N     probe returns FERRY_OK after N ms (past a short timeout)
 *   -DPROBE_ABORT         probe calls abort()
 *   -DPROBE_SEGV          probe writes through a null pointer
 *   -DCTOR_ABORT          a constructor calls abort() when the library loads
 *   -DCTOR_SEGV           a constructor writes through a null pointer
 *   -DESCAPES             version, description, findings and reason carry
 *                         terminal escape codes and a forged report line
 *   -DPROBE_EXCLUSIVE     probe holds an flock on the file named by the setting
 *                         exclusive.lock for 300 ms, and fails if another
 *                         probe holds it
 *   -DPLUGIN_NAME=\"x\"   the name the table reports
 */
#define _DEFAULT_SOURCE
#include <ferry/plugin.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/file.h>
#include <time.h>
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
#ifdef MISSING_SYMBOL
extern int ferry_vendor_symbol_nobody_defines(void);
#endif

/* A null pointer the compiler cannot see through. */
__attribute__((unused)) static int *volatile nowhere = NULL;

#if defined(CTOR_ABORT)
__attribute__((constructor)) static void explode_on_load(void) { abort(); }
#elif defined(CTOR_SEGV)
__attribute__((constructor)) static void explode_on_load(void) { *nowhere = 1; }
#endif

__attribute__((unused)) static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
}

__attribute__((unused)) static ferry_status_t probe(const ferry_host_services_t *host,
                                                   const ferry_probe_sink_t *sink,
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
#elif defined(PROBE_ABORT)
    (void)sink;
    (void)err;
    abort();
#elif defined(PROBE_SEGV)
    (void)sink;
    (void)err;
    *nowhere = 42;
    return FERRY_OK;
#elif defined(ESCAPES)
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, FERRY_SCOPE_SAME_HOST);
    ferry_probe_device_t dev = {0};
    dev.struct_size = (uint32_t)sizeof dev;
    dev.numa_node = -1;
    dev.name = "nic\x1b[31m0";
    dev.detail = "port up\r\n      why: forged device line";
    dev.mem_kinds = FERRY_MEM_HOST;
    sink->add_device(sink->ctx, &dev);
    sink->add_note(sink->ctx, "title\x1b]0;pwned\x07", "\x1b[2Jcleared");
    sink->add_missing(sink->ctx, "bidi", "abc\xe2\x80\xae" "fed");
    return ferry_error(err, FERRY_ERR_UNAVAILABLE,
                       "\x1b[2J\x1b[Hall clear\n      why: enabled, trust me");
#elif defined(PROBE_EXCLUSIVE)
    char path[4096];
    int64_t n = host->config_get(host->ctx, "exclusive.lock", path, sizeof path);
    if (n <= 0 || (size_t)n >= sizeof path)
        return ferry_error(err, FERRY_ERR_INVALID_ARGUMENT, "no exclusive.lock setting");
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return ferry_error(err, FERRY_ERR_IO, "cannot open the lock file");
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd);
        return ferry_error(err, FERRY_ERR_BUSY, "two probes of this plugin ran at once");
    }
    sleep_ms(300);
    flock(fd, LOCK_UN);
    close(fd);
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, FERRY_SCOPE_SAME_HOST);
    return FERRY_OK;
#else
#ifdef PROBE_SLOW_MS
    sleep_ms(PROBE_SLOW_MS);
#endif
#ifdef NEEDS_TESTDEP
    if (ferry_testdep_answer() != 42) return ferry_error(err, FERRY_ERR_INTERNAL, "bad dep");
#endif
#ifdef MISSING_SYMBOL
    if (ferry_vendor_symbol_nobody_defines() != 42)
        return ferry_error(err, FERRY_ERR_INTERNAL, "bad symbol");
#endif
    (void)err;
    sink->set_capabilities(sink->ctx, FERRY_MEM_HOST, FERRY_SCOPE_SAME_HOST);
    return FERRY_OK;
#endif
}

#ifdef INCOMPLETE
static ferry_status_t init(const ferry_host_services_t *host,
                           const ferry_transport_init_params_t *params, void **instance,
                           ferry_errbuf_t *err) {
    (void)host;
    (void)params;
    (void)instance;
    return ferry_error(err, FERRY_ERR_INTERNAL, "must never be called");
}
static void fini(void *instance) { (void)instance; }
#endif

#ifdef ESCAPES
#define PLUGIN_VERSION "1.0\x1b[2J"
#define PLUGIN_DESCRIPTION "evil\n      why: forged line\x1b]0;pwned\x07"
#else
#define PLUGIN_VERSION "0.0.1"
#define PLUGIN_DESCRIPTION "a plugin for the loader's tests"
#endif

static const ferry_transport_plugin_v1_t table = {
    .hdr = {(uint32_t)sizeof(ferry_transport_plugin_v1_t), TABLE_ABI_MAJOR, 0},
    .name = PLUGIN_NAME,
    .version = PLUGIN_VERSION,
    .description = PLUGIN_DESCRIPTION,
#ifndef NULL_PROBE
    .probe = probe,
#endif
#ifdef INCOMPLETE
    .init = init,
    .fini = fini,
#endif
};

#if defined(NO_ENTRY)
__attribute__((visibility("default"))) const void *ferry_unrelated_function(void) {
    return &table;
}
#elif defined(ENTRY_V2_ONLY)
__attribute__((visibility("default"))) const void *ferry_transport_plugin_v2(void) {
    return &table;
}
#elif defined(NULL_TABLE)
__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    (void)table;
    return NULL;
}
#else
__attribute__((visibility("default"))) const ferry_transport_plugin_v1_t *
ferry_transport_plugin_v1(void) {
    return &table;
}
#endif
