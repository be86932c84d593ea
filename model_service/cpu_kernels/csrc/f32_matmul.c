/* y = x W^T in float32, the weights held in panels of 16 rows: the linears of a float32
 * model on CPU, where they run inside decode_stack.c's one call a step.
 *
 * Why not torch's (oneDNN / MKL sgemm): a decode step of a small model is many small
 * products, each a dispatch through torch, and oneDNN cannot run inside the decode stack's
 * one C call. At a step's few tokens a product reads each weight once, so its time is the
 * weights' bytes over the memory's bandwidth; at a few dozen tokens the weights of a small
 * model's layer stay in cache and the tile's FMAs are its time.
 *
 * The panel layout (f32_pack_panels): rows in panels of 16, each panel [cols][16], so one
 * 64-byte line holds one column of 16 rows. panel_driver.h splits the work between threads
 * and into tiles; a tile's sums stay in registers, each line loaded serves every token of
 * the tile, and each sum runs over the columns in order in one lane, so a token's result is
 * the same bits at any batch and in any tile (tests hold the kernel to it).
 *
 * Three levels (f32_levels, cpu_levels.h's scheme), each built with `#pragma GCC target`
 * whatever -march says, as bf16_matmul.c's are, so one library serves every level the CPU
 * has:
 * - portable C, one FMA (fmaf) a product in the same order, which the compiler vectorizes
 *   where it can;
 * - AVX2 with FMA: a line is two 256-bit loads, a token's column one broadcast, two FMAs;
 * - AVX-512F: a line is one 512-bit load, tiles of more tokens (32 registers).
 * All three round the same way (one fused multiply-add a product, in the same order), so
 * their results are the same bits. */
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"
#include "panel_driver.h"
#if CPU_LEVELS_X86
#include <immintrin.h>
#endif

/* Column lines ahead that a tile asks for (2 KB): as bf16_matmul.c's. */
#define F32_PREFETCH 32
#define F32_PORTABLE_TOKEN_TILE 4
#define F32_AVX2_TOKEN_TILE 3 /* 2 panels x 2 halves x 3 tokens = 12 of the 16 registers */
#define F32_AVX512_TOKEN_TILE 6 /* 4 panels x 6 tokens = 24 of the 32 registers */
/* panel_plan's min_parallel_macs: about a hundred microseconds of one core's work */
#define F32_MIN_PARALLEL_MACS (1 << 20)

enum { FLEVEL_PORTABLE = 0, FLEVEL_AVX2 = 1, FLEVEL_AVX512 = 2 };

/* Rearranges w [rows, cols] (row stride w_stride, in elements) into panels
 * [ceil(rows / 16)][cols][16]; the last panel's missing rows are zeros. Returns 0, or -1
 * for an empty shape. */
int f32_pack_panels(const float *w, int64_t w_stride, int rows, int cols, float *panels) {
    if (rows <= 0 || cols <= 0) return -1;
    const int num_panels = (rows + PANEL_ROWS - 1) / PANEL_ROWS;
    /* A small matrix (a LoRA factor, packed at each call of lora_sgmv.c's panel path) on the
     * calling thread: waking the others costs more than the copy. */
#pragma omp parallel for schedule(static) if ((int64_t)rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int p = 0; p < num_panels; p++) {
        float *panel = panels + (int64_t)p * cols * PANEL_ROWS;
        for (int r = 0; r < PANEL_ROWS; r++) {
            const int row = p * PANEL_ROWS + r;
            for (int k = 0; k < cols; k++) panel[(int64_t)k * PANEL_ROWS + r] = row < rows ? w[row * w_stride + k] : 0.0f;
        }
    }
    return 0;
}

static inline void store_rows(float *y, const float *sums, int first, int rows) {
    const int valid = rows - first < PANEL_ROWS ? rows - first : PANEL_ROWS;
    memcpy(y + first, sums, (size_t)valid * sizeof(float));
}

/* ---- the levels' code: generic/ (portable), x86/ (each x86 level under its own target) ---- */

#include "generic/f32_matmul_portable.h"
#if CPU_LEVELS_X86
#include "x86/f32_matmul_avx2.h"
#include "x86/f32_matmul_avx512.h"
#endif

/* Each level's tile, as panel_driver.h plans it. */
static const panel_level f32_levels[] = {
    [FLEVEL_PORTABLE] = {tile_portable, 0, 1, 1, F32_PORTABLE_TOKEN_TILE, sizeof(float)},
#if CPU_LEVELS_X86
    [FLEVEL_AVX2] = {tile_avx2, 1, 4, 2, F32_AVX2_TOKEN_TILE, sizeof(float)},
    [FLEVEL_AVX512] = {tile_avx512, 2, 4, 2, F32_AVX512_TOKEN_TILE, sizeof(float)},
#endif
};
static const cpu_check_fn f32_checks[] = {0, X86_LEVEL(cpu_avx2_fma), X86_LEVEL(cpu_avx512f)};

/* The highest level this CPU runs (FLEVEL_*). */
int f32_cpu_level(void) { return best_level(f32_checks); }

/* x: [tokens, cols] float32, rows x_stride apart; panels: f32_pack_panels' of a [rows,
 * cols] weight; y: [tokens, rows] float32, y_stride apart. Returns 0, or -1 for a shape
 * or level it does not take. */
int f32_linear(const float *x, int64_t x_stride, int tokens, int cols, int rows, const float *panels, float *y,
               int64_t y_stride, int level, int num_threads) {
    if (tokens < 0 || rows <= 0 || cols <= 0 || level < 0 || level > f32_cpu_level()) return -1;
    if (tokens == 0) return 0;
    const panel_plan plan = panel_plan_at(&LEVEL_PICK(f32_levels, level), tokens, sizeof(float), sizeof(float),
                                          F32_MIN_PARALLEL_MACS);
    panel_drive(&plan, panels, (int64_t)cols * PANEL_ROWS, cols, rows, x, x_stride, tokens, y, y_stride,
                num_threads, NULL);
    return 0;
}
