// What a machine's memory allows a scattered copy, with no transport in the
// way: THREADS threads copy 256 MiB as BLOCK-byte blocks from shuffled places
// of one 1 GiB buffer to shuffled places of another, each its share; five
// rounds, median GB/s. Compare a small BLOCK with 1 MiB on the same machine
// to see what scattering costs at that thread count (issue 30's host rows).
//
//   cc -O2 -mavx2 -pthread -o scatter-probe tests/gpu/scatter_probe.c
//   scatter-probe BLOCK THREADS [OPTIONS] [r]
//
// OPTIONS (one word, any of): n streaming stores (as shm's copies of large
// submissions), h transparent huge pages (else MADV_NOHUGEPAGE), x none.
// Without the last argument the blocks are also copied in address order
// (sorted by source, then by destination); with "r" only shuffled.
// tests/gpu/prepare.sh builds it into the prefix's bin/ when cc is there.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint32_t src, dst;
} Pair;

static char *src_buf, *dst_buf;
static Pair *pairs;
static size_t n_pairs, block;
static int threads, streaming;
static volatile int go;
static int finished;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_src(const void *a, const void *b) {
    uint32_t x = ((const Pair *)a)->src, y = ((const Pair *)b)->src;
    return (x > y) - (x < y);
}

static int by_dst(const void *a, const void *b) {
    uint32_t x = ((const Pair *)a)->dst, y = ((const Pair *)b)->dst;
    return (x > y) - (x < y);
}

// 64 bytes at a time, stores bypassing the cache (blocks are 64-byte
// multiples at 64-byte aligned places here).
static void copy_streaming(char *d, const char *s, size_t len) {
    for (size_t o = 0; o < len; o += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + o));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + o + 32));
        _mm256_stream_si256((__m256i *)(d + o), a);
        _mm256_stream_si256((__m256i *)(d + o + 32), b);
    }
}

static void *copier(void *arg) {
    long t = (long)arg;
    size_t per = (n_pairs + threads - 1) / threads;
    size_t from = t * per, to = from + per > n_pairs ? n_pairs : from + per;
    while (!go) {
    }
    for (size_t i = from; i < to; i++) {
        char *d = dst_buf + (size_t)pairs[i].dst * block;
        const char *s = src_buf + (size_t)pairs[i].src * block;
        if (streaming)
            copy_streaming(d, s, block);
        else
            memcpy(d, s, block);
    }
    if (streaming)
        _mm_sfence();
    __atomic_add_fetch(&finished, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s BLOCK THREADS [n|h|nh|x] [r]\n", argv[0]);
        return 2;
    }
    block = strtoul(argv[1], NULL, 10);
    threads = atoi(argv[2]);
    const char *opts = argc > 3 ? argv[3] : "x";
    int huge = strchr(opts, 'h') != NULL;
    streaming = strchr(opts, 'n') != NULL;
    const size_t pool = 1ul << 30, batch = 256ul << 20;
    if (block < 64 || block % 64 || block > batch || threads < 1 || threads > 256) {
        fprintf(stderr, "BLOCK: a multiple of 64 up to 256 MiB; THREADS: 1 to 256\n");
        return 2;
    }
    n_pairs = batch / block;
    size_t n_blocks = pool / block;
    src_buf = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    dst_buf = mmap(NULL, pool, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (src_buf == MAP_FAILED || dst_buf == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    int advice = huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE;
    madvise(src_buf, pool, advice);
    madvise(dst_buf, pool, advice);
    memset(src_buf, 1, pool);
    memset(dst_buf, 2, pool);
    uint32_t *perm = malloc(n_blocks * sizeof *perm);
    pairs = malloc(n_pairs * sizeof *pairs);
    if (!perm || !pairs)
        return 1;
    int orders = argc > 4 ? 1 : 3;
    static const char *names[] = {"shuffled", "by-source", "by-dest"};
    for (int order = 0; order < orders; order++) {
        double gbps[5];
        for (int round = 0; round < 5; round++) {
            for (size_t i = 0; i < n_blocks; i++)
                perm[i] = i;
            srand(round + 1);
            for (size_t i = n_blocks - 1; i > 0; i--) {
                size_t j = (size_t)rand() % (i + 1);
                uint32_t x = perm[i];
                perm[i] = perm[j];
                perm[j] = x;
            }
            for (size_t i = 0; i < n_pairs; i++) {
                pairs[i].src = perm[i];
                pairs[i].dst = perm[n_blocks - 1 - i];
            }
            if (order == 1)
                qsort(pairs, n_pairs, sizeof *pairs, by_src);
            if (order == 2)
                qsort(pairs, n_pairs, sizeof *pairs, by_dst);
            go = 0;
            finished = 0;
            pthread_t th[256];
            for (long t = 0; t < threads; t++)
                pthread_create(&th[t], NULL, copier, (void *)t);
            usleep(20000);
            double t0 = now();
            go = 1;
            while (__atomic_load_n(&finished, __ATOMIC_SEQ_CST) < threads)
                usleep(20);
            gbps[round] = batch / (now() - t0) / 1e9;
            for (int t = 0; t < threads; t++)
                pthread_join(th[t], NULL);
        }
        qsort(gbps, 5, sizeof gbps[0], cmp_double);
        printf("block %zu threads %d %s%s %s: median %.2f GB/s (min %.2f, max %.2f)\n", block,
               threads, huge ? "huge-pages" : "4k-pages", streaming ? " streaming" : "",
               names[order], gbps[2], gbps[0], gbps[4]);
    }
    return 0;
}
