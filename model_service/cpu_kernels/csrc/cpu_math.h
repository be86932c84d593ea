/* What the CPU kernels share: storage types, rows converted to and from float32, a
 * vectorizable exp, and a dot product that reduces by a tree (see dot).
 *
 * No file that includes this may be built with -ffast-math: exp_f32 rounds by adding and
 * subtracting 1.5 * 2^23, which reassociation would fold away. */
#ifndef PAGEDKV_CPU_MATH_H
#define PAGEDKV_CPU_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2, DTYPE_FP8_E4M3 = 3, DTYPE_FP8_E5M2 = 4 };

/* An 8-bit float's bits as a float16's, shifted into place: e5m2 is float16's top byte
 * exactly (5 exponent bits, bias 15); e4m3 (bias 7) lands 2^8 too small, for normal and
 * subnormal values alike, so the caller multiplies by FP8_UNIT (folded into its scales,
 * never a multiply per element). e4m3fn's NaN (0x7f) would read as 480: pools never hold
 * one, writes saturate (attention/kv_quant.py). */
static inline __attribute__((always_inline)) uint16_t fp8_as_f16_bits(uint8_t b, int dtype) {
    const int shift = dtype == DTYPE_FP8_E4M3 ? 7 : 8;
    return (uint16_t)(((uint16_t)(b & 0x7fu) << shift) | ((uint16_t)(b & 0x80u) << 8));
}

static inline float fp8_unit(int dtype) { return dtype == DTYPE_FP8_E4M3 ? 256.0f : 1.0f; }

/* n 8-bit values as float32, in units of fp8_unit(dtype). */
static inline void load_row_fp8(float *restrict dst, const uint8_t *src, int n, int dtype) {
#pragma omp simd
    for (int i = 0; i < n; i++) {
        const uint16_t bits = fp8_as_f16_bits(src[i], dtype);
        _Float16 h;
        memcpy(&h, &bits, sizeof h);
        dst[i] = (float)h;
    }
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i at base, as float32 (exact), and back (rounded to nearest even). */
static inline __attribute__((always_inline)) float load1(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    if (dtype == DTYPE_F16) return (float)((const _Float16 *)base)[i];
    return ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store1(void *base, int64_t i, float x, int dtype) {
    if (dtype == DTYPE_BF16) ((uint16_t *)base)[i] = f32_to_bf16(x);
    else if (dtype == DTYPE_F16) ((_Float16 *)base)[i] = (_Float16)x;
    else ((float *)base)[i] = x;
}

/* Row i of length n (elements) at base, converted to float32 into dst (8-bit rows in
 * units of fp8_unit). */
static inline void load_row(float *restrict dst, const void *base, int64_t offset, int n, int dtype) {
    if (dtype == DTYPE_FP8_E4M3 || dtype == DTYPE_FP8_E5M2) {
        load_row_fp8(dst, (const uint8_t *)base + offset, n, dtype);
    } else if (dtype == DTYPE_F32) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        const _Float16 *src = (const _Float16 *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)src[i];
    }
}

static inline void store_row(void *base, int64_t offset, const float *restrict src, int n, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    } else if (dtype == DTYPE_BF16) {
        uint16_t *dst = (uint16_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        _Float16 *dst = (_Float16 *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (_Float16)src[i];
    }
}

/* exp(x) in float32, vectorizable (libm's expf is a call per element): x = k ln2 + r
 * with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (error below 2 ulp over that
 * range), times 2^k built in the exponent bits. x is clamped to [-87, 88], inside
 * float32's normal range: exp(-87) is about 1.6e-38, exp(88) about 1.7e38. */
static inline float exp_f32(float x) {
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    /* nearest integer by the 1.5 * 2^23 trick: vectorizes, where roundf is a call */
    float k = (x * 1.4426950408889634f + 12582912.0f) - 12582912.0f;
    float r = (x - k * ln2_hi) - k * ln2_lo;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Sixteen float32 lanes: GCC's vector extension, lowered to AVX-512, AVX2 or NEON. */
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* Sum of a[i] * b[i]. By lanes of 16, then a tree over the lanes: a plain reduction loop
 * compiles (without -ffast-math, which these files must not have: see above) to
 * a chain of 16 dependent scalar adds, and that chain was most of the kernel's time. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int n) {
    f32x16 lanes = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        f32x16 x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        lanes += x * y;
    }
    lanes += __builtin_shuffle(lanes, (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    lanes += __builtin_shuffle(lanes, (i32x16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    lanes += __builtin_shuffle(lanes, (i32x16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    float sum = lanes[0] + lanes[1];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#endif
