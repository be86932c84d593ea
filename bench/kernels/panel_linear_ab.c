/* Two builds of the CPU kernels' panel linears (f32_linear or bf16_linear), taking turns in
 * one process on the same weights and tokens: microseconds a product and GFLOP/s, the best
 * of 5 rounds, and old / new (above 1: the second build is faster). Each product's output
 * is compared bit for bit between the builds first. For a change to csrc/panel_driver.h,
 * f32_matmul.c, bf16_matmul.c or their tiles, measured against the build before it (the
 * benchmark log, "float32 panel kernel at prefill sizes").
 *
 *   gcc -O2 -o /tmp/panel_ab bench/kernels/panel_linear_ab.c -ldl
 *   (cd model_service/cpu_kernels/csrc && gcc -O3 -march=native -fopenmp -shared -fPIC \
 *        -std=gnu11 -o /tmp/new.so f32_matmul.c bf16_matmul.c -lm)   # and /tmp/old.so
 *   /tmp/panel_ab f32|bf16 LEVEL /tmp/old.so /tmp/new.so [SECONDS]
 *       LEVEL: the family's level index (0 portable, 1 AVX2, 2 AVX-512); SECONDS a path and
 *       round (default 0.1)
 *
 * One thread, timed by the calling thread's CPU time (steadier than the wall clock on a
 * machine other work shares). Shapes: the random 19M Llama's gate_up and down, SmolLM2-135M's
 * down and gate_up; tokens 1, 5, 8, 32, 128, 512. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*pack_fn)(const void *w, int64_t w_stride, int rows, int cols, void *panels);
typedef int (*linear_fn)(const void *x, int64_t x_stride, int tokens, int cols, int rows, const void *panels,
                         void *y, int64_t y_stride, int level, int num_threads);

enum { ROUNDS = 5 };

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* A random element: a float32 in [-0.5, 0.5), or a bfloat16 of magnitude 1-2 with a random sign. */
static void fill(void *data, size_t count, size_t bytes) {
    for (size_t i = 0; i < count; i++) {
        if (bytes == 4) ((float *)data)[i] = (float)rand() / RAND_MAX - 0.5f;
        else ((uint16_t *)data)[i] = (uint16_t)(0x3f80 + (rand() & 0x7f) + ((rand() & 1) << 15));
    }
}

static double best_us(linear_fn linear, const void *x, int tokens, int cols, int rows, const void *panels, void *y,
                      int level, double seconds, double best) {
    int calls = 0;
    double elapsed;
    const double started = thread_seconds();
    do {
        linear(x, cols, tokens, cols, rows, panels, y, rows, level, 1);
        calls++;
    } while ((elapsed = thread_seconds() - started) < seconds);
    const double us = elapsed / calls * 1e6;
    return us < best ? us : best;
}

int main(int argc, char **argv) {
    if (argc < 5 || (strcmp(argv[1], "f32") != 0 && strcmp(argv[1], "bf16") != 0)) {
        fprintf(stderr, "usage: %s f32|bf16 LEVEL OLD.so NEW.so [SECONDS]\n", argv[0]);
        return 2;
    }
    const int f32 = strcmp(argv[1], "f32") == 0, level = atoi(argv[2]);
    const double seconds = argc > 5 ? atof(argv[5]) : 0.1;
    const size_t bytes = f32 ? 4 : 2; /* the weights', x's and y's elements */
    pack_fn pack[2];
    linear_fn linear[2];
    for (int b = 0; b < 2; b++) {
        void *library = dlopen(argv[3 + b], RTLD_NOW | RTLD_LOCAL);
        if (!library) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        pack[b] = (pack_fn)dlsym(library, f32 ? "f32_pack_panels" : "bf16_pack_panels");
        linear[b] = (linear_fn)dlsym(library, f32 ? "f32_linear" : "bf16_linear");
        if (!pack[b] || !linear[b]) {
            fprintf(stderr, "%s: no %s linear\n", argv[3 + b], argv[1]);
            return 1;
        }
    }
    static const int shapes[][2] = {{1376, 256}, {256, 688}, {576, 1536}, {3072, 576}};
    static const int token_counts[] = {1, 5, 8, 32, 128, 512};
    int mismatches = 0;
    printf("| rows x cols | tokens | old us | new us | old GFLOP/s | new GFLOP/s | old / new |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int rows = shapes[s][0], cols = shapes[s][1];
        /* room for a pair column's padding, and 64-byte aligned as the tensors torch allocates */
        const size_t panel_bytes = ((size_t)(rows + 15) / 16 * 16 * (cols + 1) * bytes + 63) / 64 * 64;
        void *w = malloc((size_t)rows * cols * bytes), *panels[2];
        fill(w, (size_t)rows * cols, bytes);
        for (int b = 0; b < 2; b++) {
            panels[b] = aligned_alloc(64, panel_bytes);
            pack[b](w, cols, rows, cols, panels[b]);
        }
        for (size_t c = 0; c < sizeof token_counts / sizeof token_counts[0]; c++) {
            const int tokens = token_counts[c];
            void *x = malloc((size_t)tokens * cols * bytes), *y[2];
            fill(x, (size_t)tokens * cols, bytes);
            for (int b = 0; b < 2; b++) {
                y[b] = malloc((size_t)tokens * rows * bytes);
                linear[b](x, cols, tokens, cols, rows, panels[b], y[b], rows, level, 1);
            }
            if (memcmp(y[0], y[1], (size_t)tokens * rows * bytes) != 0) {
                printf("| %d x %d | %d | the builds' outputs differ |\n", rows, cols, tokens);
                mismatches++;
            }
            double best[2] = {1e30, 1e30};
            for (int round = 0; round < ROUNDS; round++)
                for (int b = 0; b < 2; b++)
                    best[b] = best_us(linear[b], x, tokens, cols, rows, panels[b], y[b], level, seconds, best[b]);
            const double flops = 2.0 * rows * cols * tokens;
            printf("| %d x %d | %d | %.1f | %.1f | %.1f | %.1f | %.2f |\n", rows, cols, tokens, best[0], best[1],
                   flops / best[0] * 1e-3, flops / best[1] * 1e-3, best[0] / best[1]);
            free(x);
            free(y[0]);
            free(y[1]);
        }
        free(w);
        free(panels[0]);
        free(panels[1]);
    }
    if (mismatches) printf("%d products differ between the builds\n", mismatches);
    return mismatches ? 1 : 0;
}
