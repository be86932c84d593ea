/* Paged decode attention on the CPU, reading K/V in place from the pool.
 *
 * The torch path gathers every sequence's blocks into a padded copy (as long as the
 * longest sequence) and runs one masked SDPA over it: at W48 on SmolLM2 that was 45 % of a
 * decode step. Here each (sequence, kv head) pair walks its own block table: no copy, no
 * padding, and the group's query heads share each K/V row they read.
 *
 * Layout (README.md, "Pool layout"): one layer's K (and V) is [num_blocks, block_size,
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

#include "paged_decode_avx2.h"
#include "paged_decode_avx512.h"

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

/* One (sequence, kv head): its `group` query heads against its visible keys. Always
 * inlined into attend_specialized's cases, so head_dim and dtype are constants there and
 * the row loops unroll into straight vector code. */
static inline __attribute__((always_inline)) void attend_one(const void *q, const void *k_cache, const void *v_cache,
                       const int32_t *table, int first_key, int end_key, int kv_head, int kv_heads,
                       int group, int head_dim, int block_size, float scale, int dtype, int kv_dtype,
                       float out_scale, void *out, int64_t out_offset, int64_t q_offset) {
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    float kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM];

    for (int g = 0; g < group; g++) {
        load_row(qf[g], q, q_offset + (int64_t)g * head_dim, head_dim, dtype);
        for (int d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.0f; }
        row_max[g] = -INFINITY;
        row_sum[g] = 0.0f;
    }
    if (end_key <= first_key) { /* nothing visible: zeros, not 0/0 */
        for (int g = 0; g < group; g++) store_row(out, out_offset + (int64_t)g * head_dim, acc[g], head_dim, dtype);
        return;
    }
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    for (int block_start = first_key - first_key % block_size; block_start < end_key; block_start += block_size) {
        const int64_t block = table[block_start / block_size];
        const int lo = block_start < first_key ? first_key - block_start : 0;
        const int hi = block_start + block_size > end_key ? end_key - block_start : block_size;
        const int64_t base = (block * block_size) * token_stride + (int64_t)kv_head * head_dim;

        for (int t = lo; t < hi; t++) {
            load_row(kf, k_cache, base + t * token_stride, head_dim, kv_dtype);
            for (int g = 0; g < group; g++) scores[g][t] = dot(qf[g], kf, head_dim);
        }
        for (int g = 0; g < group; g++) {
            float block_max = row_max[g];
            for (int t = lo; t < hi; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float correction = exp_f32(row_max[g] - block_max); /* ~0 on the first block: -inf clamps to -87 */
            row_max[g] = block_max;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = lo; t < hi; t++) {
                const float p = exp_f32(scores[g][t] - block_max);
                scores[g][t] = p;
                sum += p;
            }
            row_sum[g] = row_sum[g] * correction + sum;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;
        }
        for (int t = lo; t < hi; t++) {
            load_row(vf, v_cache, base + t * token_stride, head_dim, kv_dtype);
            for (int g = 0; g < group; g++) {
                const float p = scores[g][t];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = out_scale / row_sum[g];
        for (int d = 0; d < head_dim; d++) acc[g][d] *= inv;
        store_row(out, out_offset + (int64_t)g * head_dim, acc[g], head_dim, dtype);
    }
}

#define ATTEND(HEAD_DIM, DTYPE, KV_DTYPE)                                                        \
    attend_one(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, group, HEAD_DIM, \
               block_size, scale, DTYPE, KV_DTYPE, out_scale, out, out_offset, q_offset)
#define HEAD_DIM_CASES(DTYPE, KV_DTYPE)                        \
    case 32: ATTEND(32, DTYPE, KV_DTYPE); return;              \
    case 64: ATTEND(64, DTYPE, KV_DTYPE); return;              \
    case 80: ATTEND(80, DTYPE, KV_DTYPE); return;              \
    case 96: ATTEND(96, DTYPE, KV_DTYPE); return;              \
    case 128: ATTEND(128, DTYPE, KV_DTYPE); return;            \
    case 256: ATTEND(256, DTYPE, KV_DTYPE); return;            \
    default: ATTEND(head_dim, DTYPE, KV_DTYPE); return;

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

/* 1 where the AVX-512 case (paged_decode_avx512.h) runs on this CPU, else 0: for the log
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
