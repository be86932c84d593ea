/* lora_sgmv.c's grouped rows at the AVX2 level (included by it on x86, after
 * lora_sgmv_avx2.h; lora_group_avx2.h says what grouping does): b transposed once for all
 * the rows, a read in place as the run-by-run shrink reads it. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lora_group_avx2.h"

/* The rows listed (x's and out's row indices), one adapter's factors for one target;
 * rank a whole number of eights. scratch: rank * out_f floats. */
static void f32_group_avx2(const float *x, int64_t x_stride, const int *rows, int count, int in_f, const float *a,
                           int rank, const float *b, int out_f, float scaling, float *out, int64_t out_stride,
                           float *scratch) {
    const int width = out_f - out_f % 8;
    transposed_avx2(b, 0, rank, width, scratch);
    for (int r = 0; r < count; r++) {
        float *out_row = out + (int64_t)rows[r] * out_stride;
        float shrunk[LORA_MAX_RANK];
        shrink_avx2(x + (int64_t)rows[r] * x_stride, a, rank, in_f, scaling, shrunk);
        for (int o = 0; o < width; o += 8) {
            __m256 lanes[8];
            grouped_lanes_avx2(shrunk, rank, scratch, width, o, lanes);
            /* + 0: the run-by-run kernel adds its (zero) tails there */
            const __m256 sums = _mm256_add_ps(tree8_avx2(lanes), _mm256_setzero_ps());
            _mm256_storeu_ps(out_row + o, _mm256_add_ps(_mm256_loadu_ps(out_row + o), sums));
        }
        for (int o = width; o < out_f; o++) out_row[o] += dot_avx2(shrunk, b + (int64_t)o * rank, rank);
    }
}

#pragma GCC pop_options
