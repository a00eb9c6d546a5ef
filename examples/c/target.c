/*
 * A Ferry target in C: registers a buffer and serves it until stdin closes.
 *
 *   ./target [size]
 *
 * Prints "SEGMENT <name> <address> <size>" once ready; on each "checksum"
 * line from stdin it prints "CHECKSUM <hex>" of its buffer, followed by
 * " NOTIFY <name>:<message>" for each notification initiators sent.
 */
#include "common.h"
#include <string.h>

int main(int argc, char **argv) {
    size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : (64u << 20);
    ferry_config *config = NULL;
    CHECK(ferry_config_new(&config));
    CHECK(ferry_config_set(config, "listen", "127.0.0.1:0"));
    ferry_engine *engine = NULL;
    CHECK(ferry_engine_new(config, &engine));
    ferry_config_free(config);

    /* Memory from the engine: same-host peers map it (shm), others reach it
     * over the network. ferry_register_memory works for any other memory. */
    void *mem = NULL;
    CHECK(ferry_allocate_memory(engine, size, -1, &mem));
    unsigned char *buf = mem;
    memset(buf, 0, size);

    char name[256];
    CHECK(ferry_engine_segment_name(engine, name, sizeof name, NULL));
    printf("SEGMENT %s %p %zu\n", name, (void *)buf, size);
    fflush(stdout);

    char line[64];
    while (fgets(line, sizeof line, stdin) != NULL) {
        if (strncmp(line, "checksum", 8) == 0) {
            printf("CHECKSUM %016llx", (unsigned long long)checksum(buf, size));
            ferry_notification note;
            uint32_t got = 0;
            while (ferry_notify_next(engine, &note, &got) == FERRY_OK && got) {
                printf(" NOTIFY %s:%.*s", note.name, (int)note.msg_len, (const char *)note.msg);
            }
            printf("\n");
            fflush(stdout);
        }
    }
    CHECK(ferry_free_memory(engine, buf));
    ferry_engine_free(engine);
    return 0;
}
