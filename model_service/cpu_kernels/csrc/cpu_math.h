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
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

/* Below this many elements an elementwise op (a norm, SiLU, rotary, a K/V write) runs on
 * the calling thread: waking the other threads and waiting for the slowest costs more than
 * the work, and on a machine whose cores are all busy a parallel region waits for a
 * descheduled thread. A row's result does not depend on which thread computes it. */
#define PARALLEL_MIN_ELEMENTS 32768

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2, DTYPE_FP8_E4M3 = 3, DTYPE_FP8_E5M2 = 4 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rounded to nearest even, as torch does; a NaN stays a (quiet) NaN. The NaN case is a
 * select by mask, not a branch: without AVX-512's masked stores GCC left every loop that
 * stores bfloat16 through a branch here scalar (SiLU-and-multiply among them). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    const uint32_t is_nan = 0u - (uint32_t)((bits & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((quiet_nan & is_nan) | (rounded & ~is_nan));
}

/* 8-bit floats, read as float32 in units of fp8_unit(dtype) (e4m3's values come out 2^8
 * too small; the caller folds the 2^8 into its scales, never a multiply per element).
 *
 * The AVX-512 case (x86/paged_decode_avx512.h) widens a byte to float16 bits and converts in
 * hardware: e5m2 is float16's top byte exactly (5 exponent bits, bias 15), and e4m3's
 * magnitude shifted by 7 is a float16 2^8 too small (bias 7 against 15), subnormals
 * included. Here, without a vector float16 conversion (GCC turned `(float)_Float16` into a
 * call per value on AVX2: 2.7x the bfloat16 kernel's time), the same values are built as
 * float32 bits with integer operations that vectorize: the magnitude shifted into float32's
 * exponent and mantissa and the exponent rebased by an add (normal values), or the
 * magnitude times its weight (subnormal ones, exponent field 0), then the sign.
 * e4m3fn's NaN (0x7f) would read as 480: pools never hold one, writes saturate
 * (attention/kv_quant.py). */
static inline float fp8_unit(int dtype) { return dtype == DTYPE_FP8_E4M3 ? 256.0f : 1.0f; }

static inline __attribute__((always_inline)) float fp8_to_f32_units(uint8_t byte, int shift, uint32_t min_normal,
                                                                    float subnormal_weight) {
    const uint32_t magnitude = byte & 0x7fu, sign = (uint32_t)(byte & 0x80u) << 24;
    const uint32_t normal_bits = (magnitude << shift) + (112u << 23);
    const float subnormal = (float)(int32_t)magnitude * subnormal_weight;
    uint32_t subnormal_bits;
    memcpy(&subnormal_bits, &subnormal, sizeof subnormal_bits);
    /* a select by mask, not a branch: GCC left the loop scalar with `?:` on floats */
    const uint32_t is_normal = 0u - (uint32_t)(magnitude >= min_normal);
    const uint32_t bits = ((normal_bits & is_normal) | (subnormal_bits & ~is_normal)) | sign;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* n 8-bit values as float32, in units of fp8_unit(dtype). With F16C (x86-64 since 2012),
 * 16 at a time as the AVX-512 case does: widened to float16 bits (the magnitude shifted by
 * 7 for e4m3, 8 for e5m2; the sign to bit 15), converted in hardware. At SmolLM2's decode
 * shape (batch 48, 3 KV heads, group 3, head_dim 64) on AVX2, one thread, in turns: 0.9x
 * the bfloat16 kernel's time this way, 1.2-1.3x with the integer method alone. */
static inline void load_row_fp8(float *restrict dst, const uint8_t *src, int n, int dtype) {
    /* e4m3: 3 mantissa bits, normal from exponent field 1 (magnitude 8), subnormal m x 2^-9
     * (2^-17 in units of 2^8); e5m2: 2 bits, from magnitude 4, m x 2^-16. */
    const int e4m3 = dtype == DTYPE_FP8_E4M3;
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    const __m128i half_shift = _mm_cvtsi32_si128(e4m3 ? 7 : 8);
    for (; i + 16 <= n; i += 16) {
        const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        const __m256i half = _mm256_or_si256(
            _mm256_sll_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x7f)), half_shift),
            _mm256_slli_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(0x80)), 8));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm256_castsi256_si128(half)));
        _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)));
    }
#endif
    const int shift = e4m3 ? 20 : 21;
    const uint32_t min_normal = e4m3 ? 8u : 4u;
    const float subnormal_weight = e4m3 ? 0x1p-17f : 0x1p-16f;
#pragma omp simd
    for (int j = i; j < n; j++) dst[j] = fp8_to_f32_units(src[j], shift, min_normal, subnormal_weight);
}

/* x as an 8-bit float: saturated to the type's largest finite value (e4m3 448, e5m2
 * 57344; NaN too, which a pool must never hold), then rounded to nearest even, as
 * attention/kv_quant.py's clamp and torch's conversion do. Normal results: the float32
 * bits rounded at the type's mantissa width and the exponent rebased by a subtraction;
 * below the smallest normal (2^-6, 2^-14), a multiple of the smallest subnormal (2^-9,
 * 2^-16) rounded by nearbyintf (the default rounding mode, nearest even). */
static inline __attribute__((always_inline)) uint8_t f32_to_fp8(float x, int dtype) {
    const int e4m3 = dtype == DTYPE_FP8_E4M3;
    const int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const float largest = e4m3 ? 448.0f : 57344.0f, subnormal_units = e4m3 ? 512.0f : 65536.0f;
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    float magnitude = fabsf(x);
    if (!(magnitude <= largest)) magnitude = largest;
    memcpy(&bits, &magnitude, sizeof bits);
    uint32_t code;
    if (bits < ((uint32_t)(128 - bias) << 23)) {
        code = (uint32_t)nearbyintf(magnitude * subnormal_units);
    } else {
        const int dropped = 23 - mantissa;
        bits += ((1u << (dropped - 1)) - 1u) + ((bits >> dropped) & 1u);
        code = (bits >> dropped) - ((uint32_t)(127 - bias) << mantissa);
    }
    return (uint8_t)(sign | code);
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
 * float32's normal range: exp(-87) is about 1.6e-38, exp(88) about 1.7e38.
 * Always inlined: a call is one element at a time, and GCC stops inlining it on its own
 * where a file's optimize pragma lowers the level (x86/paged_decode_avx512.h's O2). */
static inline __attribute__((always_inline)) float exp_f32(float x) {
    const float ln2_hi = 0.693145751953125f, ln2_lo = 1.428606765330187e-06f;
    /* x < -87 ? -87 : x > 88 ? 88 : x (a NaN stays NaN), as a select by masks: GCC left
     * every loop calling this scalar with `?:` on floats where AVX-512's masks were missing. */
    const float low = -87.0f, high = 88.0f;
    uint32_t x_bits, low_bits, high_bits;
    memcpy(&x_bits, &x, sizeof x_bits);
    memcpy(&low_bits, &low, sizeof low_bits);
    memcpy(&high_bits, &high, sizeof high_bits);
    const uint32_t below = 0u - (uint32_t)(x < low), above = 0u - (uint32_t)(x > high);
    x_bits = (low_bits & below) | (high_bits & above) | (x_bits & ~(below | above));
    memcpy(&x, &x_bits, sizeof x);
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
