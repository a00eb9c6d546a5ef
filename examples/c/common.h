/* Shared by the C examples: error reporting and a checksum. */
#ifndef FERRY_EXAMPLE_COMMON_H
#define FERRY_EXAMPLE_COMMON_H

#include <ferry.h>
#include <stdio.h>
#include <stdlib.h>

/* Prints the failed call with Ferry's code and message, then exits. */
#define CHECK(call)                                                                 \
    do {                                                                            \
        ferry_status_t rc_ = (call);                                                \
        if (rc_ != FERRY_OK) {                                                      \
            fprintf(stderr, "%s failed: %s: %s\n", #call, ferry_status_name(rc_),   \
                    ferry_last_error());                                            \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* FNV-1a over 64-bit words: enough to tell two buffers apart. */
static inline uint64_t checksum(const void *buf, size_t len) {
    const uint64_t *w = buf;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len / 8; i++) h = (h ^ w[i]) * 1099511628211ull;
    return h;
}

#endif
