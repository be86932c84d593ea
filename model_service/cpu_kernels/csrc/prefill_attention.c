/* Causal attention of a prompt chunk's queries over their sequence's keys in the pool, for
 * bfloat16 and float32 pools, at three levels (prefill_best_level; prefill_attention.py's
 * LEVELS): portable C, AVX2 with FMA, and AVX-512 BF16 (bfloat16 pools; a float32 pool
 * takes the AVX2 tile there).
 *
 * Decode attention (paged_decode.c) takes one query at a time: its dot products are
 * reductions along head_dim, a few per key. A prompt chunk has many queries over the same
 * keys, so here several of them, of one query head, share a vector: a lane a query. The
 * online softmax of flash attention runs lane by lane, with no reduction across lanes; the
 * output accumulates in float32, a vector of queries a dimension, each key's value broadcast.
 * - AVX-512 BF16: sixteen queries a 512-bit vector; scores are one `dpbf16ps` a pair of
 *   dimensions and key (the queries laid out as bf16_matmul.c's panels, the key's pair
 *   broadcast).
 * - portable and AVX2: eight queries a vector of GCC's vector extension (tile8_body), K/V
 *   widened to float32 rows once a block of keys, scores by multiply-adds a dimension; one
 *   body built twice, for the -march the library has and for AVX2+FMA+F16C.
 *
 * A lane's arithmetic depends on its own query and keys alone: keys go a tile's width at a
 * time in blocks aligned to multiples of it from key 0, and a key a lane must not see
 * (after its position, or before its window) adds exactly nothing to it (its weight is set
 * to zero, and a block it sees none of scales it by exactly 1). So at one level a query's
 * result is the same bits whatever chunk or tile it is computed in; it is not decode
 * attention's (another order of sums), which is why decode steps keep paged_decode.c.
 *
 * Layout as paged_decode.c's: one layer's K (and V) [num_blocks, block_size, kv_heads,
 * head_dim]; q [query_len, q_heads, head_dim] in the pool's type, token rows q_row_stride
 * apart; out likewise, out_row_stride apart. Query i sits at position context_len -
 * query_len + i and sees keys up to it (and, with a window w, from position - w + 1).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"

#define PREFILL_MAX_HEAD_DIM 256
#define PREFILL_LANES 16 /* the AVX-512 tile's queries and keys */
#define TILE8 8 /* the portable and AVX2 tile's */

enum { PREFILL_PORTABLE = 0, PREFILL_AVX2 = 1, PREFILL_AVX512_BF16 = 2 };

static const cpu_check_fn prefill_checks[] = {0, X86_LEVEL(cpu_avx2_fma_f16c), X86_LEVEL(cpu_avx512f_bf16)};

/* The highest level this CPU runs. */
int prefill_best_level(void) { return best_level(prefill_checks); }

/* What every sequence of the call shares. */
typedef struct {
    const void *k_cache, *v_cache;
    int64_t q_row_stride, out_row_stride;
    int q_heads, kv_heads, head_dim, block_size, window, dtype;
    float scale;
} prefill_call;

/* One sequence's part: its queries' first row in q and out, its block table. */
typedef struct {
    const void *q;
    void *out;
    const int32_t *table;
    int query_len, context_len;
} prefill_seq;

/* Attends query head h's queries t0 .. t0 + lanes - 1 of one sequence. */
typedef void (*tile_fn)(const prefill_call *c, const prefill_seq *seq, int h, int t0);

/* Eight float32 lanes, and their masks. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define SPLAT8(x) ((v8f){(x), (x), (x), (x), (x), (x), (x), (x)})

static inline __attribute__((always_inline)) v8f select8(v8i mask, v8f yes, v8f no) {
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

/* exp_f32 (cpu_math.h) eight lanes at a time: the same reduction and polynomial. */
static inline __attribute__((always_inline)) v8f exp8(v8f x) {
    x = select8(x < SPLAT8(-87.0f), SPLAT8(-87.0f), x);
    x = select8(x > SPLAT8(88.0f), SPLAT8(88.0f), x);
    const v8f k = (x * SPLAT8(1.4426950408889634f) + SPLAT8(12582912.0f)) - SPLAT8(12582912.0f);
    const v8f r = (x - k * SPLAT8(0.693145751953125f)) - k * SPLAT8(1.428606765330187e-06f);
    v8f p = SPLAT8(1.0f / 720.0f);
    p = p * r + SPLAT8(1.0f / 120.0f);
    p = p * r + SPLAT8(1.0f / 24.0f);
    p = p * r + SPLAT8(1.0f / 6.0f);
    p = p * r + SPLAT8(0.5f);
    p = p * r + SPLAT8(1.0f);
    p = p * r + SPLAT8(1.0f);
    const v8i bits = (__builtin_convertvector(k, v8i) + 127) << 23;
    return p * (v8f)bits;
}

/* The portable and AVX2 tile: eight queries of query head h from t0, keys eight at a time.
 * head_dim and dtype are constants in each caller's cases. */
static inline __attribute__((always_inline)) void tile8_body(const prefill_call *c, const prefill_seq *seq, int h,
                                                             int t0, const int hd, const int dtype) {
    const int kv_head = h / (c->q_heads / c->kv_heads);
    const int lanes = seq->query_len - t0 < TILE8 ? seq->query_len - t0 : TILE8;
    const int first_position = seq->context_len - seq->query_len + t0;
    v8f panel[PREFILL_MAX_HEAD_DIM], acc[PREFILL_MAX_HEAD_DIM];
    float keys[TILE8][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(32)));
    float values[TILE8][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(32)));
    float row[PREFILL_MAX_HEAD_DIM] __attribute__((aligned(32)));
    int32_t first_key[TILE8], end_key[TILE8];

    for (int d = 0; d < hd; d++) panel[d] = SPLAT8(0.0f);
    for (int lane = 0; lane < lanes; lane++) {
        load_row(row, seq->q, (int64_t)(t0 + lane) * c->q_row_stride + (int64_t)h * hd, hd, dtype);
        for (int d = 0; d < hd; d++) panel[d][lane] = row[d];
    }
    int lo = INT32_MAX, hi = 0;
    for (int lane = 0; lane < TILE8; lane++) {
        if (lane < lanes) {
            const int position = first_position + lane;
            first_key[lane] = c->window > 0 && position - c->window + 1 > 0 ? position - c->window + 1 : 0;
            end_key[lane] = position + 1;
            lo = first_key[lane] < lo ? first_key[lane] : lo;
            hi = end_key[lane];
        } else {
            first_key[lane] = end_key[lane] = 0; /* sees nothing; never stored */
        }
    }
    for (int d = 0; d < hd; d++) acc[d] = SPLAT8(0.0f);
    v8i lane_first, lane_end;
    memcpy(&lane_first, first_key, sizeof lane_first);
    memcpy(&lane_end, end_key, sizeof lane_end);
    v8f row_max = SPLAT8(-FLT_MAX), row_sum = SPLAT8(0.0f);
    const int64_t token_stride = (int64_t)c->kv_heads * hd;

    for (int kb = lo - lo % TILE8; kb < hi; kb += TILE8) {
        for (int j = 0; j < TILE8; j++) {
            const int key = kb + j;
            if (key < hi) {
                const int64_t slot = (int64_t)seq->table[key / c->block_size] * c->block_size + key % c->block_size;
                load_row(keys[j], c->k_cache, slot * token_stride + (int64_t)kv_head * hd, hd, dtype);
                load_row(values[j], c->v_cache, slot * token_stride + (int64_t)kv_head * hd, hd, dtype);
            } else { /* past the context: zeros, weighed by zero */
                memset(keys[j], 0, sizeof(float) * (size_t)hd);
                memset(values[j], 0, sizeof(float) * (size_t)hd);
            }
        }
        v8f s[TILE8];
        for (int j = 0; j < TILE8; j++) s[j] = SPLAT8(0.0f);
        for (int d = 0; d < hd; d++) {
            const v8f line = panel[d];
            for (int j = 0; j < TILE8; j++) s[j] += line * keys[j][d];
        }
        v8i visible[TILE8];
        v8f block_max = row_max;
        for (int j = 0; j < TILE8; j++) {
            const int key = kb + j;
            visible[j] = (lane_first <= key) & (key < lane_end);
            s[j] *= c->scale;
            block_max = select8(visible[j] & (s[j] > block_max), s[j], block_max);
        }
        /* exactly 1 where the block raised no lane's maximum */
        const v8f correction = exp8(row_max - block_max);
        row_max = block_max;
        row_sum *= correction;
        for (int j = 0; j < TILE8; j++) {
            s[j] = (v8f)((v8i)exp8(s[j] - block_max) & visible[j]);
            row_sum += s[j];
        }
        for (int d = 0; d < hd; d++) {
            v8f out = acc[d] * correction;
            for (int j = 0; j < TILE8; j++) out += s[j] * values[j][d];
            acc[d] = out;
        }
    }
    const v8f inverse = SPLAT8(1.0f) / row_sum;
    for (int lane = 0; lane < lanes; lane++) {
        for (int d = 0; d < hd; d++) row[d] = acc[d][lane] * inverse[lane];
        store_row(seq->out, (int64_t)(t0 + lane) * c->out_row_stride + (int64_t)h * hd, row, hd, dtype);
    }
}

#define TILE8_CASES(DTYPE)                                        \
    switch (c->head_dim) {                                        \
    case 64: tile8_body(c, seq, h, t0, 64, DTYPE); return;        \
    case 128: tile8_body(c, seq, h, t0, 128, DTYPE); return;      \
    default: tile8_body(c, seq, h, t0, c->head_dim, DTYPE); return; \
    }

static void tile8_portable(const prefill_call *c, const prefill_seq *seq, int h, int t0) {
    if (c->dtype == DTYPE_BF16) { TILE8_CASES(DTYPE_BF16) }
    TILE8_CASES(DTYPE_F32)
}

#if CPU_LEVELS_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static void tile8_avx2(const prefill_call *c, const prefill_seq *seq, int h, int t0) {
    if (c->dtype == DTYPE_BF16) { TILE8_CASES(DTYPE_BF16) }
    TILE8_CASES(DTYPE_F32)
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>

/* exp_f32 (cpu_math.h) sixteen lanes at a time: the same reduction and polynomial. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), big), big);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(k, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* Query head h, the sequence's queries t0 .. t0 + 15 (those past query_len are empty lanes). */
static void tile16_avx512_bf16(const prefill_call *c, const prefill_seq *seq, int h, int t0) {
    static const uint16_t zeros[PREFILL_MAX_HEAD_DIM]; /* the K/V row of a key past the context */
    const int hd = c->head_dim, pairs = hd / 2, kv_head = h / (c->q_heads / c->kv_heads);
    const int lanes = seq->query_len - t0 < PREFILL_LANES ? seq->query_len - t0 : PREFILL_LANES;
    const int first_position = seq->context_len - seq->query_len + t0;
    uint16_t panel[PREFILL_MAX_HEAD_DIM / 2][PREFILL_LANES][2] __attribute__((aligned(64)));
    float acc[PREFILL_MAX_HEAD_DIM][PREFILL_LANES] __attribute__((aligned(64)));
    float values[PREFILL_LANES][PREFILL_MAX_HEAD_DIM];
    uint16_t keys[PREFILL_LANES][PREFILL_MAX_HEAD_DIM];
    int32_t first_key[PREFILL_LANES], end_key[PREFILL_LANES];

    memset(panel, 0, sizeof panel[0] * (size_t)pairs);
    for (int lane = 0; lane < lanes; lane++) {
        const uint16_t *row = (const uint16_t *)seq->q + (int64_t)(t0 + lane) * c->q_row_stride + (int64_t)h * hd;
        for (int p = 0; p < pairs; p++) {
            panel[p][lane][0] = row[2 * p];
            panel[p][lane][1] = row[2 * p + 1];
        }
    }
    int lo = INT32_MAX, hi = 0;
    for (int lane = 0; lane < PREFILL_LANES; lane++) {
        if (lane < lanes) {
            const int position = first_position + lane;
            first_key[lane] = c->window > 0 && position - c->window + 1 > 0 ? position - c->window + 1 : 0;
            end_key[lane] = position + 1;
            lo = first_key[lane] < lo ? first_key[lane] : lo;
            hi = end_key[lane];
        } else {
            first_key[lane] = end_key[lane] = 0; /* sees nothing; never stored */
        }
    }
    memset(acc, 0, sizeof acc[0] * (size_t)hd);
    const __m512i lane_first = _mm512_loadu_si512(first_key), lane_end = _mm512_loadu_si512(end_key);
    const __m512 scale = _mm512_set1_ps(c->scale);
    __m512 row_max = _mm512_set1_ps(-FLT_MAX), row_sum = _mm512_setzero_ps();
    const int64_t token_stride = (int64_t)c->kv_heads * hd;

    for (int kb = lo - lo % PREFILL_LANES; kb < hi; kb += PREFILL_LANES) {
        /* the block's key rows side by side (one base address for the broadcasts below),
         * its value rows as float32 */
        for (int j = 0; j < PREFILL_LANES; j++) {
            const int key = kb + j;
            const uint16_t *k_row = zeros, *v_row = zeros;
            if (key < hi) {
                const int64_t slot = (int64_t)seq->table[key / c->block_size] * c->block_size + key % c->block_size;
                k_row = (const uint16_t *)c->k_cache + slot * token_stride + (int64_t)kv_head * hd;
                v_row = (const uint16_t *)c->v_cache + slot * token_stride + (int64_t)kv_head * hd;
            }
            memcpy(keys[j], k_row, sizeof(uint16_t) * (size_t)hd);
            for (int d = 0; d < hd; d += 16)
                _mm512_storeu_ps(values[j] + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_row + d))), 16)));
        }
        __m512 s[PREFILL_LANES];
        for (int j = 0; j < PREFILL_LANES; j++) s[j] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++) {
            const __m512bh line = (__m512bh)_mm512_load_si512(panel[p]);
            for (int j = 0; j < PREFILL_LANES; j++) {
                int32_t pair;
                memcpy(&pair, keys[j] + 2 * p, sizeof pair);
                s[j] = _mm512_dpbf16_ps(s[j], line, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
        __mmask16 visible[PREFILL_LANES];
        __m512 block_max = row_max;
        for (int j = 0; j < PREFILL_LANES; j++) {
            const __m512i key = _mm512_set1_epi32(kb + j);
            visible[j] = _mm512_cmple_epi32_mask(lane_first, key) & _mm512_cmplt_epi32_mask(key, lane_end);
            s[j] = _mm512_mul_ps(s[j], scale);
            block_max = _mm512_mask_max_ps(block_max, visible[j], block_max, s[j]);
        }
        /* exactly 1 where the block raised no lane's maximum */
        const __m512 correction = exp16(_mm512_sub_ps(row_max, block_max));
        row_max = block_max;
        row_sum = _mm512_mul_ps(row_sum, correction);
        for (int j = 0; j < PREFILL_LANES; j++) {
            s[j] = _mm512_maskz_mov_ps(visible[j], exp16(_mm512_sub_ps(s[j], block_max)));
            row_sum = _mm512_add_ps(row_sum, s[j]);
        }
        for (int d = 0; d < hd; d++) {
            __m512 out = _mm512_mul_ps(_mm512_load_ps(acc[d]), correction);
            for (int j = 0; j < PREFILL_LANES; j++) out = _mm512_fmadd_ps(s[j], _mm512_set1_ps(values[j][d]), out);
            _mm512_store_ps(acc[d], out);
        }
    }
    float inverse[PREFILL_LANES];
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), row_sum));
    for (int lane = 0; lane < lanes; lane++) {
        uint16_t *row = (uint16_t *)seq->out + (int64_t)(t0 + lane) * c->out_row_stride + (int64_t)h * hd;
        for (int d = 0; d < hd; d++) row[d] = f32_to_bf16(acc[d][lane] * inverse[lane]);
    }
}

#pragma GCC pop_options
#endif

/* Each level's tile (cpu_levels.h's scheme): a call takes the highest at or below its level
 * that takes its dtype (a float32 pool takes the AVX2 tile at the AVX-512 BF16 level). */
typedef struct {
    tile_fn tile;
    int lanes, bf16_only;
} prefill_level;

static const prefill_level prefill_levels[] = {
    [PREFILL_PORTABLE] = {tile8_portable, TILE8, 0},
#if CPU_LEVELS_X86
    [PREFILL_AVX2] = {tile8_avx2, TILE8, 0},
    [PREFILL_AVX512_BF16] = {tile16_avx512_bf16, PREFILL_LANES, 1},
#endif
};

/* Every (sequence, tile of `lanes` queries, head) of the call, in one parallel region. */
static void attend_all(const prefill_call *c, const prefill_seq *seqs, const int32_t *first_item, int items,
                       tile_fn tile, int lanes, int num_threads) {
    /* the last tiles of a sequence see the most keys: handed out from the end, one at a time */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && items > 1)
    for (int item = items - 1; item >= 0; item--) {
        int s = 0;
        while (first_item[s + 1] <= item) s++;
        const int local = item - first_item[s];
        tile(c, &seqs[s], local % c->q_heads, (local / c->q_heads) * lanes);
    }
}

/* The prefill sequences of a step, their queries one after another in q (query_lens[i]
 * rows for sequence i, whose block table is row i of tables and whose context after this
 * step is context_lens[i]), out likewise; q, out and the pool in dtype (float32 or
 * bfloat16), at `level`. Returns 0; -1 for a call it does not take (another dtype, a level
 * above prefill_best_level, head_dim not a multiple of 16 or too wide, query heads not a
 * multiple of the kv heads, a sequence with more queries than context), which the caller
 * attends another way; -2 without scratch memory. */
int prefill_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                      const int32_t *tables, int64_t table_row_stride, const int32_t *query_lens,
                      const int32_t *context_lens, int num_seqs, int q_heads, int kv_heads, int head_dim,
                      int block_size, float scale, int sliding_window, void *out, int64_t out_row_stride,
                      int dtype, int level, int num_threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || level < PREFILL_PORTABLE || level > prefill_best_level()
        || head_dim % 16 != 0 || head_dim <= 0 || head_dim > PREFILL_MAX_HEAD_DIM || kv_heads <= 0
        || q_heads % kv_heads != 0 || block_size <= 0 || num_seqs < 0)
        return -1;
    for (int s = 0; s < num_seqs; s++)
        if (query_lens[s] < 0 || query_lens[s] > context_lens[s]) return -1;
    const int count = (int)(sizeof prefill_levels / sizeof prefill_levels[0]);
    int at = level_index(level, count);
    while (prefill_levels[at].bf16_only && dtype != DTYPE_BF16) at--;
    const tile_fn tile = prefill_levels[at].tile;
    const int lanes = prefill_levels[at].lanes;
    prefill_seq *seqs = malloc(sizeof *seqs * (size_t)(num_seqs + 1));
    int32_t *first_item = malloc(sizeof *first_item * (size_t)(num_seqs + 1));
    if (seqs == NULL || first_item == NULL) {
        free(seqs);
        free(first_item);
        return -2;
    }
    const size_t element = dtype == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t);
    int64_t row = 0;
    first_item[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        seqs[s] = (prefill_seq){(const char *)q + (size_t)(row * q_row_stride) * element,
                                (char *)out + (size_t)(row * out_row_stride) * element,
                                tables + s * table_row_stride, query_lens[s], context_lens[s]};
        first_item[s + 1] = first_item[s] + (query_lens[s] + lanes - 1) / lanes * q_heads;
        row += query_lens[s];
    }
    const prefill_call call = {k_cache, v_cache, q_row_stride, out_row_stride, q_heads, kv_heads, head_dim,
                               block_size, sliding_window, dtype, scale};
    attend_all(&call, seqs, first_item, first_item[num_seqs], tile, lanes, num_threads);
    free(seqs);
    free(first_item);
    return 0;
}
