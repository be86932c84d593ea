/* Paged decode attention on the CPU, reading K/V in place from the pool.
 *
 * The torch path gathers every sequence's blocks into a padded copy (as long as the
 * longest sequence) and runs one masked SDPA over it: at W48 on SmolLM2 that was 45 % of a
 * decode step. Here each (sequence, kv head) pair walks its own block table: no copy, no
 * padding, and the group's query heads share each K/V row they read.
 *
 * Layout (docs/architecture.md, "Pool layout"): one layer's K (and V) is [num_blocks, block_size,
 * kv_heads, head_dim], contiguous; q is [num_seqs, q_heads, head_dim] with heads and
 * dims contiguous and rows q_row_stride elements apart; out is contiguous like q.
 * Arithmetic is float32 whatever the storage type (as SDPA accumulates), with the online
 * softmax of flash attention, one block of keys at a time.
 *
 * Built at first use by cpu_kernels.py with the machine's compiler and OpenMP; OpenMP
 * resolves to the libgomp torch has already loaded, so this shares torch's thread pool,
 * and the caller passes torch's thread count (libgomp keeps that count per thread).
 */
#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 64
#define MAX_BLOCK_SIZE 256

#if CPU_LEVELS_X86
#include "x86/paged_decode_avx2.h"
#include "x86/paged_decode_avx512.h"
#endif

/* The levels, as paged_decode.py's LEVELS (cpu_levels.h's scheme): the portable C of
 * attend_one (vectorized by the compiler for whatever -march gives), the AVX2 case, the
 * AVX-512 case, each SIMD case built with its own target and chosen at run time. A level's
 * case that does not take a shape leaves it to the level below (attend_specialized). */
enum { DECODE_PORTABLE = 0, DECODE_AVX2 = 1, DECODE_AVX512 = 2 };

/* Attends one (sequence, kv head) and returns 1 where the level's case covers the shape. */
typedef int (*attend_case_fn)(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                              int first_key, int end_key, int kv_head, int kv_heads, int group, int head_dim,
                              int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                              int64_t out_offset, int64_t q_offset);

static const attend_case_fn decode_cases[] = {
    [DECODE_PORTABLE] = 0, /* attend_one's cases, below */
    [DECODE_AVX2] = X86_LEVEL(attend_avx2_case),
    [DECODE_AVX512] = X86_LEVEL(attend_avx512_case),
};
static const cpu_check_fn decode_checks[] = {0, X86_LEVEL(cpu_avx2_fma_f16c), X86_LEVEL(cpu_avx512f_avx2)};

/* The highest level this CPU runs. */
int paged_decode_best_level(void) { return best_level(decode_checks); }

#include "generic/paged_decode_portable.h"

/* kv_dtype is dtype, or one of the 8-bit types with dtype DTYPE_F32 (q and out). */
static void attend_specialized(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                               int first_key, int end_key, int kv_head, int kv_heads, int group, int head_dim,
                               int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                               int64_t out_offset, int64_t q_offset, int level) {
    /* the level's case, then each below it (the AVX-512 level's shapes its case leaves go to AVX2's) */
    for (int at = level_index(level, (int)(sizeof decode_cases / sizeof decode_cases[0])); at > DECODE_PORTABLE; at--)
        if (decode_cases[at] != 0
            && decode_cases[at](q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, group, head_dim,
                                block_size, scale, dtype, kv_dtype, out_scale, out, out_offset, q_offset))
            return;
    switch (kv_dtype) {
    case DTYPE_F32: switch (head_dim) { HEAD_DIM_CASES(DTYPE_F32, DTYPE_F32) }
    case DTYPE_BF16: switch (head_dim) { HEAD_DIM_CASES(DTYPE_BF16, DTYPE_BF16) }
    case DTYPE_F16: switch (head_dim) { HEAD_DIM_CASES(DTYPE_F16, DTYPE_F16) }
    /* one case for both 8-bit types: load_row_fp8 picks its shift per row */
    default: switch (head_dim) { HEAD_DIM_CASES(DTYPE_F32, kv_dtype) }
    }
}

/* 1 where the AVX-512 case (x86/paged_decode_avx512.h) runs on this CPU, else 0: for the log
 * line and the tests. */
int paged_decode_avx512(void) { return paged_decode_best_level() >= DECODE_AVX512; }

/* Returns 0, or a nonzero code for shapes past the fixed limits (checked by the caller
 * first; kept here so a wrong call cannot write past a stack buffer) or a level above
 * paged_decode_best_level (3).
 * kv_dtype: the pool's type, dtype (q's and out's) or an 8-bit one with dtype float32;
 * the pool then holds K / k_scale and V / v_scale. Both scales fold into scalars the
 * kernel already applies (the score scale, the softmax's 1 / sum): no multiply a value. */
int paged_decode_attention_at(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, int64_t table_row_stride, const int32_t *context_lens,
                              int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size,
                              float scale, int sliding_window, int dtype, void *out, int num_threads,
                              int kv_dtype, float k_scale, float v_scale, int level) {
    if (level < DECODE_PORTABLE || level > paged_decode_best_level()) return 3;
    const int group = q_heads / kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK_SIZE || q_heads % kv_heads)
        return 1;
    const int kv_fp8 = kv_dtype == DTYPE_FP8_E4M3 || kv_dtype == DTYPE_FP8_E5M2;
    if (kv_fp8 ? dtype != DTYPE_F32 : kv_dtype != dtype) return 2;
    const float unit = kv_fp8 ? fp8_unit(kv_dtype) : 1.0f;
    const float score_scale = scale * k_scale * unit, out_scale = v_scale * unit;
    const int items = num_seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int item = 0; item < items; item++) {
        const int seq = item / kv_heads, kv_head = item % kv_heads;
        const int end_key = context_lens[seq];
        int first_key = 0;
        if (sliding_window > 0 && end_key > sliding_window) first_key = end_key - sliding_window;
        const int64_t q_offset = (int64_t)seq * q_row_stride + (int64_t)kv_head * group * head_dim;
        const int64_t out_offset = ((int64_t)seq * q_heads + (int64_t)kv_head * group) * head_dim;
        attend_specialized(q, k_cache, v_cache, block_tables + (int64_t)seq * table_row_stride,
                           first_key, end_key, kv_head, kv_heads, group, head_dim, block_size, score_scale,
                           dtype, kv_dtype, out_scale, out, out_offset, q_offset, level);
    }
    return 0;
}

/* paged_decode_attention_at at the best level this CPU runs (decode_stack.c's call). */
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_row_stride, const int32_t *context_lens,
                           int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size,
                           float scale, int sliding_window, int dtype, void *out, int num_threads,
                           int kv_dtype, float k_scale, float v_scale) {
    return paged_decode_attention_at(q, q_row_stride, k_cache, v_cache, block_tables, table_row_stride, context_lens,
                                     num_seqs, q_heads, kv_heads, head_dim, block_size, scale, sliding_window, dtype,
                                     out, num_threads, kv_dtype, k_scale, v_scale, paged_decode_best_level());
}
