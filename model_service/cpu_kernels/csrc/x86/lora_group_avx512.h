/* What the LoRA kernels' grouped rows share at the AVX-512F level (lora_group_bf16_avx512.h,
 * lora_group_f32_avx512.h; included under each one's target pragma): the short runs of one
 * adapter in a step, taken together, as lora_runs.c hands them over. Run by run, a row's
 * expand sums each output over the rank in a register of its own, sixteen registers then
 * reduced across their lanes (sums16_avx512): at rank 16 that reduction costs more than the
 * products. Here b is transposed once for all the rows ([rank, outputs], float32, whole
 * sixteens of outputs), so a row's expand takes sixteen outputs in each register: lane l of
 * every output's sum is one register (grouped_lanes_avx512), and the registers are added in
 * sums16_avx512's order (tree16_avx512). Each row's products and sums are then those of the
 * run-by-run kernel for a run of its own, in the same order: the same bits. Ranks that are
 * whole sixteens only (the rank's tail would need the run-by-run kernels' masks and scalar
 * sums). */
#ifndef PAGEDKV_LORA_GROUP_AVX512_H
#define PAGEDKV_LORA_GROUP_AVX512_H

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

/* Sixteen values of b from `at` as float32: b bfloat16 where `bf16`, else float32. */
static inline __attribute__((always_inline)) __m512 row16_avx512(const void *b, int bf16, int64_t at) {
    if (!bf16) return _mm512_loadu_ps((const float *)b + at);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* b_t[j, o] = b[o, j] as float32 (`bf16`, a constant where inlined, as row16_avx512's),
 * for o below `width` (whole sixteens of outputs) and j below `rank` (whole sixteens). */
static inline __attribute__((always_inline)) void transposed_avx512(const void *b, int bf16, int rank, int width,
                                                                    float *b_t) {
    for (int o = 0; o < width; o += 16)
        for (int j = 0; j < rank; j += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = row16_avx512(b, bf16, (int64_t)(o + i) * rank + j);
            transpose16_avx512(r);
            for (int l = 0; l < 16; l++) _mm512_storeu_ps(b_t + (int64_t)(j + l) * width + o, r[l]);
        }
}

/* Outputs [o, o + 16)'s sums over the rank by lane, as the run-by-run expand's registers hold
 * them: lanes[l] = sum over the rank's sixteens c of s[16c + l] * b[o.., 16c + l], in c's
 * order, the first a product added to zero. */
static inline __attribute__((always_inline)) void grouped_lanes_avx512(const float *s, int rank, const float *b_t,
                                                                       int width, int o, __m512 *lanes) {
    PANEL_UNROLL
    for (int l = 0; l < 16; l++)
        lanes[l] = _mm512_fmadd_ps(_mm512_set1_ps(s[l]), _mm512_loadu_ps(b_t + (int64_t)l * width + o),
                                   _mm512_setzero_ps());
    for (int j = 16; j < rank; j += 16) {
        PANEL_UNROLL
        for (int l = 0; l < 16; l++)
            lanes[l] = _mm512_fmadd_ps(_mm512_set1_ps(s[j + l]), _mm512_loadu_ps(b_t + (int64_t)(j + l) * width + o),
                                       lanes[l]);
    }
}

#endif
