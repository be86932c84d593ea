/* Causal attention of a prompt chunk's queries over their sequence's keys in the pool, for
 * bfloat16 and float32 pools, at four levels (prefill_best_level; prefill_attention.py's
 * LEVELS): portable C, AVX2 with FMA, AVX-512F, and AVX-512 BF16 (bfloat16 pools; a
 * float32 pool takes the AVX-512F tile there).
 *
 * Decode attention (paged_decode.c) takes one query at a time: its dot products are
 * reductions along head_dim, a few per key. A prompt chunk has many queries over the same
 * keys, so here several of them, of one query head, share a vector: a lane a query. The
 * online softmax of flash attention runs lane by lane, with no reduction across lanes; the
 * output accumulates in float32, a vector of queries a dimension, each key's value broadcast.
 * - portable, AVX2 and AVX-512F: one body in GCC's vector extension
 *   (generic/prefill_attention_tile.h), K/V widened to float32 rows once a block of keys,
 *   scores by multiply-adds a dimension; eight queries a vector built for the -march the
 *   library has and for AVX2+FMA+F16C, sixteen (a 512-bit vector) for AVX-512F. At the
 *   AVX-512F level a bfloat16 pool takes the sixteen-lane body too, widened to float32.
 * - AVX-512 BF16: sixteen queries a 512-bit vector; scores are one `dpbf16ps` a pair of
 *   dimensions and key (the queries laid out as bf16_matmul.c's panels, the key's pair
 *   broadcast); bfloat16 pools only.
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
#define PREFILL_LANES 16 /* the AVX-512 tiles' queries and keys */
#define TILE8 8 /* the portable and AVX2 tile's */

enum { PREFILL_PORTABLE = 0, PREFILL_AVX2 = 1, PREFILL_AVX512 = 2, PREFILL_AVX512_BF16 = 3 };

/* AVX-512 BF16 needs the AVX-512F level's sets too: a float32 pool takes that tile there. */
static const cpu_check_fn prefill_checks[] = {0, X86_LEVEL(cpu_avx2_fma_f16c), X86_LEVEL(cpu_avx512f_avx2),
                                              X86_LEVEL(cpu_avx512f_avx2_bf16)};

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

/* The keys each of a tile's `width` lanes sees, [first_key, end_key) (causal, and from
 * the window's start where there is one), and in *lo, *hi those the whole tile spans.
 * Lanes past `lanes` see nothing and are never stored. */
static inline __attribute__((always_inline)) void lane_key_ranges(const prefill_call *c, int first_position,
                                                                   int lanes, int width, int32_t *first_key,
                                                                   int32_t *end_key, int *lo, int *hi) {
    *lo = INT32_MAX;
    *hi = 0;
    for (int lane = 0; lane < width; lane++) {
        if (lane < lanes) {
            const int position = first_position + lane;
            first_key[lane] = c->window > 0 && position - c->window + 1 > 0 ? position - c->window + 1 : 0;
            end_key[lane] = position + 1;
            *lo = first_key[lane] < *lo ? first_key[lane] : *lo;
            *hi = end_key[lane];
        } else {
            first_key[lane] = end_key[lane] = 0;
        }
    }
}

#define PREFILL_TILE_W TILE8
#include "generic/prefill_attention_tile.h"
#undef PREFILL_TILE_W

static void tile8_portable(const prefill_call *c, const prefill_seq *seq, int h, int t0) { tile8_cases(c, seq, h, t0); }

#if CPU_LEVELS_X86
#include "x86/prefill_attention_avx2.h"
#include "x86/prefill_attention_avx512.h"
#include "x86/prefill_attention_avx512_bf16.h"
#endif

/* Each level's tile (cpu_levels.h's scheme): a call takes the highest at or below its level
 * that takes its dtype (a float32 pool takes the AVX-512F tile at the AVX-512 BF16 level). */
typedef struct {
    tile_fn tile;
    int lanes, bf16_only;
} prefill_level;

static const prefill_level prefill_levels[] = {
    [PREFILL_PORTABLE] = {tile8_portable, TILE8, 0},
#if CPU_LEVELS_X86
    [PREFILL_AVX2] = {tile8_avx2, TILE8, 0},
    [PREFILL_AVX512] = {tile16_avx512, PREFILL_LANES, 0},
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
