/* f32_matmul.c's AVX-512F level (included by it on x86; its header comment says how the
 * level works): tile_avx512. */

#pragma GCC push_options
#pragma GCC target("avx512f")

static inline __attribute__((always_inline)) void tile_avx512_n(const float *panel, int64_t panel_elems,
                                                                const int NP, const float *x, int64_t x_stride,
                                                                const int NT, int cols, float *y, int64_t y_stride,
                                                                int row0, int rows) {
    __m512 acc[4][F32_AVX512_TOKEN_TILE];
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) acc[p][t] = _mm512_setzero_ps();
    for (int k = 0; k < cols; k++) {
        __m512 lines[4];
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + F32_PREFETCH) * PANEL_ROWS),
                         _MM_HINT_T0);
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            lines[p] = _mm512_loadu_ps(panel + p * panel_elems + (int64_t)k * PANEL_ROWS);
        PANEL_UNROLL for (int t = 0; t < NT; t++) {
            const __m512 xs = _mm512_set1_ps(x[t * x_stride + k]);
            PANEL_UNROLL for (int p = 0; p < NP; p++) acc[p][t] = _mm512_fmadd_ps(lines[p], xs, acc[p][t]);
        }
    }
    PANEL_UNROLL for (int p = 0; p < NP; p++) {
        const int first = row0 + p * PANEL_ROWS, valid = rows - first;
        const __mmask16 mask = valid >= PANEL_ROWS ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
        PANEL_UNROLL for (int t = 0; t < NT; t++) _mm512_mask_storeu_ps(y + t * y_stride + first, mask, acc[p][t]);
    }
}

#define F32_AVX512_CASE(NP, NT)                                                                         \
    case NT:                                                                                            \
        tile_avx512_n(panel, panel_elems, NP, x, x_stride, NT, cols, y, y_stride, row0, rows);          \
        break;
#define F32_AVX512_SWITCH(NP)                                                                           \
    switch (nt) {                                                                                       \
        F32_AVX512_CASE(NP, 1) F32_AVX512_CASE(NP, 2) F32_AVX512_CASE(NP, 3) F32_AVX512_CASE(NP, 4)     \
        F32_AVX512_CASE(NP, 5) F32_AVX512_CASE(NP, 6)                                                   \
    }

static void tile_avx512(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride, int nt,
                        int cols, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv, *panel = panel_v;
    float *y = y_v;
    if (np == 4) {
        F32_AVX512_SWITCH(4)
    } else if (np == 2) {
        F32_AVX512_SWITCH(2)
    } else {
        F32_AVX512_SWITCH(1)
    }
}
#undef F32_AVX512_SWITCH
#undef F32_AVX512_CASE
#pragma GCC pop_options
