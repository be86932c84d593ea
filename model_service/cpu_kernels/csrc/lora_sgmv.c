/* LoRA's segmented product for float32 rows (models/lora_delta.py, which stays the
 * reference and the fallback): for one run of rows of one adapter,
 *     out[row, o] += sum_j (scaling * sum_k x[row, k] * a[j, k]) * b[o, j],
 * the shrink (x · Aᵀ, rank values a row, kept on the stack) and the expand (· Bᵀ, added in
 * place) in one call, instead of torch's two matmuls, a scale and an add with their
 * temporaries. a is [rank, in_f] and b [out_f, rank], both contiguous (peft's layouts). The
 * shrink is dot products over a's rows. The expand, for a run of LORA_TRANSPOSE_ROWS rows or
 * more, runs over a copy of b transposed once a call ([rank, out_f]): each shrunk value
 * scales one of its rows into the output row, whole vectors of outputs at a time, where dot
 * products over b's rows are `rank` long (often a single vector) and each ends in a
 * horizontal sum. A shorter run (a decode step's few rows of one adapter) takes the dot
 * products: the copy would cost more than it saves.
 *
 * Levels (lora_sgmv.py's LEVELS; cpu_levels.h's scheme): portable, a value at a time; AVX2,
 * eight lanes with FMA; AVX-512F, sixteen. The lanes sum in another order, so the levels
 * agree to float32 rounding, not to the bit. */
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"

enum { LORA_PORTABLE = 0, LORA_AVX2 = 1, LORA_AVX512 = 2 };
/* The rank ceiling (pagedkv/lora_slots.py's RANK_CEILING): the shrunk row lives on the stack. */
#define LORA_MAX_RANK 512
/* Rows from which the expand transposes b (see above). */
#define LORA_TRANSPOSE_ROWS 8

typedef float (*dot_fn)(const float *x, const float *y, int n);
typedef void (*axpy_fn)(float alpha, const float *x, float *y, int n); /* y += alpha * x */

#include "generic/lora_sgmv_portable.h"

#if CPU_LEVELS_X86
#include "x86/lora_sgmv_avx2.h"
#include "x86/lora_sgmv_avx512.h"
#endif

static const dot_fn lora_levels[] = {
    [LORA_PORTABLE] = dot_portable,
    [LORA_AVX2] = X86_LEVEL(dot_avx2),
    [LORA_AVX512] = X86_LEVEL(dot_avx512),
};
static const axpy_fn lora_axpy_levels[] = {
    [LORA_PORTABLE] = axpy_portable,
    [LORA_AVX2] = X86_LEVEL(axpy_avx2),
    [LORA_AVX512] = X86_LEVEL(axpy_avx512),
};
static const cpu_check_fn lora_checks[] = {0, X86_LEVEL(cpu_avx2_fma), X86_LEVEL(cpu_avx512f)};

/* The highest level this CPU runs. */
int lora_best_level(void) { return best_level(lora_checks); }

/* Returns 0, or 1 for a rank outside 1..LORA_MAX_RANK, 2 for a level above lora_best_level,
 * 3 without memory for b's transposed copy. */
int lora_shrink_expand(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                       const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level,
                       int num_threads) {
    if (rank < 1 || rank > LORA_MAX_RANK) return 1;
    if (level < LORA_PORTABLE || level > lora_best_level()) return 2;
    const dot_fn dot = LEVEL_PICK(lora_levels, level);
    const axpy_fn axpy = LEVEL_PICK(lora_axpy_levels, level);
    float *b_t = NULL;
    if (rows >= LORA_TRANSPOSE_ROWS) {
        b_t = malloc((size_t)rank * out_f * sizeof(float));
        if (b_t == NULL) return 3;
        for (int o = 0; o < out_f; o++)
            for (int j = 0; j < rank; j++) b_t[(int64_t)j * out_f + o] = b[(int64_t)o * rank + j];
    }
#pragma omp parallel for num_threads(num_threads) if ((int64_t)rows * rank * (in_f + out_f) >= PARALLEL_MIN_ELEMENTS)
    for (int row = 0; row < rows; row++) {
        float shrunk[LORA_MAX_RANK];
        const float *x_row = x + (int64_t)row * x_row_stride;
        for (int j = 0; j < rank; j++) shrunk[j] = scaling * dot(x_row, a + (int64_t)j * in_f, in_f);
        float *out_row = out + (int64_t)row * out_row_stride;
        if (b_t != NULL)
            for (int j = 0; j < rank; j++) axpy(shrunk[j], b_t + (int64_t)j * out_f, out_row, out_f);
        else
            for (int o = 0; o < out_f; o++) out_row[o] += dot(shrunk, b + (int64_t)o * rank, rank);
    }
    free(b_t);
    return 0;
}
