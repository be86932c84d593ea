/* LoRA's segmented product for float32 rows (models/lora_delta.py, which stays the
 * reference and the fallback): for one run of rows of one adapter,
 *     out[row, o] += sum_j (scaling * sum_k x[row, k] * a[j, k]) * b[o, j],
 * the shrink (x · Aᵀ, rank values a row, kept on the stack) and the expand (· Bᵀ, added in
 * place) in one call, instead of torch's two matmuls, a scale and an add with their
 * temporaries. a is [rank, in_f] and b [out_f, rank], both contiguous (peft's layouts). The
 * shrink is dot products over a's rows, at the SIMD levels eight or sixteen rows at a time
 * over each loaded piece of x (independent sums, reduced together). The expand, for a run
 * of LORA_TRANSPOSE_ROWS rows or more, runs over a copy of b transposed once a call
 * ([rank, out_f]): each shrunk value
 * scales one of its rows into the output row, whole vectors of outputs at a time, where dot
 * products over b's rows are `rank` long (often a single vector) and each ends in a
 * horizontal sum. A shorter run (a decode step's few rows of one adapter) takes the dot
 * products, the copy costing more than it saves, and at the SIMD levels reduces eight or
 * sixteen outputs' registers together rather than each alone. A run of LORA_PANEL_ROWS
 * rows or more (a prefill chunk's) at the AVX2 level or above goes through f32_matmul.c's
 * panels instead, both factors packed once a call: its register tiles reuse each loaded
 * factor across tokens, where the row-at-a-time loops reload them for every row. The delta
 * is then scaled and added: x · Aᵀ · Bᵀ rounds differently from the other two ways, to
 * float32 rounding.
 *
 * Levels (lora_sgmv.py's LEVELS; cpu_levels.h's scheme): portable, a value at a time; AVX2,
 * eight lanes with FMA; AVX-512F, sixteen. The lanes sum in another order, so the levels
 * agree to float32 rounding, not to the bit.
 *
 * lora_group takes the short runs of one adapter in a step together (lora_runs.c hands
 * them over), at AVX2 and AVX-512F: b transposed once for all of their rows, each row's
 * delta the bits the dot-product path gives it (x86/lora_group_avx512.h, lora_group_avx2.h). */
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "lora_sgmv.h"
#include "pagedkv_kernels.h"
#include "panel_driver.h"

typedef void (*axpy_fn)(float alpha, const float *x, float *y, int n); /* y += alpha * x */
/* shrunk[j] = scaling * sum_k x[k] * a[j, k] for j < rank (the shrink). */
typedef void (*shrink_fn)(const float *x, const float *a, int rank, int in_f, float scaling, float *shrunk);
/* out[o] += sum_j s[j] * b[o, j] for o < out_f (the expand's dot products). */
typedef void (*expand_fn)(const float *s, int rank, const float *b, int out_f, float *out);

#include "generic/lora_sgmv_portable.h"

#if CPU_LEVELS_X86
/* Outside the levels' target pragmas: each intrinsic keeps its own instruction set. */
#include <immintrin.h>
#include "x86/lora_sgmv_avx2.h"
#include "x86/lora_sgmv_avx512.h"
#include "x86/lora_group_f32_avx2.h"
#include "x86/lora_group_f32_avx512.h"
#endif

static const axpy_fn lora_axpy_levels[] = {
    [LORA_PORTABLE] = axpy_portable,
    [LORA_AVX2] = X86_LEVEL(axpy_avx2),
    [LORA_AVX512] = X86_LEVEL(axpy_avx512),
};
static const shrink_fn lora_shrink_levels[] = {
    [LORA_PORTABLE] = shrink_portable,
    [LORA_AVX2] = X86_LEVEL(shrink_avx2),
    [LORA_AVX512] = X86_LEVEL(shrink_avx512),
};
static const expand_fn lora_expand_levels[] = {
    [LORA_PORTABLE] = expand_portable,
    [LORA_AVX2] = X86_LEVEL(expand_avx2),
    [LORA_AVX512] = X86_LEVEL(expand_avx512),
};
/* The grouped rows (lora_group) at each level; 0: none (the rows go run by run). */
typedef void (*group_fn)(const float *x, int64_t x_stride, const int *rows, int count, int in_f, const float *a,
                         int rank, const float *b, int out_f, float scaling, float *out, int64_t out_stride,
                         float *scratch);
static const group_fn lora_group_levels[] = {
    [LORA_PORTABLE] = 0,
    [LORA_AVX2] = X86_LEVEL(f32_group_avx2),
    [LORA_AVX512] = X86_LEVEL(f32_group_avx512),
};
static const cpu_check_fn lora_checks[] = {0, X86_LEVEL(cpu_avx2_fma), X86_LEVEL(cpu_avx512f)};

/* The highest level this CPU runs. */
int lora_best_level(void) { return best_level(lora_checks); }

int lora_check(int rank, int level) {
    if (rank < 1 || rank > LORA_MAX_RANK) return 1;
    if (level < LORA_PORTABLE || level > lora_best_level()) return 2;
    return 0;
}

static int64_t panel_floats(int rows, int cols) { return (int64_t)(rows + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS * cols; }

int lora_panel_delta(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                     const float *b, int out_f, float *delta, int level, int num_threads) {
    const int64_t a_n = panel_floats(rank, in_f), b_n = panel_floats(out_f, rank);
    float *scratch = malloc((size_t)(a_n + b_n + (int64_t)rows * rank) * sizeof(float));
    if (scratch == NULL) return 3;
    float *a_panels = scratch, *b_panels = a_panels + a_n, *shrunk = b_panels + b_n;
    int status = f32_pack_panels(a, in_f, rank, in_f, a_panels) || f32_pack_panels(b, rank, out_f, rank, b_panels) ||
                 f32_linear(x, x_row_stride, rows, in_f, rank, a_panels, shrunk, rank, level, num_threads) ||
                 f32_linear(shrunk, rank, rows, rank, out_f, b_panels, delta, out_f, level, num_threads);
    free(scratch);
    return status == 0 ? 0 : 2;
}

/* A long run through the panels: out += scaling * delta. */
static int through_panels(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                          const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level,
                          axpy_fn axpy, int num_threads) {
    float *delta = malloc((size_t)rows * out_f * sizeof(float));
    if (delta == NULL) return 3;
    const int status = lora_panel_delta(x, x_row_stride, rows, in_f, a, rank, b, out_f, delta, level, num_threads);
    if (status == 0 && lora_parallel(rows, 1, out_f, 0, num_threads)) {
#pragma omp parallel for num_threads(num_threads)
        for (int row = 0; row < rows; row++)
            axpy(scaling, delta + (int64_t)row * out_f, out + (int64_t)row * out_row_stride, out_f);
    } else if (status == 0) {
        for (int row = 0; row < rows; row++)
            axpy(scaling, delta + (int64_t)row * out_f, out + (int64_t)row * out_row_stride, out_f);
    }
    free(delta);
    return status;
}

/* One row's shrink and expand (over b_t, b transposed, where the caller made one). */
static inline void one_row(const float *x_row, const float *a, int rank, int in_f, const float *b, const float *b_t,
                           int out_f, float scaling, float *out_row, shrink_fn shrink, expand_fn expand, axpy_fn axpy) {
    float shrunk[LORA_MAX_RANK];
    shrink(x_row, a, rank, in_f, scaling, shrunk);
    if (b_t != NULL)
        for (int j = 0; j < rank; j++) axpy(shrunk[j], b_t + (int64_t)j * out_f, out_row, out_f);
    else
        expand(shrunk, rank, b, out_f, out_row);
}

/* Returns 0, or 1 for a rank outside 1..LORA_MAX_RANK, 2 for a level above lora_best_level,
 * 3 without memory for b's transposed copy. */
int lora_shrink_expand(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                       const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level,
                       int num_threads) {
    const int refused = lora_check(rank, level);
    if (refused != 0) return refused;
    const axpy_fn axpy = LEVEL_PICK(lora_axpy_levels, level);
    const expand_fn expand = LEVEL_PICK(lora_expand_levels, level);
    const shrink_fn shrink = LEVEL_PICK(lora_shrink_levels, level);
    if (rows >= LORA_PANEL_ROWS && level >= LORA_AVX2) return through_panels(x, x_row_stride, rows, in_f, a, rank, b,
                                                                            out_f, scaling, out, out_row_stride,
                                                                            level, axpy, num_threads);
    float *b_t = NULL;
    if (rows >= LORA_TRANSPOSE_ROWS) {
        b_t = malloc((size_t)rank * out_f * sizeof(float));
        if (b_t == NULL) return 3;
        for (int o = 0; o < out_f; o++)
            for (int j = 0; j < rank; j++) b_t[(int64_t)j * out_f + o] = b[(int64_t)o * rank + j];
    }
    if (lora_parallel(rows, rank, in_f, out_f, num_threads)) {
#pragma omp parallel for num_threads(num_threads)
        for (int row = 0; row < rows; row++)
            one_row(x + (int64_t)row * x_row_stride, a, rank, in_f, b, b_t, out_f, scaling,
                    out + (int64_t)row * out_row_stride, shrink, expand, axpy);
    } else {
        for (int row = 0; row < rows; row++)
            one_row(x + (int64_t)row * x_row_stride, a, rank, in_f, b, b_t, out_f, scaling,
                    out + (int64_t)row * out_row_stride, shrink, expand, axpy);
    }
    free(b_t);
    return 0;
}

int lora_group(const float *x, int64_t x_row_stride, const int *rows, int count, int in_f, const float *a, int rank,
               const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level) {
    const int lanes = lora_group_lanes(level);
    if (lora_check(rank, level) != 0 || lanes == 0 || rank % lanes != 0) return -1;
    const group_fn group = LEVEL_PICK(lora_group_levels, level);
    if (group == 0) return -1;
    float *scratch = malloc((size_t)rank * out_f * sizeof(float));
    if (scratch == NULL) return 3;
    group(x, x_row_stride, rows, count, in_f, a, rank, b, out_f, scaling, out, out_row_stride, scratch);
    free(scratch);
    return 0;
}
