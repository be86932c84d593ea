/* GGUF's quantized block layouts (llama.cpp's ggml types), read one 32-weight sub-block
 * at a time, and the 8-bit activations the quantized linears multiply them by.
 *
 * Every supported type is a run of 32-weight sub-blocks, each of which dequantizes as
 *     w[i] = scale[i / 16] * v[i] + min
 * with v[i] small integers (int8): unpack_sub gives v, the two scales (equal but for
 * Q6_K, whose scales cover 16 weights) and min. The SIMD levels (x86/quant_simd.h) read the
 * same bits their own way; this is the portable reference they are tested against, and
 * what dequantize_rows uses.
 *
 * Type codes are ggml's (gguf.GGMLQuantizationType).
 */
#ifndef PAGEDKV_QUANT_BLOCKS_H
#define PAGEDKV_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

enum {
    QTYPE_Q4_0 = 2, QTYPE_Q4_1 = 3, QTYPE_Q5_0 = 6, QTYPE_Q5_1 = 7, QTYPE_Q8_0 = 8,
    QTYPE_Q4_K = 12, QTYPE_Q5_K = 13, QTYPE_Q6_K = 14,
};

/* A type's code with this bit set: the same blocks, eight rows interleaved (quant_x8.h);
 * only Q4_0, Q4_1 and Q8_0 have that layout. */
#define QTYPE_X8 0x100

static inline int qtype_base(int type) { return type & ~QTYPE_X8; }

static inline int qtype_is_x8(int type) { return (type & QTYPE_X8) != 0; }

static inline int qtype_has_x8(int base) { return base == QTYPE_Q4_0 || base == QTYPE_Q4_1 || base == QTYPE_Q8_0; }

/* Weights per block and bytes per block of each type; 0 for a type without a kernel. */
static inline int qtype_block_weights(int type) {
    type = qtype_base(type);
    return type == QTYPE_Q4_K || type == QTYPE_Q5_K || type == QTYPE_Q6_K ? 256 : 32;
}

static inline int qtype_block_bytes(int type) {
    if (qtype_is_x8(type) && !qtype_has_x8(qtype_base(type))) return 0;
    switch (qtype_base(type)) {
    case QTYPE_Q4_0: return 18;
    case QTYPE_Q4_1: return 20;
    case QTYPE_Q5_0: return 22;
    case QTYPE_Q5_1: return 24;
    case QTYPE_Q8_0: return 34;
    case QTYPE_Q4_K: return 144;
    case QTYPE_Q5_K: return 176;
    case QTYPE_Q6_K: return 210;
    default: return 0;
    }
}

/* Bytes of one row of cols weights of the type. */
static inline int64_t qtype_row_bytes(int type, int cols) {
    return (int64_t)cols / qtype_block_weights(type) * qtype_block_bytes(type);
}

/* Whether every segment's type has a kernel and its blocks tile a row of cols weights
 * (and an interleaved segment's rows come in eights). */
static inline int qtype_segments_fit(int segments, const int32_t *types, const int32_t *rows, int cols) {
    for (int i = 0; i < segments; i++)
        if (qtype_block_bytes(types[i]) == 0 || cols % qtype_block_weights(types[i]) != 0
            || (qtype_is_x8(types[i]) && rows[i] % 8 != 0))
            return 0;
    return 1;
}

/* What the SIMD levels' unsigned unpacked values carry above the signed ones (v + offset):
 * Q4_0 8, Q5_0 16, Q6_K 32; 0 for the types with a min, and Q8_0's signed bytes. */
static inline int qtype_unsigned_offset(int type) {
    type = qtype_base(type);
    return type == QTYPE_Q4_0 ? 8 : type == QTYPE_Q5_0 ? 16 : type == QTYPE_Q6_K ? 32 : 0;
}

static inline float half_to_f32(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit mins in 12 bytes: sub-blocks 0-3
 * in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles
 * of bytes 8-11, with their top two bits in the top bits of bytes 0-3 and 4-7. */
static inline void k_scale_min(const uint8_t *q, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Sub-block `sub` (counted in 32s from the row's start `row`) as v[32], scales, min. */
static inline void unpack_sub(int type, const uint8_t *row, int64_t sub, int8_t v[32], float scale[2], float *min) {
    *min = 0.0f;
    if (qtype_block_weights(type) == 32) {
        const uint8_t *b = row + sub * qtype_block_bytes(type);
        const float d = half_to_f32(b);
        scale[0] = scale[1] = d;
        switch (type) {
        case QTYPE_Q8_0:
            memcpy(v, b + 2, 32);
            return;
        case QTYPE_Q4_0:
            for (int i = 0; i < 16; i++) {
                v[i] = (int8_t)((b[2 + i] & 0x0F) - 8);
                v[i + 16] = (int8_t)((b[2 + i] >> 4) - 8);
            }
            return;
        case QTYPE_Q4_1:
            *min = half_to_f32(b + 2);
            for (int i = 0; i < 16; i++) {
                v[i] = (int8_t)(b[4 + i] & 0x0F);
                v[i + 16] = (int8_t)(b[4 + i] >> 4);
            }
            return;
        case QTYPE_Q5_0:
        case QTYPE_Q5_1: {
            const int offset = type == QTYPE_Q5_0 ? 16 : 0;
            const uint8_t *p = b + 2;
            if (type == QTYPE_Q5_1) {
                *min = half_to_f32(p);
                p += 2;
            }
            const uint32_t high = load_u32(p);
            const uint8_t *qs = p + 4;
            for (int i = 0; i < 16; i++) {
                v[i] = (int8_t)(((qs[i] & 0x0F) | (((high >> i) & 1) << 4)) - offset);
                v[i + 16] = (int8_t)(((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4)) - offset);
            }
            return;
        }
        }
        return;
    }
    const uint8_t *b = row + (sub / 8) * qtype_block_bytes(type);
    const int j = (int)(sub % 8);
    if (type == QTYPE_Q6_K) { /* ql[128], qh[64], int8 scales[16], d */
        const float d = half_to_f32(b + 208);
        const int half = j / 4, k = j % 4;
        const uint8_t *ql = b + 64 * half + 32 * (k & 1), *qh = b + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * half + 2 * k;
        scale[0] = d * sc[0];
        scale[1] = d * sc[1];
        for (int i = 0; i < 32; i++) {
            const int low = k < 2 ? ql[i] & 0x0F : ql[i] >> 4;
            v[i] = (int8_t)((low | (((qh[i] >> (2 * k)) & 3) << 4)) - 32);
        }
        return;
    }
    /* Q4_K: d, dmin, scales[12], qs[128]; Q5_K: the same, then qh[32] before qs */
    const float d = half_to_f32(b), dmin = half_to_f32(b + 2);
    int sc, mn;
    k_scale_min(b + 4, j, &sc, &mn);
    scale[0] = scale[1] = d * (float)sc;
    *min = -dmin * (float)mn;
    const uint8_t *qs = b + (type == QTYPE_Q5_K ? 48 : 16) + 32 * (j / 2);
    for (int i = 0; i < 32; i++) v[i] = (int8_t)(j & 1 ? qs[i] >> 4 : qs[i] & 0x0F);
    if (type == QTYPE_Q5_K) {
        const uint8_t *qh = b + 16;
        for (int i = 0; i < 32; i++) v[i] = (int8_t)(v[i] | (((qh[i] >> j) & 1) << 4));
    }
}

/* Activations quantized per token to 8 bits per 32 values (llama.cpp's Q8_0 idea): for
 * token t, q[t * cols + i] int8, d[t * subs + s] the scale of sub-block s (x ~ d * q),
 * scaled_sums[t * 2 * subs + h] = d times the sum of q over half-sub-block h (16 values),
 * which the types with an offset or a min need, and isums[t * subs + s] the sum of q over
 * sub-block s (the interleaved kernels take offsets off in integers). cols is a multiple
 * of 32; subs = cols / 32. */
typedef struct {
    const int8_t *q;
    const float *d;
    const float *scaled_sums;
    const int32_t *isums;
    int cols;
} quant_acts;

#endif
