/* lora_sgmv_bf16.c's grouped rows at the AVX-512F level (included by it on x86, after
 * lora_bf16_avx512.h): the short runs of one adapter in a step, taken together, as
 * lora_runs.c hands them over. Run by run, every row widens each of its adapter's bfloat16
 * factors again, and its expand sums each output over the rank in a register of its own,
 * sixteen registers then reduced across their lanes (sums16_avx512): at rank 16 that
 * reduction costs more than the products. Here the factors are widened once for all the
 * rows, a to float32 in its layout and b transposed ([rank, outputs], whole sixteens of
 * outputs), so a row's expand takes sixteen outputs in each register: lane l of every
 * output's sum is one register, and the registers are added in sums16_avx512's order
 * (tree16_avx512). Each row's products and sums are then those of lora_shrink_expand_bf16
 * for a run of its own, in the same order: the same bits. Ranks that are whole sixteens
 * only (the rank's tail would need the run-by-run kernel's masks and scalar sums). */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_sums_avx512.h"

/* r transposed in place (lane i of r[l] becomes lane l of r[i]): at each step, for rows
 * i and i + h, the h-wide blocks off the diagonal are swapped, h = 8, 4, 2, 1. Step s's
 * row i takes lane l from r[i] where bit h of l is clear, else from r[i + h]'s lane l - h
 * (TRANSPOSE_LOW); row i + h from r[i]'s lane l + h, or its own lane l (TRANSPOSE_HIGH);
 * an index of 16 or more picks from the second source. Constant tables: computed in the
 * function, they went through the stack at every call. */
static const int32_t TRANSPOSE_LOW[4][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
};
static const int32_t TRANSPOSE_HIGH[4][16] __attribute__((aligned(64))) = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
};

static inline void transpose16_avx512(__m512 *r) {
    PANEL_UNROLL
    for (int step = 0; step < 4; step++) {
        const int h = 8 >> step;
        const __m512i low = _mm512_load_si512(TRANSPOSE_LOW[step]), high = _mm512_load_si512(TRANSPOSE_HIGH[step]);
        PANEL_UNROLL
        for (int i = 0; i < 16; i++) {
            if (i & h) continue;
            const __m512 top = r[i], bottom = r[i + h];
            r[i] = _mm512_permutex2var_ps(top, low, bottom);
            r[i + h] = _mm512_permutex2var_ps(top, high, bottom);
        }
    }
}

/* b_t[j, o] = b[o, j] widened, for o below `width` (whole sixteens of outputs) and j below
 * `rank` (whole sixteens). */
static void widen_transposed_avx512(const uint16_t *b, int rank, int width, float *b_t) {
    for (int o = 0; o < width; o += 16)
        for (int j = 0; j < rank; j += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = widen16_avx512(b + (int64_t)(o + i) * rank + j);
            transpose16_avx512(r);
            for (int l = 0; l < 16; l++) _mm512_storeu_ps(b_t + (int64_t)(j + l) * width + o, r[l]);
        }
}

static void widen_avx512(const uint16_t *src, int64_t n, float *dst) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, widen16_avx512(src + i));
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* A row's expand over b_t: its first `width` outputs sixteen at a time, the rest as the
 * run-by-run kernel takes them. */
static void expand_grouped_avx512(const float *s, int rank, const float *b_t, int width, const uint16_t *b,
                                  int out_f, uint16_t *out) {
    for (int o = 0; o < width; o += 16) {
        __m512 lanes[16];
        PANEL_UNROLL
        for (int l = 0; l < 16; l++)
            lanes[l] = _mm512_fmadd_ps(_mm512_set1_ps(s[l]), _mm512_loadu_ps(b_t + (int64_t)l * width + o),
                                       _mm512_setzero_ps());
        for (int j = 16; j < rank; j += 16) {
            PANEL_UNROLL
            for (int l = 0; l < 16; l++)
                lanes[l] = _mm512_fmadd_ps(_mm512_set1_ps(s[j + l]),
                                           _mm512_loadu_ps(b_t + (int64_t)(j + l) * width + o), lanes[l]);
        }
        /* + 0: the run-by-run kernel adds its (zero) tails there */
        const __m512 sums = _mm512_add_ps(tree16_avx512(lanes), _mm512_setzero_ps());
        store16_avx512(out + o, _mm512_add_ps(widen16_avx512(out + o), sums));
    }
    bf16_expand_rest_avx512(s, rank, b, width, out_f, out);
}

/* The rows listed (x's and out's row indices), one adapter's factors for one target;
 * rank a whole number of sixteens. scratch: rank * (in_f + out_f) floats. */
static void bf16_group_avx512(const uint16_t *x, int64_t x_stride, const int *rows, int count, int in_f,
                              const uint16_t *a, int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                              int64_t out_stride, float *scratch) {
    const int width = out_f - out_f % 16;
    float *a_wide = scratch, *b_t = scratch + (int64_t)rank * in_f;
    widen_avx512(a, (int64_t)rank * in_f, a_wide);
    widen_transposed_avx512(b, rank, width, b_t);
    for (int r = 0; r < count; r++) {
        const uint16_t *x_row = x + (int64_t)rows[r] * x_stride;
        float shrunk[LORA_MAX_RANK];
        for (int j = 0; j < rank; j += 16)
            shrink_rows_of_avx512(x_row, a + (int64_t)j * in_f, a_wide + (int64_t)j * in_f, 1, 16, in_f, scaling,
                                  shrunk + j);
        expand_grouped_avx512(shrunk, rank, b_t, width, b, out_f, out + (int64_t)rows[r] * out_stride);
    }
}

#pragma GCC pop_options
