/* bf16_matmul.c's AVX-512 BF16 level (included by it on x86; its header comment says how
 * the level works): tile_bf16. */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

/* NP panels (panel_elems apart) times NT tokens; NP and NT are constants where it is
 * inlined, so the NP x NT sums stay in registers. */
static inline __attribute__((always_inline)) void tile_avx512(const uint16_t *panel, int64_t panel_elems,
                                                              const int NP, const uint16_t *x, int64_t x_stride,
                                                              const int NT, int pairs, uint16_t *y,
                                                              int64_t y_stride, int row0, int rows) {
    __m512 acc[4][BF16_TOKEN_TILE];
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) acc[p][t] = _mm512_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        __m512bh lines[4];
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + BF16_PREFETCH) * 2 * BF16_PANEL_ROWS),
                         _MM_HINT_T0);
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            lines[p] = (__m512bh)_mm512_loadu_si512(panel + p * panel_elems + (int64_t)k * 2 * BF16_PANEL_ROWS);
        PANEL_UNROLL for (int t = 0; t < NT; t++) {
            int32_t pair;
            memcpy(&pair, x + t * x_stride + 2 * k, sizeof pair);
            const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
            PANEL_UNROLL for (int p = 0; p < NP; p++) acc[p][t] = _mm512_dpbf16_ps(acc[p][t], lines[p], xs);
        }
    }
    PANEL_UNROLL for (int p = 0; p < NP; p++) {
        const int first = row0 + p * BF16_PANEL_ROWS, valid = rows - first;
        const __mmask16 mask = valid >= BF16_PANEL_ROWS ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
        PANEL_UNROLL for (int t = 0; t < NT; t++)
            _mm256_mask_storeu_epi16(y + t * y_stride + first, mask, (__m256i)_mm512_cvtneps_pbh(acc[p][t]));
    }
}

#define BF16_TILE_CASE(NP, NT)                                                                           \
    case NT:                                                                                             \
        tile_avx512(panel, panel_elems, NP, x, x_stride, NT, pairs, y, y_stride, row0, rows);            \
        break;
#define BF16_TILE_SWITCH(NP)                                                                             \
    switch (nt) {                                                                                        \
        BF16_TILE_CASE(NP, 1) BF16_TILE_CASE(NP, 2) BF16_TILE_CASE(NP, 3) BF16_TILE_CASE(NP, 4)          \
        BF16_TILE_CASE(NP, 5) BF16_TILE_CASE(NP, 6) BF16_TILE_CASE(NP, 7) BF16_TILE_CASE(NP, 8)          \
    }

static void tile_bf16(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                      int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const uint16_t *x = xv, *panel = panel_v;
    uint16_t *y = y_v;
    if (np == 4) {
        BF16_TILE_SWITCH(4)
    } else if (np == 2) {
        BF16_TILE_SWITCH(2)
    } else {
        BF16_TILE_SWITCH(1)
    }
}
#undef BF16_TILE_SWITCH
#undef BF16_TILE_CASE
#pragma GCC pop_options
