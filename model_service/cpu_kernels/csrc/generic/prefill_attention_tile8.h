/* prefill_attention.c's portable level, in GCC's vector extension (included by it):
 * tile8_body, eight queries a vector, built as tile8_portable here and, for AVX2, FMA and
 * F16C, as x86/prefill_attention_avx2.h's tile8_avx2. */

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
    int lo, hi;
    lane_key_ranges(c, first_position, lanes, TILE8, first_key, end_key, &lo, &hi);
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
