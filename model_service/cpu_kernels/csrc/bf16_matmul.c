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
 * Two levels: portable C (float32 products, what a CPU without AVX-512 BF16 runs) and
 * AVX-512 BF16, built with `#pragma GCC target` whatever -march says, as quant_matmul.c's
 * levels are. The levels' results differ in the last bits (dpbf16ps rounds its own way).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_math.h"

#define BF16_PANEL_ROWS 16
#define BF16_TOKEN_TILE 8
/* Column pairs ahead that a tile asks the next lines of its panels for (2 KB): with the
 * hardware's prefetch alone, a step's 120 SmolLM2 linears at 8 tokens took 1.3x as long
 * (9.1 against 6.8 ms; 16 pairs ahead 7.3, 64 7.0). */
#define BF16_PREFETCH 32
/* Tokens whose x rows a thread keeps near while it walks its panels: the x block (128
 * rows of up to a few thousand columns) stays in L2, the panels stream through once a block. */
#define BF16_TOKEN_BLOCK 128

enum { BLEVEL_PORTABLE = 0, BLEVEL_AVX512_BF16 = 1 };

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

static void tile_portable(const uint16_t *panel, int64_t panel_elems, int np, const uint16_t *x, int64_t x_stride,
                          int nt, int pairs, uint16_t *y, int64_t y_stride, int row0, int rows) {
    for (int p = 0; p < np; p++) {
        const uint16_t *w = panel + p * panel_elems;
        for (int t = 0; t < nt; t++) {
            const uint16_t *xt = x + t * x_stride;
            float acc[BF16_PANEL_ROWS] = {0};
            for (int k = 0; k < pairs; k++) {
                const float x0 = bf16_to_f32(xt[2 * k]), x1 = bf16_to_f32(xt[2 * k + 1]);
                const uint16_t *line = w + (int64_t)k * 2 * BF16_PANEL_ROWS;
                for (int r = 0; r < BF16_PANEL_ROWS; r++)
                    acc[r] += bf16_to_f32(line[2 * r]) * x0 + bf16_to_f32(line[2 * r + 1]) * x1;
            }
            const int first = row0 + p * BF16_PANEL_ROWS;
            for (int r = 0; r < BF16_PANEL_ROWS && first + r < rows; r++)
                y[t * y_stride + first + r] = f32_to_bf16(acc[r]);
        }
    }
}

/* ---- AVX-512 BF16 ---- */

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>

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

static void tile_bf16(const uint16_t *panel, int64_t panel_elems, int np, const uint16_t *x, int64_t x_stride,
                      int nt, int pairs, uint16_t *y, int64_t y_stride, int row0, int rows) {
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

/* The highest level this CPU runs. */
int bf16_best_level(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl"))
        return BLEVEL_AVX512_BF16;
#endif
    return BLEVEL_PORTABLE;
}

typedef void (*tile_fn)(const uint16_t *panel, int64_t panel_elems, int np, const uint16_t *x, int64_t x_stride,
                        int nt, int pairs, uint16_t *y, int64_t y_stride, int row0, int rows);

/* x: [tokens, cols] bfloat16, rows x_stride apart; panels: bf16_pack_panels' of a
 * [rows, cols] weight; y: [tokens, rows] bfloat16, y_stride apart. Threads split the
 * panels; each takes its panels four at a time for one or two tokens (four independent
 * sums keep a load of lines in flight), two at a time otherwise (sixteen sums). Returns 0,
 * or -1 for a shape it does not take (odd cols, a level this CPU lacks). */
int bf16_linear(const void *x, int64_t x_stride, int tokens, int cols, int rows, const void *panels, void *y,
                int64_t y_stride, int level, int num_threads) {
    if (cols % 2 != 0 || tokens < 0 || rows <= 0 || level > bf16_best_level()) return -1;
    if (tokens == 0) return 0;
    tile_fn tile = tile_portable;
#if defined(__x86_64__)
    if (level >= BLEVEL_AVX512_BF16) tile = tile_bf16;
#endif
    const int pairs = cols / 2, num_panels = (rows + BF16_PANEL_ROWS - 1) / BF16_PANEL_ROWS;
    const int64_t panel_elems = (int64_t)pairs * 2 * BF16_PANEL_ROWS;
    const int group = tokens <= 2 ? 4 : 2;
    const int groups = (num_panels + group - 1) / group;
    const uint16_t *xs = x, *ws = panels;
    uint16_t *ys = y;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && groups > 1)
    {
        /* each thread a contiguous run of groups, so its panels stream in order */
        const int workers = omp_get_num_threads(), me = omp_get_thread_num();
        const int g0 = (int)((int64_t)groups * me / workers), g1 = (int)((int64_t)groups * (me + 1) / workers);
        for (int t0 = 0; t0 < tokens; t0 += BF16_TOKEN_BLOCK) {
            const int t_end = t0 + BF16_TOKEN_BLOCK < tokens ? t0 + BF16_TOKEN_BLOCK : tokens;
            for (int g = g0; g < g1; g++) {
                const int p0 = g * group, np = p0 + group <= num_panels ? group : num_panels - p0;
                for (int t = t0; t < t_end; t += BF16_TOKEN_TILE) {
                    const int nt = t + BF16_TOKEN_TILE <= t_end ? BF16_TOKEN_TILE : t_end - t;
                    /* a tail of panels goes one at a time: tile_bf16 has cases for 4, 2 and 1 */
                    for (int p = p0; p < p0 + np;) {
                        const int here = np - (p - p0) >= group ? group : 1;
                        tile(ws + p * panel_elems, panel_elems, here, xs + t * x_stride, x_stride, nt, pairs,
                             ys + t * y_stride, y_stride, p * BF16_PANEL_ROWS, rows);
                        p += here;
                    }
                }
            }
        }
    }
    return 0;
}
