/* prefill_attention.c's tile in GCC's vector extension, PREFILL_TILE_W queries a vector (8
 * or 16): included once per width with PREFILL_TILE_W defined, it defines, for W that
 * width, tileW_body and tileW_cases (the body with head_dim 64 and 128, and the dtype, as
 * constants). Eight lanes: the portable level (prefill_attention.c's tile8_portable) and,
 * built for AVX2, FMA and F16C, x86/prefill_attention_avx2.h's tile8_avx2. Sixteen: built
 * for AVX-512F, x86/prefill_attention_avx512.h's tile16_avx512. One body, so the widths
 * differ only in how many queries share a vector and how many keys make a block. */

#define PREFILL_TILE_CAT2(a, b) a##b
#define PREFILL_TILE_CAT(a, b) PREFILL_TILE_CAT2(a, b)
/* a name after the width: TW(_body) is tile8_body or tile16_body */
#define TW(name) PREFILL_TILE_CAT(PREFILL_TILE_CAT(tile, PREFILL_TILE_W), name)

/* W float32 lanes, and their masks. */
typedef float TW(_vf) __attribute__((vector_size(4 * PREFILL_TILE_W)));
typedef int32_t TW(_vi) __attribute__((vector_size(4 * PREFILL_TILE_W)));

static inline __attribute__((always_inline)) TW(_vf) TW(_splat)(float x) {
    TW(_vf) v;
    for (int lane = 0; lane < PREFILL_TILE_W; lane++) v[lane] = x;
    return v;
}

static inline __attribute__((always_inline)) TW(_vf) TW(_select)(TW(_vi) mask, TW(_vf) yes, TW(_vf) no) {
    return (TW(_vf))(((TW(_vi))yes & mask) | ((TW(_vi))no & ~mask));
}

/* exp_f32 (cpu_math.h) W lanes at a time: the same reduction and polynomial. */
static inline __attribute__((always_inline)) TW(_vf) TW(_exp)(TW(_vf) x) {
    x = TW(_select)(x < TW(_splat)(-87.0f), TW(_splat)(-87.0f), x);
    x = TW(_select)(x > TW(_splat)(88.0f), TW(_splat)(88.0f), x);
    const TW(_vf) k = (x * TW(_splat)(1.4426950408889634f) + TW(_splat)(12582912.0f)) - TW(_splat)(12582912.0f);
    const TW(_vf) r = (x - k * TW(_splat)(0.693145751953125f)) - k * TW(_splat)(1.428606765330187e-06f);
    TW(_vf) p = TW(_splat)(1.0f / 720.0f);
    p = p * r + TW(_splat)(1.0f / 120.0f);
    p = p * r + TW(_splat)(1.0f / 24.0f);
    p = p * r + TW(_splat)(1.0f / 6.0f);
    p = p * r + TW(_splat)(0.5f);
    p = p * r + TW(_splat)(1.0f);
    p = p * r + TW(_splat)(1.0f);
    const TW(_vi) bits = (__builtin_convertvector(k, TW(_vi)) + 127) << 23;
    return p * (TW(_vf))bits;
}

/* W queries of query head h from t0, keys W at a time (K/V widened to float32 rows once a
 * block). head_dim and dtype are constants in TW(cases). */
static inline __attribute__((always_inline)) void TW(_body)(const prefill_call *c, const prefill_seq *seq,
                                                                 int h, int t0, const int hd, const int dtype) {
    enum { W = PREFILL_TILE_W };
    const int kv_head = h / (c->q_heads / c->kv_heads);
    const int lanes = seq->query_len - t0 < W ? seq->query_len - t0 : W;
    const int first_position = seq->context_len - seq->query_len + t0;
    TW(_vf) panel[PREFILL_MAX_HEAD_DIM], acc[PREFILL_MAX_HEAD_DIM];
    float keys[W][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float values[W][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float row[PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    int32_t first_key[W], end_key[W];

    for (int d = 0; d < hd; d++) panel[d] = TW(_splat)(0.0f);
    for (int lane = 0; lane < lanes; lane++) {
        load_row(row, seq->q, (int64_t)(t0 + lane) * c->q_row_stride + (int64_t)h * hd, hd, dtype);
        for (int d = 0; d < hd; d++) panel[d][lane] = row[d];
    }
    int lo, hi;
    lane_key_ranges(c, first_position, lanes, W, first_key, end_key, &lo, &hi);
    for (int d = 0; d < hd; d++) acc[d] = TW(_splat)(0.0f);
    TW(_vi) lane_first, lane_end;
    memcpy(&lane_first, first_key, sizeof lane_first);
    memcpy(&lane_end, end_key, sizeof lane_end);
    TW(_vf) row_max = TW(_splat)(-FLT_MAX), row_sum = TW(_splat)(0.0f);
    const int64_t token_stride = (int64_t)c->kv_heads * hd;

    for (int kb = lo - lo % W; kb < hi; kb += W) {
        for (int j = 0; j < W; j++) {
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
        TW(_vf) s[W];
        for (int j = 0; j < W; j++) s[j] = TW(_splat)(0.0f);
        for (int d = 0; d < hd; d++) {
            const TW(_vf) line = panel[d];
            for (int j = 0; j < W; j++) s[j] += line * keys[j][d];
        }
        TW(_vi) visible[W];
        TW(_vf) block_max = row_max;
        for (int j = 0; j < W; j++) {
            const int key = kb + j;
            visible[j] = (lane_first <= key) & (key < lane_end);
            s[j] *= c->scale;
            block_max = TW(_select)(visible[j] & (s[j] > block_max), s[j], block_max);
        }
        /* exactly 1 where the block raised no lane's maximum */
        const TW(_vf) correction = TW(_exp)(row_max - block_max);
        row_max = block_max;
        row_sum *= correction;
        for (int j = 0; j < W; j++) {
            s[j] = (TW(_vf))((TW(_vi))TW(_exp)(s[j] - block_max) & visible[j]);
            row_sum += s[j];
        }
        for (int d = 0; d < hd; d++) {
            TW(_vf) out = acc[d] * correction;
            for (int j = 0; j < W; j++) out += s[j] * values[j][d];
            acc[d] = out;
        }
    }
    const TW(_vf) inverse = TW(_splat)(1.0f) / row_sum;
    for (int lane = 0; lane < lanes; lane++) {
        for (int d = 0; d < hd; d++) row[d] = acc[d][lane] * inverse[lane];
        store_row(seq->out, (int64_t)(t0 + lane) * c->out_row_stride + (int64_t)h * hd, row, hd, dtype);
    }
}

/* The body for this call's dtype, with head_dim 64 and 128 as constants. */
static inline __attribute__((always_inline)) void TW(_cases)(const prefill_call *c, const prefill_seq *seq,
                                                                  int h, int t0) {
#define PREFILL_TILE_DTYPE(DTYPE)                                              \
    switch (c->head_dim) {                                                     \
    case 64: TW(_body)(c, seq, h, t0, 64, DTYPE); return;                  \
    case 128: TW(_body)(c, seq, h, t0, 128, DTYPE); return;                \
    default: TW(_body)(c, seq, h, t0, c->head_dim, DTYPE); return;         \
    }
    if (c->dtype == DTYPE_BF16) { PREFILL_TILE_DTYPE(DTYPE_BF16) }
    PREFILL_TILE_DTYPE(DTYPE_F32)
#undef PREFILL_TILE_DTYPE
}

#undef TW
