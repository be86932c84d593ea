/* lora_sgmv_bf16.c's grouped rows at the AVX-512F level (included by it on x86, after
 * lora_bf16_avx512.h; lora_group_avx512.h says what grouping does): the factors widened
 * once for all the rows, a to float32 in its layout (the shrink then reads it in place of
 * widening a's rows for every row: shrink_rows_of_avx512, the same sums) and b transposed. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_group_avx512.h"

/* The rows listed (x's and out's row indices), one adapter's factors for one target;
 * rank a whole number of sixteens. scratch: rank * (in_f + out_f) floats. */
static void bf16_group_avx512(const uint16_t *x, int64_t x_stride, const int *rows, int count, int in_f,
                              const uint16_t *a, int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                              int64_t out_stride, float *scratch) {
    const int width = out_f - out_f % 16;
    float *a_wide = scratch, *b_t = scratch + (int64_t)rank * in_f;
    widen(a, in_f, rank, in_f, a_wide);
    transposed_avx512(b, 1, rank, width, b_t);
    for (int r = 0; r < count; r++) {
        const uint16_t *x_row = x + (int64_t)rows[r] * x_stride;
        uint16_t *out_row = out + (int64_t)rows[r] * out_stride;
        float shrunk[LORA_MAX_RANK];
        for (int j = 0; j < rank; j += 16)
            shrink_rows_of_avx512(x_row, a + (int64_t)j * in_f, a_wide + (int64_t)j * in_f, 1, 16, in_f, scaling,
                                  shrunk + j);
        for (int o = 0; o < width; o += 16) {
            __m512 lanes[16];
            grouped_lanes_avx512(shrunk, rank, b_t, width, o, lanes);
            /* + 0: the run-by-run kernel adds its (zero) tails there */
            const __m512 sums = _mm512_add_ps(tree16_avx512(lanes), _mm512_setzero_ps());
            store16_avx512(out_row + o, _mm512_add_ps(widen16_avx512(out_row + o), sums));
        }
        bf16_expand_rest_avx512(shrunk, rank, b, width, out_f, out_row);
    }
}

#pragma GCC pop_options
