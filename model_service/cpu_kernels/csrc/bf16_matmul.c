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
 *   half float32's bytes, which is what a decode step's time is. From
 *   BF16_AVX2_WIDEN_MIN_TOKENS tokens on, a group of panels is widened once a block of
 *   tokens instead, the same products in the same order;
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
/* From this many tokens the AVX2 level widens each group of panels to float32 once a block
 * of tokens (widen_avx2, into a thread's scratch) and runs float32's tile over them: the
 * tile that widens as it goes spends a shift and a mask a line and its registers on every
 * tile of three tokens, and ran a prompt's products at two thirds of float32's pace
 * (docs/benchmark-log.md, "bfloat16 at AVX2: panels widened once a block"). Below it,
 * reading bfloat16, half float32's bytes, is what a decode step's time is. */
#define BF16_AVX2_WIDEN_MIN_TOKENS 16
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

/* ---- the levels' code: generic/ (portable), x86/ (each x86 level under its own target) ---- */

#include "generic/bf16_matmul_portable.h"
#if CPU_LEVELS_X86
#include "x86/bf16_matmul_avx2.h"
#include "x86/bf16_matmul_avx512_bf16.h"
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
    panel_plan plan = panel_plan_at(&LEVEL_PICK(bf16_levels, level), tokens, sizeof(uint16_t), sizeof(uint16_t), 0);
    const int pairs = cols / 2;
    const int64_t panel_elems = (int64_t)pairs * 2 * BF16_PANEL_ROWS;
    float *scratch = NULL;
#if CPU_LEVELS_X86
    if (plan.tile == tile_avx2 && tokens >= BF16_AVX2_WIDEN_MIN_TOKENS) {
        const panel_plan widened_plan = {tile_avx2_widened, plan.group, plan.token_tile, plan.weight_bytes,
                                         plan.x_bytes, plan.y_bytes, plan.min_parallel_macs, widen_avx2};
        /* without the memory, the tile that widens as it goes: the same bits */
        scratch = malloc((size_t)(num_threads > 1 ? num_threads : 1) *
                         (size_t)panel_scratch_floats(&widened_plan, panel_elems) * sizeof(float));
        if (scratch != NULL) plan = widened_plan;
    }
#endif
    float *widened = NULL;
    if (plan.x_bytes == sizeof(float)) { /* x widened once, exactly: the sums see the same values */
        widened = malloc((size_t)tokens * cols * sizeof(float));
        if (widened == NULL) {
            free(scratch);
            return -2;
        }
        for (int t = 0; t < tokens; t++) {
            const uint16_t *row = (const uint16_t *)x + t * x_stride;
            for (int c = 0; c < cols; c++) widened[(int64_t)t * cols + c] = bf16_to_f32(row[c]);
        }
        x = widened;
        x_stride = cols;
    }
    panel_drive(&plan, panels, panel_elems, pairs, rows, x, x_stride, tokens, y, y_stride, num_threads, scratch);
    free(widened);
    free(scratch);
    return 0;
}
