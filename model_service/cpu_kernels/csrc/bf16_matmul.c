/* y = x W^T for bfloat16 activations and weights, float32 sums, the weights held in
 * panels of 16 rows: the linears of a bfloat16 model on CPU.
 *
 * Why not oneDNN's: at a decode step's few tokens a product reads each weight once and
 * does little with it, so its time is the weights' bytes over the memory's bandwidth plus
 * the call's own cost. oneDNN's packed product read SmolLM2's 120 layer weights at 27-35
 * GB/s in a step of one token, this kernel at 38-41 (BENCHMARKS.md, "A bfloat16 decode
 * stack"), and oneDNN cannot run inside decode_stack.c's one call a step.
 *
 * The panel layout (bf16_pack_panels): rows in panels of 16, each panel [cols / 2][16][2],
 * so one 64-byte line holds a pair of columns of 16 rows. At the AVX-512 level a line is
 * one vector; `dpbf16ps` multiplies it by a token's pair of columns (broadcast) and adds
 * both products into the 16 rows' float32 sums: no reduction across lanes afterwards. A
 * tile is up to four panels times up to eight tokens, a sum in a register each, so each
 * line loaded serves every token of the tile.
 *
 * Every sum runs over the column pairs in order, in one register lane, whatever the tile:
 * a token's result is the same bits at any batch size and in any tile (tests hold the
 * kernel to it), which is what lets decode_stack.c and the per-layer path share it.
 *
 * Three levels (bf16_levels, cpu_levels.h's scheme), each built with `#pragma GCC target`
 * whatever -march says, as quant_matmul.c's levels are, so one library serves every level
 * the CPU has:
 * - portable C, written on the same 32-bit words as the AVX2 level (a weight is its word
 *   shifted left 16, or masked to its top half: integer operations every vector unit
 *   has), which the compiler vectorizes where it can: what a CPU with neither level runs;
 * - AVX2 with FMA (x86-64 since 2013-2015, no bfloat16 arithmetic): a line is two 256-bit
 *   loads of eight rows' words, widened to float32 by that shift and that mask in
 *   registers, and two FMAs a token into float32 sums. The weights are read as bfloat16,
 *   half float32's bytes, which is what a decode step's time is;
 * - AVX-512 BF16 (`dpbf16ps`).
 * The levels' results differ in the last bits (dpbf16ps rounds its own way; the others add
 * a pair's two products one FMA at a time).
 */
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"
#include "panel_driver.h"
#if CPU_LEVELS_X86
/* Outside the levels' target pragmas: each intrinsic keeps its own instruction set. */
#include <immintrin.h>
#endif

#define BF16_PANEL_ROWS PANEL_ROWS
#define BF16_TOKEN_TILE 8
/* The AVX2 level's tiles: sixteen 256-bit registers hold 2 x 2 x 3 sums, the widened
 * half-line and a token's two columns broadcast (four panels for one token: 8 sums). */
#define BF16_AVX2_TOKEN_TILE 3
/* Column pairs ahead that a tile asks the next lines of its panels for (2 KB): with the
 * hardware's prefetch alone, a step's 120 SmolLM2 linears at 8 tokens took 1.3x as long
 * (9.1 against 6.8 ms; 16 pairs ahead 7.3, 64 7.0). */
#define BF16_PREFETCH 32

enum { BLEVEL_PORTABLE = 0, BLEVEL_AVX2 = 1, BLEVEL_AVX512_BF16 = 2 };

/* Rearranges w [rows, cols] (row stride w_stride, in elements) into panels
 * [ceil(rows / 16)][cols / 2][16][2]; the last panel's missing rows are zeros. cols must
 * be even. Returns 0, or -1 for odd cols. */
int bf16_pack_panels(const uint16_t *w, int64_t w_stride, int rows, int cols, uint16_t *panels) {
    if (cols % 2 != 0 || rows <= 0 || cols <= 0) return -1;
    const int num_panels = (rows + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS, pairs = cols / 2;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < num_panels; p++) {
        uint16_t *panel = panels + (int64_t)p * pairs * 2 * BF16_PANEL_ROWS;
        for (int r = 0; r < BF16_PANEL_ROWS; r++) {
            const int row = p * BF16_PANEL_ROWS + r;
            for (int k = 0; k < pairs; k++) {
                uint16_t *dst = panel + ((int64_t)k * BF16_PANEL_ROWS + r) * 2;
                if (row < rows) {
                    dst[0] = w[row * w_stride + 2 * k];
                    dst[1] = w[row * w_stride + 2 * k + 1];
                } else {
                    dst[0] = dst[1] = 0;
                }
            }
        }
    }
    return 0;
}

/* ---- portable ---- */

static inline float word_low(uint32_t word) { /* the even column's weight: its word's low half */
    const uint32_t bits = word << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float word_high(uint32_t word) { /* the odd column's: the top half */
    const uint32_t bits = word & 0xffff0000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void tile_portable(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                          int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const uint16_t *x = xv, *panel = panel_v;
    uint16_t *y = y_v;
    for (int p = 0; p < np; p++) {
        const uint16_t *w = panel + p * panel_elems;
        for (int t = 0; t < nt; t++) {
            const uint16_t *xt = x + t * x_stride;
            float acc[BF16_PANEL_ROWS] = {0};
            for (int k = 0; k < pairs; k++) {
                const float x0 = bf16_to_f32(xt[2 * k]), x1 = bf16_to_f32(xt[2 * k + 1]);
                uint32_t words[BF16_PANEL_ROWS];
                memcpy(words, w + (int64_t)k * 2 * BF16_PANEL_ROWS, sizeof words);
                /* two separate adds a pair, in the AVX2 level's order */
                for (int r = 0; r < BF16_PANEL_ROWS; r++) acc[r] += word_low(words[r]) * x0;
                for (int r = 0; r < BF16_PANEL_ROWS; r++) acc[r] += word_high(words[r]) * x1;
            }
            const int first = row0 + p * BF16_PANEL_ROWS;
            for (int r = 0; r < BF16_PANEL_ROWS && first + r < rows; r++)
                y[t * y_stride + first + r] = f32_to_bf16(acc[r]);
        }
    }
}

/* ---- AVX2 ---- */

#if CPU_LEVELS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")

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
    for (int p = 0; p < NP; p++)
        for (int t = 0; t < NT; t++) acc[p][0][t] = acc[p][1][t] = _mm256_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + BF16_PREFETCH) * 2 * BF16_PANEL_ROWS),
                         _MM_HINT_T0);
        for (int p = 0; p < NP; p++) {
            const uint16_t *line = panel + p * panel_elems + (int64_t)k * 2 * BF16_PANEL_ROWS;
            for (int h = 0; h < 2; h++) {
                const __m256i words = _mm256_loadu_si256((const __m256i *)(line + 16 * h));
                const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
                const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(words, high));
                for (int t = 0; t < NT; t++) {
                    const float *xt = x + t * x_stride + 2 * k;
                    acc[p][h][t] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(xt), acc[p][h][t]);
                    acc[p][h][t] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(xt + 1), acc[p][h][t]);
                }
            }
        }
    }
    for (int p = 0; p < NP; p++) {
        const int first = row0 + p * BF16_PANEL_ROWS, valid = rows - first;
        for (int t = 0; t < NT; t++) {
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

#define BF16_AVX2_CASE(NP, NT)                                                                           \
    case NT:                                                                                             \
        tile_avx2_n(panel, panel_elems, NP, x, x_stride, NT, pairs, y, y_stride, row0, rows);            \
        break;

static void tile_avx2(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                      int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv;
    const uint16_t *panel = panel_v;
    uint16_t *y = y_v;
    if (np == 4) {
        switch (nt) { BF16_AVX2_CASE(4, 1) }
    } else if (np == 2) {
        switch (nt) { BF16_AVX2_CASE(2, 1) BF16_AVX2_CASE(2, 2) BF16_AVX2_CASE(2, 3) }
    } else {
        switch (nt) { BF16_AVX2_CASE(1, 1) BF16_AVX2_CASE(1, 2) BF16_AVX2_CASE(1, 3) }
    }
}
#undef BF16_AVX2_CASE
#pragma GCC pop_options
#endif

/* ---- AVX-512 BF16 ---- */

#if CPU_LEVELS_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

/* NP panels (panel_elems apart) times NT tokens; NP and NT are constants where it is
 * inlined, so the NP x NT sums stay in registers. */
static inline __attribute__((always_inline)) void tile_avx512(const uint16_t *panel, int64_t panel_elems,
                                                              const int NP, const uint16_t *x, int64_t x_stride,
                                                              const int NT, int pairs, uint16_t *y,
                                                              int64_t y_stride, int row0, int rows) {
    __m512 acc[4][BF16_TOKEN_TILE];
    for (int p = 0; p < NP; p++)
        for (int t = 0; t < NT; t++) acc[p][t] = _mm512_setzero_ps();
    for (int k = 0; k < pairs; k++) {
        __m512bh lines[4];
        for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + BF16_PREFETCH) * 2 * BF16_PANEL_ROWS),
                         _MM_HINT_T0);
        for (int p = 0; p < NP; p++)
            lines[p] = (__m512bh)_mm512_loadu_si512(panel + p * panel_elems + (int64_t)k * 2 * BF16_PANEL_ROWS);
        for (int t = 0; t < NT; t++) {
            int32_t pair;
            memcpy(&pair, x + t * x_stride + 2 * k, sizeof pair);
            const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
            for (int p = 0; p < NP; p++) acc[p][t] = _mm512_dpbf16_ps(acc[p][t], lines[p], xs);
        }
    }
    for (int p = 0; p < NP; p++) {
        const int first = row0 + p * BF16_PANEL_ROWS, valid = rows - first;
        const __mmask16 mask = valid >= BF16_PANEL_ROWS ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
        for (int t = 0; t < NT; t++)
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
#endif

/* Each level's tile, as panel_driver.h plans it: the AVX2 level takes float32 x (widened
 * once a call, below) and tiles of fewer tokens. */
static const panel_level bf16_levels[] = {
    [BLEVEL_PORTABLE] = {tile_portable, 2, 4, 2, BF16_TOKEN_TILE, sizeof(uint16_t)},
#if CPU_LEVELS_X86
    [BLEVEL_AVX2] = {tile_avx2, 1, 4, 2, BF16_AVX2_TOKEN_TILE, sizeof(float)},
    [BLEVEL_AVX512_BF16] = {tile_bf16, 2, 4, 2, BF16_TOKEN_TILE, sizeof(uint16_t)},
#endif
};
static const cpu_check_fn bf16_checks[] = {0, X86_LEVEL(cpu_avx2_fma), X86_LEVEL(cpu_avx512_bf16)};

/* The highest level this CPU runs (BLEVEL_*). */
int bf16_cpu_level(void) { return best_level(bf16_checks); }

/* x: [tokens, cols] bfloat16, rows x_stride apart; panels: bf16_pack_panels' of a
 * [rows, cols] weight; y: [tokens, rows] bfloat16, y_stride apart. panel_driver.h splits
 * the work; the AVX2 level takes float32 x (widened here once) and tiles of fewer tokens.
 * Returns 0, -1 for a shape it does not take (odd cols, a level this CPU lacks), -2
 * without memory for the AVX2 level's float32 copy of x. */
int bf16_linear(const void *x, int64_t x_stride, int tokens, int cols, int rows, const void *panels, void *y,
                int64_t y_stride, int level, int num_threads) {
    if (cols % 2 != 0 || tokens < 0 || rows <= 0 || level < 0 || level > bf16_cpu_level()) return -1;
    if (tokens == 0) return 0;
    const panel_plan plan =
        panel_plan_at(&LEVEL_PICK(bf16_levels, level), tokens, sizeof(uint16_t), sizeof(uint16_t), 0);
    const int pairs = cols / 2;
    float *widened = NULL;
    if (plan.x_bytes == sizeof(float)) { /* x widened once, exactly: the sums see the same values */
        widened = malloc((size_t)tokens * cols * sizeof(float));
        if (widened == NULL) return -2;
        for (int t = 0; t < tokens; t++) {
            const uint16_t *row = (const uint16_t *)x + t * x_stride;
            for (int c = 0; c < cols; c++) widened[(int64_t)t * cols + c] = bf16_to_f32(row[c]);
        }
        x = widened;
        x_stride = cols;
    }
    panel_drive(&plan, panels, (int64_t)pairs * 2 * BF16_PANEL_ROWS, pairs, rows, x, x_stride, tokens, y, y_stride,
                num_threads);
    free(widened);
    return 0;
}
