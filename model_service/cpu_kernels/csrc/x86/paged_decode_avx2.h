/* The AVX2 level of paged decode attention (included by paged_decode.c): 8 float32 lanes
 * with FMA, K/V widened in registers (bfloat16 by a shift, float16 by F16C, either 8-bit
 * type widened to float16 bits by integer operations, then F16C; see cpu_math.h). Built
 * with its own target whatever -march says and run only where the CPU has AVX2, FMA and
 * F16C (paged_decode_best_level).
 *
 * Same contract and float32 arithmetic as attend_one, in spans of up to AVX2_SPAN keys as
 * paged_decode_avx512.h does:
 *   1. q.k for the span's keys, 8 keys at a time: their rows widened into a float32
 *      scratch once, then each query head's 8 partial dot products reduced together
 *      (sum_lanes_8);
 *   2. the span's softmax, folded into the running max and sum;
 *   3. p.v, 4 keys at a time per accumulator load and store (16 vector registers hold
 *      no head_dim 64 accumulator row beside its query, so acc lives in L1).
 * Scores are scaled after the dot product, as in the AVX-512 case. */
#include <immintrin.h>

#define AVX2_SPAN 128 /* keys scored before their softmax */
#define AVX2_MAX_HEADS 8 /* query heads a pass */
#define AVX2_KEYS 8 /* keys a scoring step */
#define AVX2_V_KEYS 4 /* keys an accumulation step */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

enum { AVX2_KV_F32, AVX2_KV_BF16, AVX2_KV_F16, AVX2_KV_FP8 };

/* 8 storage values at base + i as float32 (8-bit ones in units of fp8_unit). */
static inline __attribute__((always_inline)) __m256 avx2_load8(const void *base, int64_t i, int kind,
                                                              __m128i fp8_shift) {
    if (kind == AVX2_KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i))), 16));
    if (kind == AVX2_KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    if (kind == AVX2_KV_FP8) {
        const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + i)));
        const __m128i half = _mm_or_si128(_mm_sll_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7f)), fp8_shift),
                                          _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8));
        return _mm256_cvtph_ps(half);
    }
    return _mm256_loadu_ps((const float *)base + i);
}

static inline __attribute__((always_inline)) void avx2_row(float *restrict dst, const void *base, int64_t offset,
                                                          int head_dim, int kind, __m128i fp8_shift) {
    for (int d = 0; d < head_dim; d += 8) _mm256_store_ps(dst + d, avx2_load8(base, offset + d, kind, fp8_shift));
}

/* Lane t of the result: the sum of v[t]'s 8 lanes (a transpose-and-add tree). */
static inline __attribute__((always_inline)) __m256 sum_lanes_8(const __m256 v[AVX2_KEYS]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* `heads` query heads of one kv head over keys first_key .. end_key - 1 (at least one). */
static inline __attribute__((always_inline)) void attend_avx2(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int first_key, int end_key,
    int kv_head, int kv_heads, int heads, const int head_dim, int block_size, float scale, int dtype, const int kind,
    __m128i fp8_shift, float out_scale, void *out, int64_t out_offset, int64_t q_offset) {
    float qf[AVX2_MAX_HEADS][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float acc[AVX2_MAX_HEADS][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float scores[AVX2_MAX_HEADS][AVX2_SPAN] __attribute__((aligned(32)));
    float rows[AVX2_KEYS][MAX_HEAD_DIM] __attribute__((aligned(32)));
    float row_max[AVX2_MAX_HEADS], row_sum[AVX2_MAX_HEADS];
    int64_t offsets[AVX2_SPAN];
    const int64_t token_stride = (int64_t)kv_heads * head_dim, head_offset = (int64_t)kv_head * head_dim;
    const int vecs = head_dim / 8;

    /* rows a step leaves unused are read (times a zero weight, or scored and masked): finite */
    memset(rows, 0, sizeof rows);
    for (int g = 0; g < heads; g++) {
        load_row(qf[g], q, q_offset + (int64_t)g * head_dim, head_dim, dtype);
        memset(acc[g], 0, sizeof(float) * (size_t)head_dim);
        row_max[g] = -INFINITY;
        row_sum[g] = 0.0f;
    }
    const __m256 lane_index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    /* key positions walked by block and slot: one division to start, none a key */
    int block = first_key / block_size, slot = first_key % block_size;
    for (int span_start = first_key; span_start < end_key; span_start += AVX2_SPAN) {
        const int n = end_key - span_start < AVX2_SPAN ? end_key - span_start : AVX2_SPAN;
        for (int i = 0; i < n; i++) {
            if (slot == block_size) {
                slot = 0;
                block++;
            }
            offsets[i] = ((int64_t)table[block] * block_size + slot++) * token_stride + head_offset;
        }
        /* 1: scores, 8 keys at a time; keys past the span score -inf */
        for (int k0 = 0; k0 < n; k0 += AVX2_KEYS) {
            const int m = n - k0 < AVX2_KEYS ? n - k0 : AVX2_KEYS;
            for (int i = 0; i < m; i++) avx2_row(rows[i], k_cache, offsets[k0 + i], head_dim, kind, fp8_shift);
            const __m256 live = _mm256_cmp_ps(lane_index, _mm256_set1_ps((float)m), _CMP_LT_OQ);
            for (int g = 0; g < heads; g++) {
                __m256 partial[AVX2_KEYS];
                for (int i = 0; i < AVX2_KEYS; i++) partial[i] = _mm256_setzero_ps();
                for (int c = 0; c < vecs; c++) {
                    const __m256 qv = _mm256_load_ps(qf[g] + 8 * c);
                    for (int i = 0; i < AVX2_KEYS; i++)
                        partial[i] = _mm256_fmadd_ps(qv, _mm256_load_ps(rows[i] + 8 * c), partial[i]);
                }
                const __m256 s = _mm256_mul_ps(sum_lanes_8(partial), _mm256_set1_ps(scale));
                _mm256_store_ps(scores[g] + k0, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, live));
            }
        }
        /* 2: their softmax, folded into the running max and sum (and what acc holds) */
        const int padded = (n + AVX2_KEYS - 1) / AVX2_KEYS * AVX2_KEYS;
        for (int g = 0; g < heads; g++) {
            float *s = scores[g];
            __m256 vmax = _mm256_set1_ps(-INFINITY);
            for (int i = 0; i < padded; i += 8) vmax = _mm256_max_ps(vmax, _mm256_load_ps(s + i));
            vmax = _mm256_max_ps(vmax, _mm256_permute2f128_ps(vmax, vmax, 1));
            vmax = _mm256_max_ps(vmax, _mm256_shuffle_ps(vmax, vmax, _MM_SHUFFLE(1, 0, 3, 2)));
            vmax = _mm256_max_ps(vmax, _mm256_shuffle_ps(vmax, vmax, _MM_SHUFFLE(2, 3, 0, 1)));
            const float span_max = _mm256_cvtss_f32(vmax);
            const float new_max = span_max > row_max[g] ? span_max : row_max[g];
            const float correction = exp_f32(row_max[g] - new_max);
            row_max[g] = new_max;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; i++) {
                const float p = exp_f32(s[i] - new_max);
                s[i] = p;
                sum += p;
            }
            row_sum[g] = row_sum[g] * correction + sum;
            const __m256 c_vec = _mm256_set1_ps(correction);
            for (int c = 0; c < vecs; c++)
                _mm256_store_ps(acc[g] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), c_vec));
        }
        /* 3: p . v, 4 keys at a time, in order */
        for (int i0 = 0; i0 < n; i0 += AVX2_V_KEYS) {
            const int m = n - i0 < AVX2_V_KEYS ? n - i0 : AVX2_V_KEYS;
            for (int j = 0; j < m; j++) avx2_row(rows[j], v_cache, offsets[i0 + j], head_dim, kind, fp8_shift);
            for (int g = 0; g < heads; g++) {
                __m256 p[AVX2_V_KEYS];
                for (int j = 0; j < AVX2_V_KEYS; j++) p[j] = _mm256_set1_ps(j < m ? scores[g][i0 + j] : 0.0f);
                for (int c = 0; c < vecs; c++) {
                    __m256 a = _mm256_load_ps(acc[g] + 8 * c);
                    for (int j = 0; j < AVX2_V_KEYS; j++) a = _mm256_fmadd_ps(p[j], _mm256_load_ps(rows[j] + 8 * c), a);
                    _mm256_store_ps(acc[g] + 8 * c, a);
                }
            }
        }
    }
    for (int g = 0; g < heads; g++) {
        const __m256 inv = _mm256_set1_ps(out_scale / row_sum[g]);
        for (int c = 0; c < vecs; c++) _mm256_store_ps(acc[g] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * c), inv));
        store_row(out, out_offset + (int64_t)g * head_dim, acc[g], head_dim, dtype);
    }
}

#define ATTEND_AVX2(HEAD_DIM, KIND)                                                                            \
    attend_avx2(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, heads, HEAD_DIM, block_size, \
                scale, dtype, KIND, fp8_shift, out_scale, out, out_offset, q_offset)
#define AVX2_HEAD_DIM_CASES(KIND)                         \
    switch (head_dim) {                                   \
    case 64: ATTEND_AVX2(64, KIND); return;               \
    case 128: ATTEND_AVX2(128, KIND); return;             \
    default: ATTEND_AVX2(head_dim, KIND); return;         \
    }

static void attend_avx2_heads(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                              int first_key, int end_key, int kv_head, int kv_heads, int heads, int head_dim,
                              int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                              int64_t out_offset, int64_t q_offset) {
    const __m128i fp8_shift = _mm_cvtsi32_si128(kv_dtype == DTYPE_FP8_E4M3 ? 7 : 8);
    switch (kv_dtype) {
    case DTYPE_F32: AVX2_HEAD_DIM_CASES(AVX2_KV_F32)
    case DTYPE_BF16: AVX2_HEAD_DIM_CASES(AVX2_KV_BF16)
    case DTYPE_F16: AVX2_HEAD_DIM_CASES(AVX2_KV_F16)
    default: AVX2_HEAD_DIM_CASES(AVX2_KV_FP8)
    }
}

/* Attends one (sequence, kv head) and returns 1 where this level covers the shape (head_dim
 * a multiple of 8, some key visible); 0 leaves it to attend_one. The group's query heads
 * go in passes of at most AVX2_MAX_HEADS. */
static int attend_avx2_case(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                            int first_key, int end_key, int kv_head, int kv_heads, int group, int head_dim,
                            int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                            int64_t out_offset, int64_t q_offset) {
    if (end_key <= first_key || head_dim % 8 != 0) return 0;
    for (int first = 0; first < group; first += AVX2_MAX_HEADS) {
        const int heads = group - first < AVX2_MAX_HEADS ? group - first : AVX2_MAX_HEADS;
        attend_avx2_heads(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, heads, head_dim,
                          block_size, scale, dtype, kv_dtype, out_scale, out, out_offset + (int64_t)first * head_dim,
                          q_offset + (int64_t)first * head_dim);
    }
    return 1;
}
#pragma GCC pop_options
