/* One weight row of a quantized type times up to QUANT_TOKEN_TILE tokens' 8-bit
 * activations, with 256-bit integer dot products (and, for the interleaved layout of
 * quant_x8.h, eight rows times one token, x8_group; and rows dequantized for the float
 * product): included once per instruction-set level (x86/quant_matmul_avx2.h,
 * x86/quant_matmul_avx512_vnni.h, both included by quant_matmul.c), each of which defines
 *     QS(name)        the level's name for a function (a suffix),
 *     QS_DOT32(u, s)  32 unsigned bytes u times 32 signed bytes s, summed in fours into
 *                     8 int32 lanes (lane i holds bytes 4i..4i+3): AVX2's maddubs +
 *                     madd, or one AVX-512 VNNI dpbusd.
 *     QS_DOT32_ACC(acc, u, s)  the same, added to acc.
 *     QS_X8_FLIP_S8   1 where Q8_0's signed weights may be read as unsigned (w + 128,
 *                     dpbusd's int32 sums hold it), 0 where maddubs's int16 pairs would
 *                     saturate (the sign trick instead).
 * inside a `#pragma GCC target` for that level.
 *
 * Each 32-weight sub-block is unpacked into 32 unsigned bytes (Q8_0: signed, multiplied
 * by the sign trick: |w| times a with w's sign), one integer dot product per token, then
 * a float multiply-add by the weight scale times the activation scale. The types that
 * store v + offset (Q4_0: 8, Q5_0: 16, Q6_K: 32) or a min (Q4_1, Q5_1, Q4_K, Q5_K) get
 * that term from the activations' half-block sums (times their scale), once per sub-block (unpack_sub in
 * quant_blocks.h has the same arithmetic, element by element). maddubs's int16 pairs do
 * not saturate: |u| <= 128 and |s| <= 127, so a pair is at most 32,512.
 */

static inline __attribute__((always_inline)) float QS(hsum)(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
}

/* A float16 scale as float32, looked up (half_table in quant_matmul.c): a load where a
 * conversion instruction competes for the vector shuffle port with the unpacking, and
 * `(float)_Float16` is a libgcc call a value on CPUs without AVX512-FP16 (GCC 12). */
static inline __attribute__((always_inline)) float QS(half)(const uint8_t *p) {
    uint16_t bits;
    memcpy(&bits, p, sizeof bits);
    return half_table[bits];
}

/* Nibbles of 16 bytes: low ones in bytes 0-15, high ones in bytes 16-31. The 16 bytes
 * loaded into both halves, the upper half shifted by 4 (32-bit lanes: the bits that cross
 * into a byte's high nibble are masked off): no lane-crossing insert. */
static inline __attribute__((always_inline)) __m256i QS(nibbles16)(const uint8_t *p) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* Bit i of `bits` as 0x10 in byte i, else 0 (Q5_0 and Q5_1's fifth bits). */
static inline __attribute__((always_inline)) __m256i QS(bit_bytes)(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

static inline __attribute__((always_inline)) __m256i QS(shift_right16)(__m256i v, int count) {
    return _mm256_srl_epi16(v, _mm_cvtsi32_si128(count));
}

/* Sub-block s of the row: its 32 weights as bytes (unsigned but for Q8_0), the weight
 * scales of its two halves and its min. */
static inline __attribute__((always_inline)) __m256i QS(unpack)(const int type, const uint8_t *row, int s,
                                                                 float *scale0, float *scale1, float *min) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int block_bytes = qtype_block_bytes(type);
    *min = 0.0f;
    if (qtype_block_weights(type) == 32) {
        const uint8_t *b = row + (int64_t)s * block_bytes;
        *scale0 = *scale1 = QS(half)(b);
        if (type == QTYPE_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
        if (type == QTYPE_Q4_0) return QS(nibbles16)(b + 2);
        if (type == QTYPE_Q4_1) {
            *min = QS(half)(b + 2);
            return QS(nibbles16)(b + 4);
        }
        if (type == QTYPE_Q5_0) return _mm256_or_si256(QS(nibbles16)(b + 6), QS(bit_bytes)(load_u32(b + 2)));
        *min = QS(half)(b + 2); /* Q5_1 */
        return _mm256_or_si256(QS(nibbles16)(b + 8), QS(bit_bytes)(load_u32(b + 4)));
    }
    const uint8_t *b = row + (int64_t)(s / 8) * block_bytes;
    const int j = s % 8;
    if (type == QTYPE_Q6_K) {
        const int half = j / 4, k = j % 4;
        const float d = QS(half)(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * k;
        *scale0 = d * sc[0];
        *scale1 = d * sc[1];
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (k & 1)));
        if (k >= 2) ql = QS(shift_right16)(ql, 4);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        const __m256i high = _mm256_and_si256(QS(shift_right16)(qh, 2 * k), _mm256_set1_epi8(3));
        return _mm256_or_si256(_mm256_and_si256(ql, low4), _mm256_slli_epi16(high, 4));
    }
    int sc, mn; /* Q4_K, Q5_K */
    k_scale_min(b + 4, j, &sc, &mn);
    *scale0 = *scale1 = QS(half)(b) * (float)sc;
    *min = -QS(half)(b + 2) * (float)mn;
    __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == QTYPE_Q5_K ? 48 : 16) + 32 * (j / 2)));
    if (j & 1) q = QS(shift_right16)(q, 4);
    __m256i u = _mm256_and_si256(q, low4);
    if (type == QTYPE_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i bit = _mm256_and_si256(QS(shift_right16)(qh, j), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
    }
    return u;
}

/* Sub-block s of the row times tokens t0 .. t0 + nt - 1, into acc and extra. */
static inline __attribute__((always_inline)) void QS(step)(const int type, const uint8_t *row, int s,
                                                            const quant_acts *acts, int64_t t0, const int nt,
                                                            int subs, __m256 *acc, float *extra) {
    const int offset = qtype_unsigned_offset(type);
    float scale0, scale1, min;
    const __m256i u = QS(unpack)(type, row, s, &scale0, &scale1, &min);
    for (int t = 0; t < nt; t++) {
        const int64_t token = t0 + t;
        const __m256i a = _mm256_loadu_si256((const __m256i *)(acts->q + token * acts->cols + 32 * s));
        const __m256i products = type == QTYPE_Q8_0 ? QS_DOT32(_mm256_sign_epi8(u, u), _mm256_sign_epi8(a, u))
                                                    : QS_DOT32(u, a);
        /* (products x d) x the weight scale, each broadcast from memory rather than their
         * product from a register (a shuffle-port broadcast a sub-block) */
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(products), _mm256_set1_ps(acts->d[token * subs + s]));
        const __m256 scales = type == QTYPE_Q6_K
            ? _mm256_set_m128(_mm_set1_ps(scale1), _mm_set1_ps(scale0)) : _mm256_set1_ps(scale0);
        acc[t] = _mm256_fmadd_ps(scaled, scales, acc[t]);
        const float *sums = acts->scaled_sums + (token * subs + s) * 2;
        if (offset != 0) extra[t] -= (float)offset * (scale0 * sums[0] + scale1 * sums[1]);
        if (type == QTYPE_Q4_1 || type == QTYPE_Q5_1 || type == QTYPE_Q4_K || type == QTYPE_Q5_K)
            extra[t] += min * (sums[0] + sums[1]);
    }
}

/* out[t] = row . activations of token t0 + t, for t < nt. Two sets of accumulators, for
 * even and odd sub-blocks: one chain of dependent adds would bound the loop by its latency. */
static inline __attribute__((always_inline)) void QS(dot_rows)(const int type, const uint8_t *row,
                                                                const quant_acts *acts, int64_t t0, const int nt,
                                                                int subs, float *out) {
    __m256 even[QUANT_TOKEN_TILE], odd[QUANT_TOKEN_TILE];
    float extra_even[QUANT_TOKEN_TILE], extra_odd[QUANT_TOKEN_TILE];
    for (int t = 0; t < nt; t++) {
        even[t] = odd[t] = _mm256_setzero_ps();
        extra_even[t] = extra_odd[t] = 0.0f;
    }
    int s = 0;
    for (; s + 1 < subs; s += 2) {
        QS(step)(type, row, s, acts, t0, nt, subs, even, extra_even);
        QS(step)(type, row, s + 1, acts, t0, nt, subs, odd, extra_odd);
    }
    if (s < subs) QS(step)(type, row, s, acts, t0, nt, subs, even, extra_even);
    for (int t = 0; t < nt; t++) out[t] = QS(hsum)(_mm256_add_ps(even[t], odd[t])) + extra_even[t] + extra_odd[t];
}

/* out[0], out[1] = rows row0 and row1 . activations of one token. A decode step's one
 * token: the two rows' sub-blocks interleave, so the activation loads and scales of a
 * sub-block serve both (the compiler shares them between the inlined steps). Each row
 * sums as dot_rows does (even and odd sub-blocks apart), so a token's result is the same
 * bits whether its step has one token or many. */
static inline __attribute__((always_inline)) void QS(pair_rows)(const int type, const uint8_t *row0,
                                                                 const uint8_t *row1, const quant_acts *acts,
                                                                 int64_t token, int subs, float *out) {
    __m256 even0 = _mm256_setzero_ps(), odd0 = _mm256_setzero_ps();
    __m256 even1 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
    float extra_even0 = 0.0f, extra_odd0 = 0.0f, extra_even1 = 0.0f, extra_odd1 = 0.0f;
    int s = 0;
    for (; s + 1 < subs; s += 2) {
        QS(step)(type, row0, s, acts, token, 1, subs, &even0, &extra_even0);
        QS(step)(type, row1, s, acts, token, 1, subs, &even1, &extra_even1);
        QS(step)(type, row0, s + 1, acts, token, 1, subs, &odd0, &extra_odd0);
        QS(step)(type, row1, s + 1, acts, token, 1, subs, &odd1, &extra_odd1);
    }
    if (s < subs) {
        QS(step)(type, row0, s, acts, token, 1, subs, &even0, &extra_even0);
        QS(step)(type, row1, s, acts, token, 1, subs, &even1, &extra_even1);
    }
    out[0] = QS(hsum)(_mm256_add_ps(even0, odd0)) + extra_even0 + extra_odd0;
    out[1] = QS(hsum)(_mm256_add_ps(even1, odd1)) + extra_even1 + extra_odd1;
}

/* Sub-block s of an interleaved group times tokens t0 .. t0 + nt - 1, into acc[t] (lane r:
 * row r). The group's weights are unpacked once, into eight vectors w[c] holding weights
 * 4c..4c+3 of the 8 rows (for Q4_0 and Q4_1, c < 4 the low nibbles of chunk c, c >= 4
 * the high nibbles of chunk c - 4), and serve every token of the tile: unpacking was
 * much of a sub-block's instructions when each token did its own (BENCHMARKS.md, "Token
 * tiles"). w[c] meets activations 4c..4c+3 broadcast; two integer accumulators (even and
 * odd c), so no chain of dependent adds bounds the loop. */
static inline __attribute__((always_inline)) void QS(x8_sub)(const int base, const uint8_t *group, int s,
                                                              const quant_acts *acts, int64_t t0, const int nt,
                                                              int subs, __m256 *acc) {
    const int bytes = qtype_block_bytes(base), header = x8_header_bytes(base);
    const uint8_t *g = group + (int64_t)s * 8 * bytes, *payload = g + 8 * header;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256i w[8];
    int offset;
    if (base == QTYPE_Q8_0) {
        for (int j = 0; j < 8; j++) {
            w[j] = _mm256_loadu_si256((const __m256i *)(payload + 32 * j));
#if QS_X8_FLIP_S8
            w[j] = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80));
#endif
        }
        offset = QS_X8_FLIP_S8 ? 128 : 0;
    } else {
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(payload + 32 * j));
            w[j] = _mm256_and_si256(raw, low4);
            w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        }
        offset = base == QTYPE_Q4_0 ? 8 : 0;
    }
    const __m256 weight_scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 mins = base == QTYPE_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                                           : _mm256_setzero_ps();
    for (int t = 0; t < nt; t++) {
        const int64_t token = t0 + t;
        const uint8_t *a = (const uint8_t *)(acts->q + token * acts->cols + 32 * s);
        __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();
        for (int c = 0; c < 8; c += 2) {
            const __m256i a0 = _mm256_set1_epi32((int)load_u32(a + 4 * c));
            const __m256i a1 = _mm256_set1_epi32((int)load_u32(a + 4 * c + 4));
            if (base == QTYPE_Q8_0 && !QS_X8_FLIP_S8) {
                first = QS_DOT32_ACC(first, _mm256_sign_epi8(w[c], w[c]), _mm256_sign_epi8(a0, w[c]));
                second = QS_DOT32_ACC(second, _mm256_sign_epi8(w[c + 1], w[c + 1]), _mm256_sign_epi8(a1, w[c + 1]));
            } else {
                first = QS_DOT32_ACC(first, w[c], a0);
                second = QS_DOT32_ACC(second, w[c + 1], a1);
            }
        }
        __m256i dot = _mm256_add_epi32(first, second);
        if (offset) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(offset * acts->isums[token * subs + s]));
        const __m256 scales = _mm256_mul_ps(weight_scales, _mm256_set1_ps(acts->d[token * subs + s]));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scales, acc[t]);
        if (base == QTYPE_Q4_1) {
            const float *sums = acts->scaled_sums + (token * subs + s) * 2;
            acc[t] = _mm256_fmadd_ps(mins, _mm256_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
}

/* out[8 t + r] = row r of an interleaved group (quant_x8.h) . activations of token t0 + t,
 * for t < NT and r < 8. Two float accumulators a token (even and odd sub-blocks). Q4_0's
 * offset of 8, and at the VNNI level Q8_0's (its signed weights are read as unsigned by
 * flipping their top bit: w + 128), come off the integer sum exactly (acts->isums); Q4_1's
 * min is added in floats, against the activations' scaled sums. Each token's arithmetic is
 * the same whatever the tile's size, so a token's result does not depend on the others in
 * its step. */
static inline __attribute__((always_inline)) void QS(x8_group)(const int base, const uint8_t *group,
                                                                const quant_acts *acts, int64_t t0, const int nt,
                                                                int subs, float *out) {
    __m256 even[QUANT_X8_TOKENS], odd[QUANT_X8_TOKENS];
    for (int t = 0; t < nt; t++) even[t] = odd[t] = _mm256_setzero_ps();
    int s = 0;
    for (; s + 1 < subs; s += 2) {
        QS(x8_sub)(base, group, s, acts, t0, nt, subs, even);
        QS(x8_sub)(base, group, s + 1, acts, t0, nt, subs, odd);
    }
    if (s < subs) QS(x8_sub)(base, group, s, acts, t0, nt, subs, even);
    for (int t = 0; t < nt; t++) _mm256_storeu_ps(out + 8 * t, _mm256_add_ps(even[t], odd[t]));
}

#if QS_X16
/* Two interleaved groups, sixteen rows, a 512-bit vector (lanes 0-7: the first group's
 * rows, 8-15: the next group's): the AVX-512 level's tiles. A 512-bit dpbusd issues as
 * fast as a 256-bit one on the CPUs measured (BENCHMARKS.md, "Token tiles"), so two
 * groups a vector halve every per-token instruction a row costs. Each lane's arithmetic
 * is x8_sub's, so a row's result is the same bits whichever path computes it. */
static inline __attribute__((always_inline)) __m512i QS(load_pair256)(const uint8_t *first, const uint8_t *second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)first)),
                              _mm256_loadu_si256((const __m256i *)second), 1);
}

/* Eight float16 values at each of first and second as sixteen float32s. */
static inline __attribute__((always_inline)) __m512 QS(halves16)(const uint8_t *first, const uint8_t *second) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)first)),
                                                   _mm_loadu_si128((const __m128i *)second), 1));
}

/* x8_sub for the groups at group and group + group_bytes together. */
static inline __attribute__((always_inline)) void QS(x16_sub)(const int base, const uint8_t *group,
                                                               int64_t group_bytes, int s, const quant_acts *acts,
                                                               int64_t t0, const int nt, int subs, __m512 *acc) {
    const int bytes = qtype_block_bytes(base), header = x8_header_bytes(base);
    const uint8_t *g0 = group + (int64_t)s * 8 * bytes, *g1 = g0 + group_bytes;
    const uint8_t *p0 = g0 + 8 * header, *p1 = g1 + 8 * header;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i w[8];
    int offset;
    if (base == QTYPE_Q8_0) {
        for (int j = 0; j < 8; j++)
            w[j] = _mm512_xor_si512(QS(load_pair256)(p0 + 32 * j, p1 + 32 * j), _mm512_set1_epi8((char)0x80));
        offset = 128;
    } else {
        for (int j = 0; j < 4; j++) {
            const __m512i raw = QS(load_pair256)(p0 + 32 * j, p1 + 32 * j);
            w[j] = _mm512_and_si512(raw, low4);
            w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
        offset = base == QTYPE_Q4_0 ? 8 : 0;
    }
    const __m512 weight_scales = QS(halves16)(g0, g1);
    const __m512 mins = base == QTYPE_Q4_1 ? QS(halves16)(g0 + 16, g1 + 16) : _mm512_setzero_ps();
    /* unrolled: the tile's accumulators stay in registers (GCC keeps the loop, and them in
     * memory, otherwise) */
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        const int64_t token = t0 + t;
        const uint8_t *a = (const uint8_t *)(acts->q + token * acts->cols + 32 * s);
        __m512i first = _mm512_setzero_si512(), second = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
            first = _mm512_dpbusd_epi32(first, w[c], _mm512_set1_epi32((int)load_u32(a + 4 * c)));
            second = _mm512_dpbusd_epi32(second, w[c + 1], _mm512_set1_epi32((int)load_u32(a + 4 * c + 4)));
        }
        __m512i dot = _mm512_add_epi32(first, second);
        if (offset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset * acts->isums[token * subs + s]));
        const __m512 scales = _mm512_mul_ps(weight_scales, _mm512_set1_ps(acts->d[token * subs + s]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scales, acc[t]);
        if (base == QTYPE_Q4_1) {
            const float *sums = acts->scaled_sums + (token * subs + s) * 2;
            acc[t] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sums[0] + sums[1]), acc[t]);
        }
    }
}

/* x8_group for two groups: out[16 t + r], r < 8 the first group's rows, r >= 8 the next's. */
static inline __attribute__((always_inline)) void QS(x16_group)(const int base, const uint8_t *group,
                                                                 int64_t group_bytes, const quant_acts *acts,
                                                                 int64_t t0, const int nt, int subs, float *out) {
    __m512 even[QUANT_X16_TOKENS], odd[QUANT_X16_TOKENS];
    for (int t = 0; t < nt; t++) even[t] = odd[t] = _mm512_setzero_ps();
    int s = 0;
    for (; s + 1 < subs; s += 2) {
        QS(x16_sub)(base, group, group_bytes, s, acts, t0, nt, subs, even);
        QS(x16_sub)(base, group, group_bytes, s + 1, acts, t0, nt, subs, odd);
    }
    if (s < subs) QS(x16_sub)(base, group, group_bytes, s, acts, t0, nt, subs, even);
    for (int t = 0; t < nt; t++) _mm512_storeu_ps(out + 16 * t, _mm512_add_ps(even[t], odd[t]));
}

#define QS_X16_FN(TYPE_NAME, TYPE_CODE)                                                                     \
    static void QS(x16_##TYPE_NAME)(const uint8_t *group, int64_t group_bytes, const quant_acts *acts,      \
                                    int64_t t0, int nt, int subs, float *out) {                             \
        if (nt == QUANT_X16_TOKENS) QS(x16_group)(TYPE_CODE, group, group_bytes, acts, t0, QUANT_X16_TOKENS, subs, out); \
        else                                                                                                \
            for (int t = 0; t < nt; t++)                                                                    \
                QS(x16_group)(TYPE_CODE, group, group_bytes, acts, t0 + t, 1, subs, out + 16 * t);          \
    }
QS_X16_FN(q4_0, QTYPE_Q4_0)
QS_X16_FN(q4_1, QTYPE_Q4_1)
QS_X16_FN(q8_0, QTYPE_Q8_0)
#undef QS_X16_FN

static x16_fn QS(select_x16)(int base) {
    switch (base) {
    case QTYPE_Q4_0: return QS(x16_q4_0);
    case QTYPE_Q4_1: return QS(x16_q4_1);
    case QTYPE_Q8_0: return QS(x16_q8_0);
    default: return 0;
    }
}
#endif

#define QS_X8_FN(TYPE_NAME, TYPE_CODE)                                                                     \
    static void QS(x8_##TYPE_NAME)(const uint8_t *group, const quant_acts *acts, int64_t t0, int nt, int subs, \
                                   float *out) {                                                          \
        if (nt == QUANT_X8_TOKENS) QS(x8_group)(TYPE_CODE, group, acts, t0, QUANT_X8_TOKENS, subs, out);   \
        else                                                                                              \
            for (int t = 0; t < nt; t++) QS(x8_group)(TYPE_CODE, group, acts, t0 + t, 1, subs, out + 8 * t); \
    }
QS_X8_FN(q4_0, QTYPE_Q4_0)
QS_X8_FN(q4_1, QTYPE_Q4_1)
QS_X8_FN(q8_0, QTYPE_Q8_0)
#undef QS_X8_FN

static x8_fn QS(select_x8)(int base) {
    switch (base) {
    case QTYPE_Q4_0: return QS(x8_q4_0);
    case QTYPE_Q4_1: return QS(x8_q4_1);
    case QTYPE_Q8_0: return QS(x8_q8_0);
    default: return 0;
    }
}

/* quantize_row (quant_matmul.c) in vectors, the same arithmetic value by value (amax, one
 * division each way, x times the inverse rounded to nearest even, integer sums), so the
 * same bytes and scales: done a value at a time it took most of a 48-token product with
 * 1536 columns (BENCHMARKS.md, "Token tiles"). */
static void QS(quantize_row)(const void *x, int64_t offset, int cols, int dtype, int8_t *q, float *d, float *sums,
                             int32_t *isums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    float block[32];
    for (int s = 0; s < cols / 32; s++) {
        load_row(block, x, offset + 32 * s, 32, dtype);
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(block + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
        }
        __m128 top = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        top = _mm_max_ps(top, _mm_movehl_ps(top, top));
        top = _mm_max_ss(top, _mm_movehdup_ps(top));
        const float block_max = _mm_cvtss_f32(top);
        const float inverse = block_max > 0.0f ? 127.0f / block_max : 0.0f;
        d[s] = block_max / 127.0f;
        __m256i values[4];
        for (int i = 0; i < 4; i++)
            values[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* int32 -> int8 (exact: |value| <= 127); packs interleave 128-bit lanes, the
         * permute puts the 32 bytes back in order */
        const __m256i words = _mm256_packs_epi32(values[0], values[1]), words2 = _mm256_packs_epi32(values[2], values[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                          _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
        _mm256_storeu_si256((__m256i *)(q + 32 * s), bytes);
        const __m256i first8 = _mm256_add_epi32(values[0], values[1]), second8 = _mm256_add_epi32(values[2], values[3]);
        __m128i halves = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(first8), _mm256_extracti128_si256(first8, 1)),
                                        _mm_add_epi32(_mm256_castsi256_si128(second8), _mm256_extracti128_si256(second8, 1)));
        halves = _mm_hadd_epi32(halves, halves); /* lanes: first, second, first, second */
        const int first = _mm_cvtsi128_si32(halves), second = _mm_extract_epi32(halves, 1);
        sums[2 * s] = d[s] * (float)first;
        sums[2 * s + 1] = d[s] * (float)second;
        isums[s] = first + second;
    }
}

/* Eight float32 values as bfloat16, rounded to nearest even (values are never NaN here). */
static inline __attribute__((always_inline)) __m128i QS(bf16x8)(__m256 w) {
    __m256i bits = _mm256_castps_si256(w);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* Eight float32 values stored as dtype (float32, or bfloat16: bf16x8). */
static inline __attribute__((always_inline)) void QS(store8)(void *out, int64_t i, __m256 w, int dtype) {
    if (dtype == DTYPE_F32) {
        _mm256_storeu_ps((float *)out + i, w);
        return;
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), QS(bf16x8)(w));
}

/* A row's weights as dtype (float32 or bfloat16), w = scale (v - offset) + min per value
 * as unpack_sub's arithmetic gives them (quant_blocks.h), for a batched product that
 * multiplies them in floats (quant_matmul.py). */
static void QS(dequantize_row)(const int type, const uint8_t *row, int subs, void *out, int64_t out_offset,
                               int dtype) {
    const int offset = qtype_unsigned_offset(type);
    for (int s = 0; s < subs; s++) {
        float scales[2], min;
        const __m256i u = QS(unpack)(type, row, s, &scales[0], &scales[1], &min);
        const __m256 base = _mm256_set1_ps(min);
        for (int h = 0; h < 2; h++) {
            const __m128i half = h ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
            const __m256 scale = _mm256_set1_ps(scales[h]);
            for (int q = 0; q < 2; q++) {
                const __m128i bytes = q ? _mm_unpackhi_epi64(half, half) : half;
                __m256i values = type == QTYPE_Q8_0 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
                values = _mm256_sub_epi32(values, _mm256_set1_epi32(offset));
                QS(store8)(out, out_offset + 32 * s + 16 * h + 8 * q,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(values), scale, base), dtype);
            }
        }
    }
}

/* w's first four values at element `first` of out, its last four at `second`, as dtype
 * (float32, or bfloat16: bf16x8). */
static inline __attribute__((always_inline)) void QS(store_pair)(void *out, int64_t first, int64_t second,
                                                                  __m256 w, int dtype) {
    if (dtype == DTYPE_F32) {
        _mm_storeu_ps((float *)out + first, _mm256_castps256_ps128(w));
        _mm_storeu_ps((float *)out + second, _mm256_extractf128_ps(w, 1));
        return;
    }
    const __m128i packed = QS(bf16x8)(w);
    _mm_storel_epi64((__m128i *)((uint16_t *)out + first), packed);
    _mm_storel_epi64((__m128i *)((uint16_t *)out + second), _mm_unpackhi_epi64(packed, packed));
}

/* The 8 rows of an interleaved group as dtype (float32 or bfloat16): row r at element
 * out_offset + r * cols of out, each value what dequantize_row gives for the file's row
 * (w = scale v + min, or scale v - offset scale: the same single rounding). Two rows at a
 * time: 8 bytes of a chunk vector are row 2p's four and row 2p + 1's. */
static void QS(dequantize_group_x8)(const int base, const uint8_t *group, int subs, void *out, int64_t out_offset,
                                    int dtype) {
    const int bytes = qtype_block_bytes(base), header = x8_header_bytes(base);
    const int64_t cols = 32 * (int64_t)subs;
    for (int s = 0; s < subs; s++) {
        const uint8_t *g = group + (int64_t)s * 8 * bytes, *payload = g + 8 * header;
        const __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256 bases = base == QTYPE_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)))
                       : base == QTYPE_Q4_0 ? _mm256_mul_ps(scales, _mm256_set1_ps(-8.0f))
                                            : _mm256_setzero_ps();
        for (int pair = 0; pair < 4; pair++) {
            const __m256i lanes = _mm256_set_epi32(2 * pair + 1, 2 * pair + 1, 2 * pair + 1, 2 * pair + 1,
                                                   2 * pair, 2 * pair, 2 * pair, 2 * pair);
            const __m256 scale = _mm256_permutevar8x32_ps(scales, lanes);
            const __m256 min = _mm256_permutevar8x32_ps(bases, lanes);
            const int64_t first = out_offset + (int64_t)(2 * pair) * cols + 32 * s;
            const int64_t second = first + cols;
            const int chunks = base == QTYPE_Q8_0 ? 8 : 4;
            for (int j = 0; j < chunks; j++) {
                /* 8 bytes: row 2 pair's chunk, then row 2 pair + 1's */
                const __m128i both = _mm_loadl_epi64((const __m128i *)(payload + 32 * j + 8 * pair));
                if (base == QTYPE_Q8_0) {
                    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(both));
                    QS(store_pair)(out, first + 4 * j, second + 4 * j, _mm256_fmadd_ps(v, scale, min), dtype);
                    continue;
                }
                const __m256i nibbles = _mm256_cvtepu8_epi32(both);
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(nibbles, _mm256_set1_epi32(0x0F)));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(nibbles, 4));
                QS(store_pair)(out, first + 4 * j, second + 4 * j, _mm256_fmadd_ps(lo, scale, min), dtype);
                QS(store_pair)(out, first + 16 + 4 * j, second + 16 + 4 * j, _mm256_fmadd_ps(hi, scale, min), dtype);
            }
        }
    }
}

/* One function per type, nt a constant (4, or 1 for a tail: fewer cases to compile). */
#define QS_TYPE_FN(TYPE_NAME, TYPE_CODE)                                                                  \
    static void QS(dot_##TYPE_NAME)(const uint8_t *row, const quant_acts *acts, int64_t t0, int nt, int subs, \
                                    float *out) {                                                         \
        if (nt == QUANT_TOKEN_TILE) QS(dot_rows)(TYPE_CODE, row, acts, t0, QUANT_TOKEN_TILE, subs, out);  \
        else                                                                                              \
            for (int t = 0; t < nt; t++) QS(dot_rows)(TYPE_CODE, row, acts, t0 + t, 1, subs, out + t);     \
    }
#define QS_PAIR_FN(TYPE_NAME, TYPE_CODE)                                                                  \
    static void QS(pair_##TYPE_NAME)(const uint8_t *row0, const uint8_t *row1, const quant_acts *acts,   \
                                     int64_t token, int subs, float *out) {                              \
        QS(pair_rows)(TYPE_CODE, row0, row1, acts, token, subs, out);                                     \
    }
QS_PAIR_FN(q4_0, QTYPE_Q4_0)
QS_PAIR_FN(q4_1, QTYPE_Q4_1)
QS_PAIR_FN(q5_0, QTYPE_Q5_0)
QS_PAIR_FN(q5_1, QTYPE_Q5_1)
QS_PAIR_FN(q8_0, QTYPE_Q8_0)
QS_PAIR_FN(q4_k, QTYPE_Q4_K)
QS_PAIR_FN(q5_k, QTYPE_Q5_K)
QS_PAIR_FN(q6_k, QTYPE_Q6_K)
#undef QS_PAIR_FN

static pair_fn QS(select_pair)(int type) {
    switch (type) {
    case QTYPE_Q4_0: return QS(pair_q4_0);
    case QTYPE_Q4_1: return QS(pair_q4_1);
    case QTYPE_Q5_0: return QS(pair_q5_0);
    case QTYPE_Q5_1: return QS(pair_q5_1);
    case QTYPE_Q8_0: return QS(pair_q8_0);
    case QTYPE_Q4_K: return QS(pair_q4_k);
    case QTYPE_Q5_K: return QS(pair_q5_k);
    case QTYPE_Q6_K: return QS(pair_q6_k);
    default: return 0;
    }
}

QS_TYPE_FN(q4_0, QTYPE_Q4_0)
QS_TYPE_FN(q4_1, QTYPE_Q4_1)
QS_TYPE_FN(q5_0, QTYPE_Q5_0)
QS_TYPE_FN(q5_1, QTYPE_Q5_1)
QS_TYPE_FN(q8_0, QTYPE_Q8_0)
QS_TYPE_FN(q4_k, QTYPE_Q4_K)
QS_TYPE_FN(q5_k, QTYPE_Q5_K)
QS_TYPE_FN(q6_k, QTYPE_Q6_K)
#undef QS_TYPE_FN

static dot_fn QS(select)(int type) {
    switch (type) {
    case QTYPE_Q4_0: return QS(dot_q4_0);
    case QTYPE_Q4_1: return QS(dot_q4_1);
    case QTYPE_Q5_0: return QS(dot_q5_0);
    case QTYPE_Q5_1: return QS(dot_q5_1);
    case QTYPE_Q8_0: return QS(dot_q8_0);
    case QTYPE_Q4_K: return QS(dot_q4_k);
    case QTYPE_Q5_K: return QS(dot_q5_k);
    case QTYPE_Q6_K: return QS(dot_q6_k);
    default: return 0;
    }
}
