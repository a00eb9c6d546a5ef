/* An application that embeds libferry, as a serving stack's C code would:
 * it prints what Ferry's loader found (one line, "INFO <json>"), then starts
 * two engines in this process and moves 4 MiB from one to the other and
 * back, printing "TRANSFER OK" when every byte arrived. Whatever the plugins
 * on FERRY_PLUGIN_PATH do, this process must get to its last line. */
#include <ferry.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                         \
    do {                                                                                    \
        ferry_status_t s_ = (call);                                                         \
        if (s_ != FERRY_OK) {                                                               \
            printf("FAILED %s: %s: %s\n", #call, ferry_status_name(s_), ferry_last_error()); \
            return 1;                                                                       \
        }                                                                                   \
    } while (0)

int main(void) {
    size_t len = 0;
    ferry_status_t s = ferry_info_json(NULL, 0, &len);
    if (s != FERRY_OK && len == 0) {
        printf("FAILED ferry_info_json: %s\n", ferry_last_error());
        return 1;
    }
    char *info = malloc(len + 1);
    if (info == NULL) return 1;
    CHECK(ferry_info_json(info, len + 1, &len));
    printf("INFO %s\n", info);
    free(info);
    fflush(stdout);

    ferry_engine *target = NULL, *initiator = NULL;
    CHECK(ferry_engine_new(NULL, &target));
    CHECK(ferry_engine_new(NULL, &initiator));
    const size_t size = 4u << 20, block = 1u << 20;
    unsigned char *remote = calloc(1, size), *src = malloc(size), *back = calloc(1, size);
    if (remote == NULL || src == NULL || back == NULL) return 1;
    for (size_t i = 0; i < size; i++) src[i] = (unsigned char)(i * 13 + i / 4096);
    CHECK(ferry_register_memory(target, remote, size, NULL));
    CHECK(ferry_register_memory(initiator, src, size, NULL));
    CHECK(ferry_register_memory(initiator, back, size, NULL));

    char name[256];
    size_t name_len = 0;
    CHECK(ferry_engine_segment_name(target, name, sizeof name, &name_len));
    ferry_segment_id seg = 0;
    CHECK(ferry_open_segment(initiator, name, &seg));

    ferry_request reqs[4];
    for (size_t i = 0; i < size / block; i++) {
        reqs[i] = (ferry_request){FERRY_OP_WRITE, 0, src + i * block, seg,
                                  (uint64_t)(uintptr_t)(remote + i * block), block};
    }
    CHECK(ferry_transfer_sync(initiator, reqs, size / block));
    for (size_t i = 0; i < size / block; i++) {
        reqs[i].op = FERRY_OP_READ;
        reqs[i].local_addr = back + i * block;
    }
    CHECK(ferry_transfer_sync(initiator, reqs, size / block));
    if (memcmp(src, remote, size) != 0 || memcmp(src, back, size) != 0) {
        printf("FAILED: the data differs\n");
        return 1;
    }
    /* By block layout: 4 KiB blocks of each pool, reversed order. */
    const uint64_t kv = 4096, blocks = size / kv;
    uint32_t local_layout = 0, remote_layout = 0;
    CHECK(ferry_layout_register(target, remote, kv, kv, blocks, &remote_layout));
    CHECK(ferry_layout_register(initiator, src, kv, kv, blocks, &local_layout));
    uint64_t *lids = malloc(blocks * sizeof *lids), *rids = malloc(blocks * sizeof *rids);
    if (lids == NULL || rids == NULL) return 1;
    for (uint64_t i = 0; i < blocks; i++) {
        lids[i] = i;
        rids[i] = blocks - 1 - i;
    }
    memset(remote, 0, size);
    ferry_batch_id batch = 0;
    CHECK(ferry_batch_new(initiator, blocks, &batch));
    CHECK(ferry_batch_submit_blocks(initiator, batch, FERRY_OP_WRITE, seg, local_layout, lids,
                                    remote_layout, rids, blocks));
    ferry_batch_summary sum;
    CHECK(ferry_batch_wait(initiator, batch, -1, &sum));
    if (sum.completed != blocks) {
        printf("FAILED: %llu of %llu blocks completed\n", (unsigned long long)sum.completed,
               (unsigned long long)blocks);
        return 1;
    }
    CHECK(ferry_batch_free(initiator, batch));
    for (uint64_t i = 0; i < blocks; i++) {
        if (memcmp(src + i * kv, remote + (blocks - 1 - i) * kv, kv) != 0) {
            printf("FAILED: block %llu differs\n", (unsigned long long)i);
            return 1;
        }
    }
    /* An index past the layout: refused, nothing submitted. */
    lids[0] = blocks;
    CHECK(ferry_batch_new(initiator, blocks, &batch));
    if (ferry_batch_submit_blocks(initiator, batch, FERRY_OP_WRITE, seg, local_layout, lids,
                                  remote_layout, rids, blocks) != FERRY_ERR_OUT_OF_BOUNDS) {
        printf("FAILED: an index out of range was not refused\n");
        return 1;
    }
    CHECK(ferry_batch_free(initiator, batch));
    free(lids);
    free(rids);
    ferry_engine_free(initiator);
    ferry_engine_free(target);
    printf("TRANSFER OK\n");
    return 0;
}
