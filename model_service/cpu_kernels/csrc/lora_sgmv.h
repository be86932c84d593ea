/* What lora_sgmv.c (float32 rows) and lora_sgmv_bf16.c (bfloat16 rows) share: the family's
 * levels, the rank ceiling, where a run changes paths, and the panel path's product. Not
 * part of the library's interface (pagedkv_kernels.h is). */
#ifndef PAGEDKV_LORA_SGMV_H
#define PAGEDKV_LORA_SGMV_H

#include <stdint.h>

#include "cpu_math.h"

/* lora_sgmv.py's LEVELS; f32_matmul.c's f32_linear takes the same indices. */
enum { LORA_PORTABLE = 0, LORA_AVX2 = 1, LORA_AVX512 = 2 };
/* The rank ceiling (pagedkv/lora_slots.py's RANK_CEILING): the shrunk row lives on the stack. */
#define LORA_MAX_RANK 512
/* Rows from which the expand runs over b transposed, and from which a run goes through the
 * panels at AVX2 and above (lora_sgmv.c says why). */
#define LORA_TRANSPOSE_ROWS 8
#define LORA_PANEL_ROWS 32

/* Whether a run's rows are shared out between threads: not for one thread, nor below
 * PARALLEL_MIN_ELEMENTS (cpu_math.h). The callers then run a plain loop, not a parallel
 * region with a false `if`: that still sets up a team of one each call (nested, inside
 * decode_stack.c's region over runs), which cost more than a one-row run's products. */
static inline int lora_parallel(int rows, int rank, int in_f, int out_f, int num_threads) {
    return num_threads > 1 && (int64_t)rows * rank * (in_f + out_f) >= PARALLEL_MIN_ELEMENTS;
}

/* 0 where the rank and level are ones the kernels take, else lora_shrink_expand's status. */
int lora_check(int rank, int level);

/* delta [rows, out_f] = (x · Aᵀ) · Bᵀ through f32_matmul.c's panels, both factors packed
 * here: a [rank, in_f] and b [out_f, rank] contiguous float32. Returns 0, 2 where a panel
 * product refuses, 3 without memory. */
int lora_panel_delta(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                     const float *b, int out_f, float *delta, int level, int num_threads);

/* Runs of under LORA_TRANSPOSE_ROWS rows of one adapter, for one target, taken together
 * (lora_runs.c): out[r] += the delta of x[r] for each of the `count` rows listed, the
 * bits lora_shrink_expand (float32) or lora_shrink_expand_bf16 gives each run alone.
 * Returns 0, -1 where this level or rank has no grouped path (the caller goes run by run),
 * 3 without memory. */
/* The grouped paths' ranks are whole numbers of their level's lanes (lora_group_avx2.h and
 * lora_group_avx512.h say why); 0: the level has none (portable). */
static inline int lora_group_lanes(int level) { return level == LORA_AVX512 ? 16 : level == LORA_AVX2 ? 8 : 0; }
int lora_group(const float *x, int64_t x_row_stride, const int *rows, int count, int in_f, const float *a, int rank,
               const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level);
int lora_group_bf16(const uint16_t *x, int64_t x_row_stride, const int *rows, int count, int in_f, const uint16_t *a,
                    int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out, int64_t out_row_stride,
                    int level);

#endif
