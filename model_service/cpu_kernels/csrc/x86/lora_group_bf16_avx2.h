/* lora_sgmv_bf16.c's grouped rows at the AVX2 level (included by it on x86, after
 * lora_bf16_avx2.h; lora_group_avx2.h says what grouping does): the factors widened once
 * for all the rows, a to float32 in its layout (read by shrink8_of_avx2 in place of
 * widening a's rows for every row, the same sums) and b transposed. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lora_group_avx2.h"

/* The rows listed (x's and out's row indices), one adapter's factors for one target;
 * rank a whole number of eights. scratch: rank * (in_f + out_f) floats. */
static void bf16_group_avx2(const uint16_t *x, int64_t x_stride, const int *rows, int count, int in_f,
                            const uint16_t *a, int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                            int64_t out_stride, float *scratch) {
    const int width = out_f - out_f % 8;
    float *a_wide = scratch, *b_t = scratch + (int64_t)rank * in_f;
    widen(a, in_f, rank, in_f, a_wide);
    transposed_avx2(b, 1, rank, width, b_t);
    for (int r = 0; r < count; r++) {
        const uint16_t *x_row = x + (int64_t)rows[r] * x_stride;
        uint16_t *out_row = out + (int64_t)rows[r] * out_stride;
        float shrunk[LORA_MAX_RANK];
        for (int j = 0; j < rank; j += 8)
            shrink8_of_avx2(x_row, a + (int64_t)j * in_f, a_wide + (int64_t)j * in_f, 1, in_f, scaling, shrunk + j);
        for (int o = 0; o < width; o += 8) {
            __m256 lanes[8];
            grouped_lanes_avx2(shrunk, rank, b_t, width, o, lanes);
            /* + 0: the run-by-run kernel adds its (zero) tails there */
            const __m256 sums = _mm256_add_ps(tree8_avx2(lanes), _mm256_setzero_ps());
            store8_avx2(out_row + o, _mm256_add_ps(widen8_avx2(out_row + o), sums));
        }
        bf16_expand_rest_avx2(shrunk, rank, b, width, out_f, out_row);
    }
}

#pragma GCC pop_options
