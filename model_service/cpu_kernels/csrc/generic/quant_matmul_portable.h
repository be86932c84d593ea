/* quant_matmul.c's portable level (included by it): a row of weights times tokens, each
 * 32-weight sub-block unpacked by quant_blocks.h's unpack_sub, per-type functions as the
 * SIMD levels' (portable_select). */

static void dot_portable(int type, const uint8_t *row, const quant_acts *acts, int64_t t0, int nt, int subs,
                         float *out) {
    float acc[QUANT_TOKEN_TILE] = {0};
    int8_t v[32];
    float scale[2], min;
    for (int s = 0; s < subs; s++) {
        unpack_sub(type, row, s, v, scale, &min);
        for (int t = 0; t < nt; t++) {
            const int64_t token = t0 + t;
            const int8_t *q = acts->q + token * acts->cols + 32 * s;
            int32_t first = 0, second = 0;
            for (int i = 0; i < 16; i++) first += v[i] * q[i];
            for (int i = 16; i < 32; i++) second += v[i] * q[i];
            const float *sums = acts->scaled_sums + (token * subs + s) * 2;
            acc[t] += acts->d[token * subs + s] * (scale[0] * (float)first + scale[1] * (float)second)
                      + min * (sums[0] + sums[1]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = acc[t];
}

#define PORTABLE_FN(TYPE_NAME, TYPE_CODE)                                                                   \
    static void portable_##TYPE_NAME(const uint8_t *row, const quant_acts *acts, int64_t t0, int nt, int subs, \
                                     float *out) {                                                          \
        dot_portable(TYPE_CODE, row, acts, t0, nt, subs, out);                                              \
    }
PORTABLE_FN(q4_0, QTYPE_Q4_0)
PORTABLE_FN(q4_1, QTYPE_Q4_1)
PORTABLE_FN(q5_0, QTYPE_Q5_0)
PORTABLE_FN(q5_1, QTYPE_Q5_1)
PORTABLE_FN(q8_0, QTYPE_Q8_0)
PORTABLE_FN(q4_k, QTYPE_Q4_K)
PORTABLE_FN(q5_k, QTYPE_Q5_K)
PORTABLE_FN(q6_k, QTYPE_Q6_K)
#undef PORTABLE_FN

static dot_fn portable_select(int type) {
    switch (type) {
    case QTYPE_Q4_0: return portable_q4_0;
    case QTYPE_Q4_1: return portable_q4_1;
    case QTYPE_Q5_0: return portable_q5_0;
    case QTYPE_Q5_1: return portable_q5_1;
    case QTYPE_Q8_0: return portable_q8_0;
    case QTYPE_Q4_K: return portable_q4_k;
    case QTYPE_Q5_K: return portable_q5_k;
    case QTYPE_Q6_K: return portable_q6_k;
    default: return 0;
    }
}
