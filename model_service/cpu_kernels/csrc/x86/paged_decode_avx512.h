/* The AVX-512 case of paged decode attention (included by paged_decode.c), for the shapes
 * serving spends its time on: float32, bfloat16 or 8-bit (either fp8 type, with float32 q)
 * K/V, head_dim 32 or 64, any number of query heads per kv head. (At head_dim 128 it measured no faster: 4 heads' accumulators
 * and q rows no longer fit in the 32 vector registers.) Same contract and float32
 * arithmetic as attend_one, in three passes over spans of up to SPAN keys instead of one
 * pass a block:
 *   1. q.k for every key of the span, 16 keys at a time, their partial dot products
 *      reduced together (sum_lanes_16);
 *   2. the softmax of those scores, folded into the running max and sum (the online
 *      softmax of flash attention, once a span: once per sequence up to SPAN keys);
 *   3. p.v over the span's keys into accumulators held in registers (group and head_dim
 *      are constants in each case, so acc[][] is a set of named vectors).
 * attend_one's block-at-a-time softmax puts a chain of dependent steps (max, exp, sum,
 * rescale, then the V accumulation) between one block's keys and the next; spans keep
 * the vector units busy across blocks (docs/benchmark-log.md, "Decode attention in spans",
 * measured with bench/kernels/decode_attention_ab.c).
 * Scores are scaled after the dot product (attend_one scales q first): the two differ by
 * float32 rounding.
 *
 * Built with its own target whatever -march says (AVX-512F, with the AVX2, FMA and F16C
 * every AVX-512 CPU has) and run only where the CPU has them (paged_decode_best_level);
 * elsewhere the AVX2 case and attend_one serve every shape. */
#include <immintrin.h>

#define KEYS_A_CHUNK 16
#define SPAN 256 /* keys scored before their softmax: scores[heads][SPAN], 4 KB at most */
#define AVX512_MAX_GROUP 4 /* query heads a pass (attend_avx512_case) */
#define AVX512_MAX_VECS (64 / 16) /* float32 vectors of a head_dim 64 row */
/* Full unrolling over the group, the row's vectors and the 16 keys is what keeps them in
 * registers; GCC's default heuristics left them in arrays on the stack. */
#define UNROLL _Pragma("GCC unroll 16")
/* At -O3 (the library's level) GCC took twice as long to build these cases, and they ran
 * slower (30.5 against 24.2 ns a key and kv head at head_dim 64, group 3). */
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("O2")

/* Lane t of the result is the sum of v[t]'s 16 lanes: a transpose-and-add tree (45
 * shuffles and adds for 16 sums, where one horizontal sum each takes 16 x 8). */
static inline __attribute__((always_inline)) __m512 sum_lanes_16(const __m512 v[KEYS_A_CHUNK]) {
    __m512 pairs[8], quads[4], halves[2];
    UNROLL for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    UNROLL for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    UNROLL for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* 16 float32 values from 16 storage values (bfloat16 widens exactly by a shift). The
 * intrinsics twin of argmax.c's portable load16_as_f32: with that one here (memcpy into a
 * GCC vector, then convert) this file ran 12 % slower at head_dim 64 in turns. */
static inline __attribute__((always_inline)) __m512 load16_f32(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i))), 16));
    return _mm512_loadu_ps((const float *)base + i);
}

/* 16 8-bit values as float32, in units of fp8_unit (see cpu_math.h; 16 at a
 * time): widened to 16 bits, the magnitude shifted by fp8_shift (7 for e4m3, 8 for e5m2: a
 * runtime count, so one case serves both types), then float16 to float32 in hardware. */
static inline __attribute__((always_inline)) __m512 load16_fp8(const void *base, int64_t i, __m128i fp8_shift) {
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + i)));
    const __m256i magnitude = _mm256_sll_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), fp8_shift);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(magnitude, sign));
}

#define KV_FP8 (-1) /* a case's K/V type: either 8-bit one (fp8_shift tells which) */

static inline __attribute__((always_inline)) __m512 load16_kv(const void *base, int64_t i, int kv_dtype,
                                                             __m128i fp8_shift) {
    if (kv_dtype == KV_FP8) return load16_fp8(base, i, fp8_shift);
    return load16_f32(base, i, kv_dtype);
}

/* Key positions in order, each one's row offset in the pool: one division to start,
 * then a slot count (a division a key costs more than the key's arithmetic). A block's
 * table entry is read when its first key is asked for, never before: past a sequence's
 * last block the table may end. */
typedef struct {
    const int32_t *table;
    int64_t block_base, token_stride, head_offset;
    int block, block_size, slot;
} KeyWalk;

static inline __attribute__((always_inline)) KeyWalk key_walk(const int32_t *table, int position, int block_size,
                                                            int64_t token_stride, int64_t head_offset) {
    KeyWalk walk = {table, 0, token_stride, head_offset, position / block_size, block_size, position % block_size};
    walk.block_base = (int64_t)table[walk.block] * block_size * token_stride + head_offset;
    return walk;
}

static inline __attribute__((always_inline)) int64_t key_next(KeyWalk *walk) {
    if (walk->slot == walk->block_size) {
        walk->slot = 0;
        walk->block++;
        walk->block_base = (int64_t)walk->table[walk->block] * walk->block_size * walk->token_stride + walk->head_offset;
    }
    return walk->block_base + (walk->slot++) * walk->token_stride;
}

static inline __attribute__((always_inline)) void attend_avx512(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int first_key, int end_key,
    int kv_head, int kv_heads, const int group, const int head_dim, int block_size, float scale, const int dtype,
    const int kv_dtype, __m128i fp8_shift, float out_scale, void *out, int64_t out_offset, int64_t q_offset) {
    const int vecs = head_dim / 16;
    __m512 acc[AVX512_MAX_GROUP][AVX512_MAX_VECS], q_f32[AVX512_MAX_GROUP][AVX512_MAX_VECS];
    float scores[AVX512_MAX_GROUP][SPAN] __attribute__((aligned(64)));
    float row_max[AVX512_MAX_GROUP], row_sum[AVX512_MAX_GROUP];
    const int64_t token_stride = (int64_t)kv_heads * head_dim, head_offset = (int64_t)kv_head * head_dim;

    UNROLL for (int g = 0; g < group; g++) {
        const int64_t row = q_offset + (int64_t)g * head_dim;
        UNROLL for (int c = 0; c < vecs; c++) acc[g][c] = _mm512_setzero_ps();
        UNROLL for (int c = 0; c < vecs; c++) q_f32[g][c] = load16_f32(q, row + 16 * c, dtype);
        row_max[g] = -INFINITY;
        row_sum[g] = 0.0f;
    }
    for (int span_start = first_key; span_start < end_key; span_start += SPAN) {
        const int n = end_key - span_start < SPAN ? end_key - span_start : SPAN;
        /* 1: the span's scores, 16 keys at a time; keys past the end score -inf */
        KeyWalk walk = key_walk(table, span_start, block_size, token_stride, head_offset);
        for (int k0 = 0; k0 < n; k0 += KEYS_A_CHUNK) {
            const int m = n - k0 < KEYS_A_CHUNK ? n - k0 : KEYS_A_CHUNK;
            int64_t rows[KEYS_A_CHUNK];
            UNROLL for (int i = 0; i < KEYS_A_CHUNK; i++) rows[i] = i < m ? key_next(&walk) : rows[0];
            const __mmask16 live = (__mmask16)((1u << m) - 1);
            UNROLL for (int g = 0; g < group; g++) {
                __m512 partial[KEYS_A_CHUNK];
                UNROLL for (int i = 0; i < KEYS_A_CHUNK; i++) {
                    __m512 sum = _mm512_setzero_ps();
                    UNROLL for (int c = 0; c < vecs; c++)
                        sum = _mm512_fmadd_ps(q_f32[g][c], load16_kv(k_cache, rows[i] + 16 * c, kv_dtype, fp8_shift), sum);
                    partial[i] = sum;
                }
                _mm512_store_ps(scores[g] + k0, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                                                   _mm512_mul_ps(sum_lanes_16(partial), _mm512_set1_ps(scale))));
            }
        }
        /* 2: their softmax, folded into the running max and sum (and what acc holds) */
        const int padded = (n + KEYS_A_CHUNK - 1) / KEYS_A_CHUNK * KEYS_A_CHUNK;
        UNROLL for (int g = 0; g < group; g++) {
            float *s = scores[g];
            __m512 vmax = _mm512_set1_ps(-INFINITY);
            for (int i = 0; i < padded; i += 16) vmax = _mm512_max_ps(vmax, _mm512_load_ps(s + i));
            const float span_max = _mm512_reduce_max_ps(vmax);
            const float new_max = span_max > row_max[g] ? span_max : row_max[g];
            const float correction = exp_f32(row_max[g] - new_max);
            row_max[g] = new_max;
#pragma omp simd
            for (int i = 0; i < padded; i++) s[i] = exp_f32(s[i] - new_max);
            __m512 vsum = _mm512_setzero_ps();
            for (int i = 0; i + 16 <= n; i += 16) vsum = _mm512_add_ps(vsum, _mm512_load_ps(s + i));
            if (n % 16) vsum = _mm512_add_ps(vsum, _mm512_maskz_load_ps((__mmask16)((1u << (n % 16)) - 1), s + n / 16 * 16));
            row_sum[g] = row_sum[g] * correction + _mm512_reduce_add_ps(vsum);
            const __m512 c_vec = _mm512_set1_ps(correction);
            UNROLL for (int c = 0; c < vecs; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], c_vec);
        }
        /* 3: p . v, the span's keys in order */
        walk = key_walk(table, span_start, block_size, token_stride, head_offset);
        for (int i = 0; i < n; i++) {
            const int64_t row = key_next(&walk);
            __m512 v_row[AVX512_MAX_VECS];
            UNROLL for (int c = 0; c < vecs; c++) v_row[c] = load16_kv(v_cache, row + 16 * c, kv_dtype, fp8_shift);
            UNROLL for (int g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(scores[g][i]);
                UNROLL for (int c = 0; c < vecs; c++) acc[g][c] = _mm512_fmadd_ps(p, v_row[c], acc[g][c]);
            }
        }
    }
    UNROLL for (int g = 0; g < group; g++) {
        float row[AVX512_MAX_VECS * 16];
        const __m512 inv = _mm512_set1_ps(out_scale / row_sum[g]);
        UNROLL for (int c = 0; c < vecs; c++) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(acc[g][c], inv));
        store_row(out, out_offset + (int64_t)g * head_dim, row, head_dim, dtype);
    }
}

#define ATTEND_AVX512(HEADS, HEAD_DIM, DTYPE, KV_DTYPE)                                                    \
    attend_avx512(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, HEADS, HEAD_DIM,     \
                  block_size, scale, DTYPE, KV_DTYPE, fp8_shift, out_scale, out, out_offset, q_offset)
#define AVX512_HEADS_CASES(HEAD_DIM, DTYPE, KV_DTYPE)                    \
    switch (heads) {                                                     \
    case 1: ATTEND_AVX512(1, HEAD_DIM, DTYPE, KV_DTYPE); return;         \
    case 2: ATTEND_AVX512(2, HEAD_DIM, DTYPE, KV_DTYPE); return;         \
    case 3: ATTEND_AVX512(3, HEAD_DIM, DTYPE, KV_DTYPE); return;         \
    default: ATTEND_AVX512(4, HEAD_DIM, DTYPE, KV_DTYPE); return;        \
    }
#define AVX512_HEAD_DIM_CASES(DTYPE, KV_DTYPE)            \
    switch (head_dim) {                                   \
    case 32: AVX512_HEADS_CASES(32, DTYPE, KV_DTYPE)      \
    default: AVX512_HEADS_CASES(64, DTYPE, KV_DTYPE)      \
    }

/* One pass: `heads` (1 to 4) query heads of a kv head, their rows at q_offset and out_offset. */
static void attend_avx512_heads(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                                int first_key, int end_key, int kv_head, int kv_heads, int heads, int head_dim,
                                int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                                int64_t out_offset, int64_t q_offset) {
    const __m128i fp8_shift = _mm_cvtsi32_si128(kv_dtype == DTYPE_FP8_E4M3 ? 7 : 8);
    if (kv_dtype == DTYPE_FP8_E4M3 || kv_dtype == DTYPE_FP8_E5M2) { AVX512_HEAD_DIM_CASES(DTYPE_F32, KV_FP8) }
    else if (dtype == DTYPE_F32) { AVX512_HEAD_DIM_CASES(DTYPE_F32, DTYPE_F32) }
    else { AVX512_HEAD_DIM_CASES(DTYPE_BF16, DTYPE_BF16) }
}

/* Attends one (sequence, kv head) and returns 1 where this case covers the shape; 0
 * leaves it to attend_one (which also writes the zeros of an empty context). The group's
 * query heads go in passes of at most 4, as many as registers hold accumulators for,
 * split evenly (7 heads: 4 + 3); a later pass reads the sequence's K/V again, from
 * cache. Four pass sizes instead of one case per group size also keep the build short
 * (each case is a large unrolled body). */
static int attend_avx512_case(const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                              int first_key, int end_key, int kv_head, int kv_heads, int group, int head_dim,
                              int block_size, float scale, int dtype, int kv_dtype, float out_scale, void *out,
                              int64_t out_offset, int64_t q_offset) {
    if (end_key <= first_key || (dtype != DTYPE_F32 && dtype != DTYPE_BF16) || (head_dim != 32 && head_dim != 64))
        return 0;  /* kv_dtype is dtype or 8-bit with dtype float32 (paged_decode_attention checks) */
    for (int first = 0; first < group;) {
        const int passes = (group - first + AVX512_MAX_GROUP - 1) / AVX512_MAX_GROUP;
        const int heads = (group - first + passes - 1) / passes;
        attend_avx512_heads(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, heads, head_dim,
                            block_size, scale, dtype, kv_dtype, out_scale, out, out_offset + (int64_t)first * head_dim,
                            q_offset + (int64_t)first * head_dim);
        first += heads;
    }
    return 1;
}
#pragma GCC pop_options
