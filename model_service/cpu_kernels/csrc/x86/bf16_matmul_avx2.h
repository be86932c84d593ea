/* bf16_matmul.c's AVX2 level (included by it on x86; its header comment says how the
 * level works): tile_avx2, and for a prompt's many tokens widen_avx2 with
 * tile_avx2_widened. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "f32_panel_sums_avx2.h"

_Static_assert(BF16_AVX2_TOKEN_TILE == AVX2_F32_TILE_TOKENS, "the widened tile is f32_panel_sums_avx2.h's");

/* Eight float32 sums as bfloat16, rounded to nearest even as f32_to_bf16 (NaN kept a NaN). */
static inline __m128i avx2_to_bf16(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    rounded = _mm256_blendv_epi8(rounded, quiet, nan);
    /* 32-bit lanes to 16: packus within each 128-bit half, then the halves' low quads together */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xd8);
    return _mm256_castsi256_si128(packed);
}

/* A tile's sums (NP panels, two eight-row halves, NT tokens) into y as bfloat16, rows past
 * `rows` left out. */
static inline __attribute__((always_inline)) void store_tile_avx2(__m256 acc[4][2][BF16_AVX2_TOKEN_TILE], const int NP,
                                                                  const int NT, uint16_t *y, int64_t y_stride,
                                                                  int row0, int rows) {
    PANEL_UNROLL for (int p = 0; p < NP; p++) {
        const int first = row0 + p * BF16_PANEL_ROWS, valid = rows - first;
        PANEL_UNROLL for (int t = 0; t < NT; t++) {
            uint16_t *yt = y + t * y_stride + first;
            if (valid >= BF16_PANEL_ROWS) {
                _mm_storeu_si128((__m128i *)yt, avx2_to_bf16(acc[p][0][t]));
                _mm_storeu_si128((__m128i *)(yt + 8), avx2_to_bf16(acc[p][1][t]));
            } else {
                uint16_t out[BF16_PANEL_ROWS];
                _mm_storeu_si128((__m128i *)out, avx2_to_bf16(acc[p][0][t]));
                _mm_storeu_si128((__m128i *)(out + 8), avx2_to_bf16(acc[p][1][t]));
                memcpy(yt, out, (size_t)valid * sizeof out[0]);
            }
        }
    }
}

/* NP panels times NT tokens, 2 * NP * NT sums of eight rows in registers (NP and NT are
 * constants where it is inlined). A line's eight-row half is widened once and serves
 * every token of the tile. x is float32 (bf16_linear widens it once a call): a token's
 * column is then one broadcast load, where a bfloat16 one took a load, a shift, a move
 * and a shuffle, which at many tokens a tile were the level's bottleneck. */
static inline __attribute__((always_inline)) void tile_avx2_n(const uint16_t *panel, int64_t panel_elems,
                                                              const int NP, const float *x, int64_t x_stride,
                                                              const int NT, int pairs, uint16_t *y,
                                                              int64_t y_stride, int row0, int rows) {
    __m256 acc[4][2][BF16_AVX2_TOKEN_TILE];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    PANEL_UNROLL for (int p = 0; p < NP; p++)
        PANEL_UNROLL for (int t = 0; t < NT; t++) acc[p][0][t] = acc[p][1][t] = _mm256_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        PANEL_UNROLL for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + BF16_PREFETCH) * 2 * BF16_PANEL_ROWS),
                         _MM_HINT_T0);
        PANEL_UNROLL for (int p = 0; p < NP; p++) {
            const uint16_t *line = panel + p * panel_elems + (int64_t)k * 2 * BF16_PANEL_ROWS;
            PANEL_UNROLL for (int h = 0; h < 2; h++) {
                const __m256i words = _mm256_loadu_si256((const __m256i *)(line + 16 * h));
                const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
                const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(words, high));
                PANEL_UNROLL for (int t = 0; t < NT; t++) {
                    const float *xt = x + t * x_stride + 2 * k;
                    acc[p][h][t] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xt), acc[p][h][t]);
                    acc[p][h][t] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xt + 1), acc[p][h][t]);
                }
            }
        }
    }
    store_tile_avx2(acc, NP, NT, y, y_stride, row0, rows);
}

#define BF16_AVX2_CASE(NP, NT)                                                                           \
    case NT:                                                                                             \
        tile_avx2_n(panel, panel_elems, NP, x, x_stride, NT, pairs, y, y_stride, row0, rows);            \
        break;

static void tile_avx2(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                      int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv;
    const uint16_t *panel = panel_v;
    uint16_t *y = y_v;
    AVX2_TILE_SWITCH(BF16_AVX2_CASE)
}
#undef BF16_AVX2_CASE

/* np panels widened to float32 panels [cols][16] (panel_widen_fn): tile_avx2_n's shift
 * and mask, done once a block of tokens rather than once a tile of three. */
static void widen_avx2(const void *panels_v, int64_t panel_elems, int np, float *out) {
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    const int64_t pairs = panel_elems / (2 * BF16_PANEL_ROWS);
    for (int p = 0; p < np; p++) {
        const uint16_t *panel = (const uint16_t *)panels_v + p * panel_elems;
        float *dst = out + p * panel_elems;
        for (int64_t k = 0; k < pairs; k++)
            for (int h = 0; h < 2; h++) {
                const __m256i words = _mm256_loadu_si256((const __m256i *)(panel + k * 2 * BF16_PANEL_ROWS + 16 * h));
                _mm256_storeu_ps(dst + 2 * k * BF16_PANEL_ROWS + 8 * h, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
                _mm256_storeu_ps(dst + (2 * k + 1) * BF16_PANEL_ROWS + 8 * h,
                                 _mm256_castsi256_ps(_mm256_and_si256(words, high)));
            }
    }
}

/* tile_avx2_n over widen_avx2's panels: avx2_f32_panel_sums takes each sum's products in
 * the same order (column 2k, then 2k + 1), so a token's result is the same bits either way. */
static inline __attribute__((always_inline)) void tile_avx2_widened_n(const float *panel, int64_t panel_elems,
                                                                      const int NP, const float *x, int64_t x_stride,
                                                                      const int NT, int pairs, uint16_t *y,
                                                                      int64_t y_stride, int row0, int rows) {
    __m256 acc[4][2][AVX2_F32_TILE_TOKENS];
    avx2_f32_panel_sums(panel, panel_elems, NP, x, x_stride, NT, 2 * pairs, acc);
    store_tile_avx2(acc, NP, NT, y, y_stride, row0, rows);
}

#define BF16_AVX2_WIDENED_CASE(NP, NT)                                                                   \
    case NT:                                                                                             \
        tile_avx2_widened_n(panel, panel_elems, NP, x, x_stride, NT, pairs, y, y_stride, row0, rows);    \
        break;

static void tile_avx2_widened(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                              int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv, *panel = panel_v;
    uint16_t *y = y_v;
    AVX2_TILE_SWITCH(BF16_AVX2_WIDENED_CASE)
}
#undef BF16_AVX2_WIDENED_CASE
#pragma GCC pop_options
