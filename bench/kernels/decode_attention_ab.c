/* Two (or more) builds of the CPU kernels' paged_decode_attention, taking turns in one
 * process on the same K/V: nanoseconds per (key, kv head), medians of 9 rounds. For a
 * change to csrc/paged_decode*.c|h, measured against the build before it
 * (BENCHMARKS.md, "Decode attention in spans").
 *
 *   gcc -O2 -o /tmp/decode_ab bench/kernels/decode_attention_ab.c -ldl
 *   (cd model_service/cpu_kernels/csrc && gcc -O3 -march=native -fopenmp -shared -fPIC \
 *        -std=gnu11 -o /tmp/new.so paged_decode.c layer_ops.c argmax.c -lm)   # and /tmp/old.so
 *   /tmp/decode_ab BATCH KV_HEADS HEAD_DIM Q_HEADS DTYPE /tmp/old.so /tmp/new.so
 *       DTYPE: 0 float32, 1 bfloat16; e.g. 48 3 64 9 1 is SmolLM2 at batch 48
 *   env THREADS=N (default 1); L1=1 points every table at the same two blocks (K/V in cache)
 *
 * Block size 16, contexts 100-200 (sequence i has 200 - (97 i mod 100) keys), blocks laid
 * out one after another. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int (*attention_fn)(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t table_row_stride, const int32_t *context_lens,
                            int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size, float scale,
                            int sliding_window, int dtype, void *out, int num_threads);

enum { MAX_BUILDS = 8, ROUNDS = 9, BLOCK_SIZE = 16, BLOCKS_A_SEQ = 14 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Random values around 1 (K, V) or 0.25 (q), as bfloat16 bit patterns or float32. */
static void fill(void *data, size_t count, int bf16, uint16_t pattern) {
    for (size_t i = 0; i < count; i++) {
        if (bf16) ((uint16_t *)data)[i] = pattern ^ (rand() & 0x807f);
        else ((float *)data)[i] = rand() / (float)RAND_MAX - 0.5f;
    }
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s BATCH KV_HEADS HEAD_DIM Q_HEADS DTYPE LIB.so [LIB.so ...]\n", argv[0]);
        return 2;
    }
    const int batch = atoi(argv[1]), kv_heads = atoi(argv[2]), head_dim = atoi(argv[3]), q_heads = atoi(argv[4]);
    const int dtype = atoi(argv[5]), builds = argc - 6 < MAX_BUILDS ? argc - 6 : MAX_BUILDS;
    const int threads = getenv("THREADS") ? atoi(getenv("THREADS")) : 1;
    attention_fn attend[MAX_BUILDS];
    for (int b = 0; b < builds; b++) {
        void *library = dlopen(argv[6 + b], RTLD_NOW | RTLD_LOCAL);
        if (!library || !(attend[b] = (attention_fn)dlsym(library, "paged_decode_attention"))) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
    }
    const size_t element = dtype == 1 ? 2 : 4, blocks = (size_t)batch * BLOCKS_A_SEQ + 1;
    const size_t block_elements = (size_t)BLOCK_SIZE * kv_heads * head_dim, q_elements = (size_t)batch * q_heads * head_dim;
    void *k = malloc(blocks * block_elements * element), *v = malloc(blocks * block_elements * element);
    void *q = malloc(q_elements * element), *out = malloc(q_elements * element);
    fill(k, blocks * block_elements, dtype == 1, 0x3f80);
    fill(v, blocks * block_elements, dtype == 1, 0x3f80);
    fill(q, q_elements, dtype == 1, 0x3e80);
    int32_t *tables = malloc(sizeof(int32_t) * batch * BLOCKS_A_SEQ), *lens = malloc(sizeof(int32_t) * batch);
    for (int i = 0; i < batch * BLOCKS_A_SEQ; i++) tables[i] = getenv("L1") ? 1 + (i % BLOCKS_A_SEQ) % 2 : i + 1;
    long keys = 0;
    for (int i = 0; i < batch; i++) keys += (long)(lens[i] = 200 - (i * 97) % 100) * kv_heads;

    const int calls = 4000 / batch + 5;
    double ns[MAX_BUILDS][ROUNDS];
    for (int round = 0; round < ROUNDS; round++)
        for (int b = 0; b < builds; b++) {
            const double started = now();
            for (int i = 0; i < calls; i++)
                attend[b](q, (int64_t)q_heads * head_dim, k, v, tables, BLOCKS_A_SEQ, lens, batch, q_heads, kv_heads,
                          head_dim, BLOCK_SIZE, 0.125f, 0, dtype, out, threads);
            ns[b][round] = (now() - started) / calls / keys * 1e9;
        }
    for (int b = 0; b < builds; b++) {
        qsort(ns[b], ROUNDS, sizeof(double), by_value);
        printf("%s: median %.1f ns a key and kv head (fastest round %.1f)\n", argv[6 + b], ns[b][ROUNDS / 2], ns[b][0]);
    }
    return 0;
}
