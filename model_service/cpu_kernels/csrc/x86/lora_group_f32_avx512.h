/* lora_sgmv.c's grouped rows at the AVX-512F level (included by it on x86, after
 * lora_sgmv_avx512.h; lora_group_avx512.h says what grouping does): b transposed once for
 * all the rows, a read in place as the run-by-run shrink reads it. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_group_avx512.h"

/* The rows listed (x's and out's row indices), one adapter's factors for one target;
 * rank a whole number of sixteens. scratch: rank * out_f floats. */
static void f32_group_avx512(const float *x, int64_t x_stride, const int *rows, int count, int in_f, const float *a,
                             int rank, const float *b, int out_f, float scaling, float *out, int64_t out_stride,
                             float *scratch) {
    const int width = out_f - out_f % 16;
    transposed_avx512(b, 0, rank, width, scratch);
    for (int r = 0; r < count; r++) {
        float *out_row = out + (int64_t)rows[r] * out_stride;
        float shrunk[LORA_MAX_RANK];
        shrink_avx512(x + (int64_t)rows[r] * x_stride, a, rank, in_f, scaling, shrunk);
        for (int o = 0; o < width; o += 16) {
            __m512 lanes[16];
            grouped_lanes_avx512(shrunk, rank, scratch, width, o, lanes);
            _mm512_storeu_ps(out_row + o, _mm512_add_ps(_mm512_loadu_ps(out_row + o), tree16_avx512(lanes)));
        }
        for (int o = width; o < out_f; o++) out_row[o] += dot_avx512(shrunk, b + (int64_t)o * rank, rank);
    }
}

#pragma GCC pop_options
