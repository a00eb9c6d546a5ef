/* Settings and the info report through the C API, for tests/config.rs.
 *
 *   config info                 prints ferry_info_json() on one line
 *   config get KEY... [-- K=V]  ferry_config_new (the environment), then each
 *                               K=V through ferry_config_set, then prints
 *                               "KEY=VALUE" per KEY from ferry_config_get
 *
 * Any failure prints "ERR <status name> <message>" and exits 1. */
#include <ferry.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(ferry_status_t s) {
    printf("ERR %s %s\n", ferry_status_name(s), ferry_last_error());
    return 1;
}

static int info(void) {
    size_t len = 0;
    ferry_status_t s = ferry_info_json(NULL, 0, &len);
    if (s != FERRY_ERR_NO_MEMORY) return fail(s);
    char *buf = malloc(len + 1);
    if (buf == NULL) return 1;
    s = ferry_info_json(buf, len + 1, &len);
    if (s != FERRY_OK) return fail(s);
    printf("%s\n", buf);
    free(buf);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "info") == 0) return info();
    if (argc < 2 || strcmp(argv[1], "get") != 0) {
        fprintf(stderr, "usage: config info | config get KEY... [-- KEY=VALUE...]\n");
        return 2;
    }
    ferry_config *config = NULL;
    ferry_status_t s = ferry_config_new(&config);
    if (s != FERRY_OK) return fail(s);
    int sep = argc;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            sep = i;
            break;
        }
    }
    for (int i = sep + 1; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (eq == NULL) return 2;
        *eq = '\0';
        s = ferry_config_set(config, argv[i], eq + 1);
        if (s != FERRY_OK) {
            ferry_config_free(config);
            return fail(s);
        }
    }
    for (int i = 2; i < sep; i++) {
        char value[4096];
        size_t len = 0;
        s = ferry_config_get(config, argv[i], value, sizeof value, &len);
        if (s != FERRY_OK) {
            ferry_config_free(config);
            return fail(s);
        }
        printf("%s=%s\n", argv[i], value);
    }
    ferry_config_free(config);
    return 0;
}
