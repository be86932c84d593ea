/* f32_matmul.c's AVX2 level (included by it on x86; its header comment says how the level
 * works): tile_avx2. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "f32_panel_sums_avx2.h"

_Static_assert(F32_AVX2_TOKEN_TILE == AVX2_F32_TILE_TOKENS, "the plan's tile is f32_panel_sums_avx2.h's");

/* NP panels times NT tokens (constants where it is inlined): avx2_f32_panel_sums, stored
 * as float32. */
static inline __attribute__((always_inline)) void tile_avx2_n(const float *panel, int64_t panel_elems, const int NP,
                                                              const float *x, int64_t x_stride, const int NT,
                                                              int cols, float *y, int64_t y_stride, int row0,
                                                              int rows) {
    __m256 acc[4][2][AVX2_F32_TILE_TOKENS];
    avx2_f32_panel_sums(panel, panel_elems, NP, x, x_stride, NT, cols, acc);
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) {
            float sums[PANEL_ROWS];
            _mm256_storeu_ps(sums, acc[p][0][t]);
            _mm256_storeu_ps(sums + 8, acc[p][1][t]);
            store_rows(y + t * y_stride, sums, row0 + p * PANEL_ROWS, rows);
        }
}

#define F32_AVX2_CASE(NP, NT)                                                                           \
    case NT:                                                                                            \
        tile_avx2_n(panel, panel_elems, NP, x, x_stride, NT, cols, y, y_stride, row0, rows);            \
        break;

static void tile_avx2(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride, int nt,
                      int cols, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv, *panel = panel_v;
    float *y = y_v;
    AVX2_TILE_SWITCH(F32_AVX2_CASE)
}
#undef F32_AVX2_CASE
#pragma GCC pop_options
