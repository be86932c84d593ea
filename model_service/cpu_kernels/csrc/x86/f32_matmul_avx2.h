/* f32_matmul.c's AVX2 level (included by it on x86; its header comment says how the level
 * works): tile_avx2. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

/* NP panels times NT tokens, 2 * NP * NT sums of eight rows in registers (NP and NT are
 * constants where it is inlined). */
static inline __attribute__((always_inline)) void tile_avx2_n(const float *panel, int64_t panel_elems, const int NP,
                                                              const float *x, int64_t x_stride, const int NT,
                                                              int cols, float *y, int64_t y_stride, int row0,
                                                              int rows) {
    __m256 acc[4][2][F32_AVX2_TOKEN_TILE];
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) acc[p][0][t] = acc[p][1][t] = _mm256_setzero_ps();
    for (int k = 0; k < cols; k++) {
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + F32_PREFETCH) * PANEL_ROWS),
                         _MM_HINT_T0);
        PANEL_UNROLL for (int p = 0; p < NP; p++) {
            const float *line = panel + p * panel_elems + (int64_t)k * PANEL_ROWS;
            const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
            PANEL_UNROLL for (int t = 0; t < NT; t++) {
                const __m256 xs = _mm256_broadcast_ss(x + t * x_stride + k);
                acc[p][0][t] = _mm256_fmadd_ps(w0, xs, acc[p][0][t]);
                acc[p][1][t] = _mm256_fmadd_ps(w1, xs, acc[p][1][t]);
            }
        }
    }
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
    if (np == 4) {
        switch (nt) { F32_AVX2_CASE(4, 1) }
    } else if (np == 2) {
        switch (nt) { F32_AVX2_CASE(2, 1) F32_AVX2_CASE(2, 2) F32_AVX2_CASE(2, 3) }
    } else {
        switch (nt) { F32_AVX2_CASE(1, 1) F32_AVX2_CASE(1, 2) F32_AVX2_CASE(1, 3) }
    }
}
#undef F32_AVX2_CASE
#pragma GCC pop_options
