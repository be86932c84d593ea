/* LoRA's segmented product for bfloat16 rows (a bfloat16 model's activations, its adapters'
 * factors held in bfloat16 too: lora/peft_adapter.py loads them in the model's dtype): for
 * one run of rows of one adapter,
 *     out[row, o] = bf16(out[row, o] + sum_j (scaling * sum_k x[row, k] * a[j, k]) * b[o, j]),
 * every product and sum in float32 (the factors and x widened in registers, exactly) and the
 * delta rounded once, where it is added. torch's bfloat16 reference (models/lora_delta.py)
 * rounds the shrunk values and the scaled ones to bfloat16 besides, so the two agree to
 * bfloat16 rounding of the delta, not to the bit.
 *
 * The three paths are lora_sgmv.c's, by the run's rows: dot products for a few rows (the
 * shrink's over a's rows, sixteen or eight rows at a time over each widened piece of x
 * where the level can; the expand's over b's rows, `rank` long, reduced sixteen or eight
 * outputs at a time); from LORA_TRANSPOSE_ROWS, b widened and transposed once a call
 * ([rank, out_f] float32) and each output vector summed in registers over the rank; from
 * LORA_PANEL_ROWS at AVX2 and above, the run and both factors widened to float32 and
 * multiplied through f32_matmul.c's panels (lora_panel_delta), the delta then added.
 *
 * Levels (lora_sgmv.py's LEVELS, the float32 kernel's): portable, GCC's vector extension
 * (no intrinsics; the compiler lowers it to what -march gives); AVX2 with FMA, eight lanes,
 * a bfloat16 widened by a 16-bit shift; AVX-512F, sixteen.
 *
 * lora_group_bf16 takes the short runs of one adapter in a step together (lora_runs.c
 * hands them over), at AVX2 and AVX-512F: the factors widened once for all of their rows,
 * each row's delta the bits the dot-product path gives it (x86/lora_group_avx512.h,
 * lora_group_avx2.h). */
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "lora_sgmv.h"
#include "pagedkv_kernels.h"
#include "panel_driver.h"

/* shrunk[j] = scaling * sum_k x[k] * a[j, k] for j < rank (the shrink). */
typedef void (*bf16_shrink_fn)(const uint16_t *x, const uint16_t *a, int rank, int in_f, float scaling, float *shrunk);
/* out[o] = bf16(out[o] + sum_j s[j] * b[o, j]) for o < out_f, b [out_f, rank] bfloat16. */
typedef void (*bf16_expand_fn)(const float *s, int rank, const uint16_t *b, int out_f, uint16_t *out);
/* The same over b_t [rank, out_f] float32 (b transposed). */
typedef void (*bf16_expand_t_fn)(const float *s, int rank, const float *b_t, int out_f, uint16_t *out);
/* out[i] = bf16(out[i] + alpha * delta[i]). */
typedef void (*bf16_add_fn)(float alpha, const float *delta, uint16_t *out, int n);

/* `rows` rows of `cols` bfloat16 values, `src_stride` apart, into dst as float32 (exact);
 * the panels' copies and the grouped rows' factors (x86/lora_group_bf16_*.h). */
static void widen(const uint16_t *src, int64_t src_stride, int rows, int cols, float *dst) {
    for (int r = 0; r < rows; r++) load_row(dst + (int64_t)r * cols, src, r * src_stride, cols, DTYPE_BF16);
}

#include "generic/lora_bf16_portable.h"

#if CPU_LEVELS_X86
/* Outside the levels' target pragmas: each intrinsic keeps its own instruction set. */
#include <immintrin.h>
#include "x86/lora_bf16_avx2.h"
#include "x86/lora_bf16_avx512.h"
#include "x86/lora_group_bf16_avx2.h"
#include "x86/lora_group_bf16_avx512.h"
#endif

static const bf16_shrink_fn shrink_levels[] = {
    [LORA_PORTABLE] = bf16_shrink_portable,
    [LORA_AVX2] = X86_LEVEL(bf16_shrink_avx2),
    [LORA_AVX512] = X86_LEVEL(bf16_shrink_avx512),
};
static const bf16_expand_fn expand_levels[] = {
    [LORA_PORTABLE] = bf16_expand_portable,
    [LORA_AVX2] = X86_LEVEL(bf16_expand_avx2),
    [LORA_AVX512] = X86_LEVEL(bf16_expand_avx512),
};
static const bf16_expand_t_fn expand_t_levels[] = {
    [LORA_PORTABLE] = bf16_expand_t_portable,
    [LORA_AVX2] = X86_LEVEL(bf16_expand_t_avx2),
    [LORA_AVX512] = X86_LEVEL(bf16_expand_t_avx512),
};
static const bf16_add_fn add_levels[] = {
    [LORA_PORTABLE] = bf16_add_portable,
    [LORA_AVX2] = X86_LEVEL(bf16_add_avx2),
    [LORA_AVX512] = X86_LEVEL(bf16_add_avx512),
};

/* The grouped rows (lora_group_bf16) at each level; 0: none (the rows go run by run). */
typedef void (*bf16_group_fn)(const uint16_t *x, int64_t x_stride, const int *rows, int count, int in_f,
                              const uint16_t *a, int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                              int64_t out_stride, float *scratch);
static const bf16_group_fn group_levels[] = {
    [LORA_PORTABLE] = 0,
    [LORA_AVX2] = X86_LEVEL(bf16_group_avx2),
    [LORA_AVX512] = X86_LEVEL(bf16_group_avx512),
};

/* A long run through the panels, on float32 copies of the run and the factors. */
static int through_panels(const uint16_t *x, int64_t x_row_stride, int rows, int in_f, const uint16_t *a, int rank,
                          const uint16_t *b, int out_f, float scaling, uint16_t *out, int64_t out_row_stride,
                          int level, bf16_add_fn add, int num_threads) {
    const int64_t x_n = (int64_t)rows * in_f, a_n = (int64_t)rank * in_f, b_n = (int64_t)out_f * rank;
    float *scratch = malloc((size_t)(x_n + a_n + b_n + (int64_t)rows * out_f) * sizeof(float));
    if (scratch == NULL) return 3;
    float *x_f = scratch, *a_f = x_f + x_n, *b_f = a_f + a_n, *delta = b_f + b_n;
    widen(x, x_row_stride, rows, in_f, x_f);
    widen(a, in_f, rank, in_f, a_f);
    widen(b, rank, out_f, rank, b_f);
    const int status = lora_panel_delta(x_f, in_f, rows, in_f, a_f, rank, b_f, out_f, delta, level, num_threads);
    if (status == 0 && lora_parallel(rows, 1, out_f, 0, num_threads)) {
#pragma omp parallel for num_threads(num_threads)
        for (int row = 0; row < rows; row++)
            add(scaling, delta + (int64_t)row * out_f, out + (int64_t)row * out_row_stride, out_f);
    } else if (status == 0) {
        for (int row = 0; row < rows; row++)
            add(scaling, delta + (int64_t)row * out_f, out + (int64_t)row * out_row_stride, out_f);
    }
    free(scratch);
    return status;
}

/* One row's shrink and expand (over b_t, b widened and transposed, where the caller made one). */
static inline void one_row(const uint16_t *x_row, const uint16_t *a, int rank, int in_f, const uint16_t *b,
                           const float *b_t, int out_f, float scaling, uint16_t *out_row, bf16_shrink_fn shrink,
                           bf16_expand_fn expand, bf16_expand_t_fn expand_t) {
    float shrunk[LORA_MAX_RANK];
    shrink(x_row, a, rank, in_f, scaling, shrunk);
    if (b_t != NULL)
        expand_t(shrunk, rank, b_t, out_f, out_row);
    else
        expand(shrunk, rank, b, out_f, out_row);
}

/* Returns lora_shrink_expand's statuses: 0, 1 for a rank outside 1..LORA_MAX_RANK, 2 for a
 * level above lora_best_level, 3 without scratch memory. */
int lora_shrink_expand_bf16(const uint16_t *x, int64_t x_row_stride, int rows, int in_f, const uint16_t *a,
                            int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                            int64_t out_row_stride, int level, int num_threads) {
    const int refused = lora_check(rank, level);
    if (refused != 0) return refused;
    if (rows >= LORA_PANEL_ROWS && level >= LORA_AVX2)
        return through_panels(x, x_row_stride, rows, in_f, a, rank, b, out_f, scaling, out, out_row_stride, level,
                              LEVEL_PICK(add_levels, level), num_threads);
    const bf16_shrink_fn shrink = LEVEL_PICK(shrink_levels, level);
    const bf16_expand_fn expand = LEVEL_PICK(expand_levels, level);
    const bf16_expand_t_fn expand_t = LEVEL_PICK(expand_t_levels, level);
    float *b_t = NULL;
    if (rows >= LORA_TRANSPOSE_ROWS) {
        b_t = malloc((size_t)rank * out_f * sizeof(float));
        if (b_t == NULL) return 3;
        for (int o = 0; o < out_f; o++)
            for (int j = 0; j < rank; j++) b_t[(int64_t)j * out_f + o] = bf16_to_f32(b[(int64_t)o * rank + j]);
    }
    if (lora_parallel(rows, rank, in_f, out_f, num_threads)) {
#pragma omp parallel for num_threads(num_threads)
        for (int row = 0; row < rows; row++)
            one_row(x + (int64_t)row * x_row_stride, a, rank, in_f, b, b_t, out_f, scaling,
                    out + (int64_t)row * out_row_stride, shrink, expand, expand_t);
    } else {
        for (int row = 0; row < rows; row++)
            one_row(x + (int64_t)row * x_row_stride, a, rank, in_f, b, b_t, out_f, scaling,
                    out + (int64_t)row * out_row_stride, shrink, expand, expand_t);
    }
    free(b_t);
    return 0;
}

int lora_group_bf16(const uint16_t *x, int64_t x_row_stride, const int *rows, int count, int in_f, const uint16_t *a,
                    int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out, int64_t out_row_stride,
                    int level) {
    const int lanes = lora_group_lanes(level);
    if (lora_check(rank, level) != 0 || lanes == 0 || rank % lanes != 0) return -1;
    const bf16_group_fn group = LEVEL_PICK(group_levels, level);
    if (group == 0) return -1;
    float *scratch = malloc((size_t)rank * (in_f + out_f) * sizeof(float));
    if (scratch == NULL) return 3;
    group(x, x_row_stride, rows, count, in_f, a, rank, b, out_f, scaling, out, out_row_stride, scratch);
    free(scratch);
    return 0;
}
