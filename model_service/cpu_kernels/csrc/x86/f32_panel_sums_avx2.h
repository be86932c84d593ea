/* The AVX2 float32 panel product's inner loop and its tiles' cases, which two tiles share:
 * f32_matmul.c's (x86/f32_matmul_avx2.h) and bf16_matmul.c's over panels widened to float32
 * (x86/bf16_matmul_avx2.h). Included by both under their `avx2,fma` target. */

#define AVX2_F32_TILE_TOKENS 3 /* 2 panels x 2 halves x 3 tokens = 12 of the 16 registers */
#define AVX2_F32_PREFETCH 32   /* column lines ahead that a tile asks for (2 KB) */

/* NP float32 panels [cols][16] (panel_elems apart) times NT tokens of float32 x: each of the
 * 2 * NP * NT sums of eight rows in acc, in a register once inlined (NP and NT constants),
 * over the columns in order, one FMA a product. */
static inline __attribute__((always_inline)) void avx2_f32_panel_sums(const float *panel, int64_t panel_elems,
                                                                      const int NP, const float *x,
                                                                      int64_t x_stride, const int NT, int cols,
                                                                      __m256 acc[4][2][AVX2_F32_TILE_TOKENS]) {
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) acc[p][0][t] = acc[p][1][t] = _mm256_setzero_ps();
    for (int k = 0; k < cols; k++) {
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + AVX2_F32_PREFETCH) * PANEL_ROWS),
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
}

/* The AVX2 tiles' shapes, as panel_driver.h asks for them with group 4 for one token and 2
 * past it: CASE(NP, NT) is a `case NT:` calling the tile for those constants. */
#define AVX2_TILE_SWITCH(CASE)                                              \
    if (np == 4) {                                                          \
        switch (nt) { CASE(4, 1) }                                          \
    } else if (np == 2) {                                                   \
        switch (nt) { CASE(2, 1) CASE(2, 2) CASE(2, 3) }                    \
    } else {                                                                \
        switch (nt) { CASE(1, 1) CASE(1, 2) CASE(1, 3) }                    \
    }
