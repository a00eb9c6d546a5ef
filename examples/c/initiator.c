/*
 * A Ferry initiator in C: writes a pattern into a target's buffer in one
 * batch of requests, reads it back synchronously, and verifies it.
 *
 *   ./initiator <segment> <remote address> <size>
 *
 * Prints the local checksum ("LOCAL <hex>") so a caller can compare it with
 * the target's, then "OK" when the read-back matches. Also shows the error a
 * request outside the target's memory gets.
 */
#include "common.h"
#include <string.h>

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s <segment> <remote address> <size>\n", argv[0]);
        return 2;
    }
    const char *segment_name = argv[1];
    uint64_t remote = strtoull(argv[2], NULL, 0);
    size_t size = strtoull(argv[3], NULL, 0);
    const size_t block = 1u << 20;
    if (size == 0 || size % block != 0) {
        fprintf(stderr, "size must be a multiple of 1 MiB\n");
        return 2;
    }

    ferry_engine *engine = NULL;
    CHECK(ferry_engine_new(NULL, &engine)); /* defaults and FERRY_* environment */

    unsigned char *src = malloc(size), *dst = calloc(1, size);
    if (src == NULL || dst == NULL) return 1;
    for (size_t i = 0; i < size; i++) src[i] = (unsigned char)(i * 7 + i / 4096);
    CHECK(ferry_register_memory(engine, src, size, NULL));
    CHECK(ferry_register_memory(engine, dst, size, "cpu:0"));

    ferry_segment_id seg = 0;
    CHECK(ferry_open_segment(engine, segment_name, &seg));

    /* Write: one batch of 1 MiB requests, submitted and waited for. */
    size_t n = size / block;
    ferry_request *reqs = calloc(n, sizeof *reqs);
    for (size_t i = 0; i < n; i++) {
        reqs[i] = (ferry_request){FERRY_OP_WRITE, 0, src + i * block, seg, remote + i * block,
                                  block};
    }
    /* The batch carries a notification: the target receives it once all of
     * the batch's data is in its memory, and the wait returns once the
     * target has it. */
    ferry_batch_id batch = 0;
    CHECK(ferry_batch_new(engine, n, &batch));
    const char note[] = "written";
    CHECK(ferry_batch_submit_with_notify(engine, batch, reqs, n, "initiator",
                                         (const uint8_t *)note, strlen(note)));
    ferry_batch_summary st;
    CHECK(ferry_batch_wait(engine, batch, -1, &st));
    if (st.notify != FERRY_NOTIFY_DELIVERED) return 1;
    printf("WROTE %llu requests\n", (unsigned long long)st.completed);
    CHECK(ferry_batch_free(engine, batch));
    printf("LOCAL %016llx\n", (unsigned long long)checksum(src, size));

    /* Which transport carried the blocks, and why: the cost model's
     * estimate and what the engine measured, as JSON. */
    char route[8192];
    CHECK(ferry_route_json(engine, seg, src, remote, block, route, sizeof route, NULL));
    printf("ROUTE %s\n", route);

    /* Read back with the synchronous call. */
    for (size_t i = 0; i < n; i++) {
        reqs[i].op = FERRY_OP_READ;
        reqs[i].local_addr = dst + i * block;
    }
    CHECK(ferry_transfer_sync(engine, reqs, n));
    if (memcmp(src, dst, size) != 0) {
        fprintf(stderr, "read-back differs from what was written\n");
        return 1;
    }

    /* A request past the end of the target's buffer is refused. */
    ferry_request bad = {FERRY_OP_WRITE, 0, src, seg, remote + size - 16, 64};
    ferry_status_t rc = ferry_transfer_sync(engine, &bad, 1);
    printf("OUT_OF_BOUNDS %s: %s\n", ferry_status_name(rc), ferry_last_error());
    if (rc != FERRY_ERR_OUT_OF_BOUNDS) return 1;

    /* What moved, as the engine counted it (JSON; ask for the length
       first). The counters are live, so the text may grow between the two
       calls: on FERRY_ERR_NO_MEMORY, `mlen` holds the new length; try again. */
    size_t mlen = 0;
    char *metrics = NULL;
    ferry_status_t mrc = ferry_metrics_json(engine, NULL, 0, &mlen);
    for (int tries = 0; tries < 8; tries++) {
        char *grown = realloc(metrics, mlen + 1);
        if (grown == NULL) {
            free(metrics);
            return 1;
        }
        metrics = grown;
        mrc = ferry_metrics_json(engine, metrics, mlen + 1, &mlen);
        if (mrc != FERRY_ERR_NO_MEMORY) break;
    }
    CHECK(mrc);
    if (strstr(metrics, "\"op\":\"write\"") == NULL) {
        fprintf(stderr, "metrics do not show the writes: %s\n", metrics);
        return 1;
    }
    printf("METRICS %zu bytes of JSON\n", mlen);
    free(metrics);

    CHECK(ferry_unregister_memory(engine, src));
    CHECK(ferry_unregister_memory(engine, dst));
    ferry_engine_free(engine);
    free(reqs);
    free(src);
    free(dst);
    printf("OK\n");
    return 0;
}
