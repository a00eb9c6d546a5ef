/* Calls the C API wrongly in every way a caller can, expecting an error code
 * and a message each time, never a crash. Prints one line per case. */
#include <ferry.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

static void expect(const char *what, ferry_status_t got, ferry_status_t want) {
    const char *msg = ferry_last_error();
    int ok = got == want && (want == FERRY_OK || strlen(msg) > 0);
    printf("%s %s: %s (%s)\n", ok ? "ok  " : "FAIL", what, ferry_status_name(got), msg);
    if (!ok) failures++;
}

int main(void) {
    expect("config_new(NULL)", ferry_config_new(NULL), FERRY_ERR_INVALID_ARGUMENT);
    ferry_config *cfg = NULL;
    expect("config_new", ferry_config_new(&cfg), FERRY_OK);
    expect("config_set unknown", ferry_config_set(cfg, "colour", "blue"), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_set NULL key", ferry_config_set(cfg, NULL, "x"), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_set bad timeout", ferry_config_set(cfg, "timeout_ms", "soon"), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_set bad gpu_direct", ferry_config_set(cfg, "gpu_direct", "yes"), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_set bad staging_depth", ferry_config_set(cfg, "staging_depth", "0"), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_set listen", ferry_config_set(cfg, "listen", "127.0.0.1:0"), FERRY_OK);
    char value[4];
    size_t value_len = 0;
    expect("config_get NULL config", ferry_config_get(NULL, "listen", value, sizeof value, &value_len), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_get NULL key", ferry_config_get(cfg, NULL, value, sizeof value, &value_len), FERRY_ERR_INVALID_ARGUMENT);
    expect("config_get unknown", ferry_config_get(cfg, "colour", value, sizeof value, &value_len), FERRY_ERR_NOT_FOUND);
    expect("config_get small buffer", ferry_config_get(cfg, "listen", value, sizeof value, &value_len), FERRY_ERR_NO_MEMORY);
    expect("config_get NULL buffer", ferry_config_get(cfg, "listen", NULL, 0, NULL), FERRY_ERR_NO_MEMORY);
    ferry_engine *e = NULL;
    expect("engine_new(out NULL)", ferry_engine_new(cfg, NULL), FERRY_ERR_INVALID_ARGUMENT);
    expect("engine_new", ferry_engine_new(cfg, &e), FERRY_OK);
    ferry_config_free(cfg);
    ferry_config_free(NULL);

    char name[8];
    size_t len = 0;
    expect("segment_name small buffer", ferry_engine_segment_name(e, name, sizeof name, &len), FERRY_ERR_NO_MEMORY);
    expect("register NULL engine", ferry_register_memory(NULL, name, 8, NULL), FERRY_ERR_INVALID_ARGUMENT);
    expect("register zero length", ferry_register_memory(e, name, 0, NULL), FERRY_ERR_INVALID_ARGUMENT);
    expect("register bad location", ferry_register_memory(e, name, 8, "gpu:0"), FERRY_ERR_INVALID_ARGUMENT);
    static char buf[4096];
    expect("register", ferry_register_memory(e, buf, sizeof buf, NULL), FERRY_OK);
    expect("register overlapping", ferry_register_memory(e, buf + 8, 8, NULL), FERRY_ERR_INVALID_ARGUMENT);
    expect("unregister unknown", ferry_unregister_memory(e, buf + 1), FERRY_ERR_NOT_FOUND);
    ferry_segment_id seg = 0;
    expect("open unresolvable", ferry_open_segment(e, "no-such-host.invalid:1", &seg), FERRY_ERR_NOT_FOUND);
    expect("open NULL name", ferry_open_segment(e, NULL, &seg), FERRY_ERR_INVALID_ARGUMENT);
    ferry_batch_id b = 0;
    expect("batch zero capacity", ferry_batch_new(e, 0, &b), FERRY_ERR_INVALID_ARGUMENT);
    expect("batch_new", ferry_batch_new(e, 2, &b), FERRY_OK);
    ferry_request r = {7, 0, buf, 99, 0, 8};
    expect("submit bad op", ferry_batch_submit(e, b, &r, 1), FERRY_ERR_INVALID_ARGUMENT);
    r.op = FERRY_OP_WRITE;
    expect("submit unknown segment", ferry_batch_submit(e, b, &r, 1), FERRY_ERR_NOT_FOUND);
    expect("submit NULL requests", ferry_batch_submit(e, b, NULL, 1), FERRY_ERR_INVALID_ARGUMENT);
    expect("submit to unknown batch", ferry_batch_submit(e, b + 100, &r, 1), FERRY_ERR_NOT_FOUND);
    ferry_batch_summary st;
    expect("status NULL out", ferry_batch_status(e, b, NULL), FERRY_ERR_INVALID_ARGUMENT);
    uint32_t state;
    ferry_status_t err;
    expect("request status out of range", ferry_batch_request_status(e, b, 5, &state, &err), FERRY_ERR_INVALID_ARGUMENT);
    expect("wait empty batch", ferry_batch_wait(e, b, 10, &st), FERRY_OK);
    expect("free batch", ferry_batch_free(e, b), FERRY_OK);
    expect("free batch twice", ferry_batch_free(e, b), FERRY_ERR_NOT_FOUND);
    expect("unregister", ferry_unregister_memory(e, buf), FERRY_OK);
    void *mem = NULL;
    expect("allocate zero", ferry_allocate_memory(e, 0, -1, &mem), FERRY_ERR_INVALID_ARGUMENT);
    expect("allocate", ferry_allocate_memory(e, 1 << 20, -1, &mem), FERRY_OK);
    expect("free unknown", ferry_free_memory(e, buf), FERRY_ERR_NOT_FOUND);
    expect("free", ferry_free_memory(e, mem), FERRY_OK);
    ferry_engine_free(e);
    ferry_engine_free(NULL);
    printf("name of -999: %s\n", ferry_status_name(-999));
    printf("%d failures\n", failures);
    return failures == 0 ? 0 : 1;
}
