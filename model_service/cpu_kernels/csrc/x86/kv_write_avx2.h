/* kv_write.c's AVX2 level (included by it on x86; its header comment says how the level
 * works): write_row_fp8_avx2. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

/* 8 values of dtype at src + i as float32. */
static inline __attribute__((always_inline)) __m256 load8_f32(const void *src, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))), 16));
    if (dtype == DTYPE_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
    return _mm256_loadu_ps((const float *)src + i);
}

/* f32_to_fp8 eight at a time: the same saturation, the same two roundings. */
static inline __attribute__((always_inline)) __m128i f32x8_to_fp8(__m256 x, int dtype) {
    const int e4m3 = dtype == DTYPE_FP8_E4M3;
    const int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, dropped = 23 - mantissa;
    const __m256 largest = _mm256_set1_ps(e4m3 ? 448.0f : 57344.0f);
    const __m256i bits_in = _mm256_castps_si256(x);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits_in, 24), _mm256_set1_epi32(0x80));
    __m256 magnitude = _mm256_castsi256_ps(_mm256_and_si256(bits_in, _mm256_set1_epi32(0x7fffffff)));
    /* !(magnitude <= largest): past it, inf and NaN alike, saturate */
    magnitude = _mm256_blendv_ps(largest, magnitude, _mm256_cmp_ps(magnitude, largest, _CMP_LE_OQ));
    const __m256i bits = _mm256_castps_si256(magnitude);
    /* below the smallest normal: a multiple of the smallest subnormal, nearest even */
    const __m256i subnormal = _mm256_cvtps_epi32(_mm256_round_ps(
        _mm256_mul_ps(magnitude, _mm256_set1_ps(e4m3 ? 512.0f : 65536.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* normal: the bits rounded at the mantissa's width, the exponent rebased */
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, dropped), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32((1 << (dropped - 1)) - 1), odd));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, dropped),
                                            _mm256_set1_epi32((127 - bias) << mantissa));
    const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32((128 - bias) << 23), bits);
    const __m256i code = _mm256_or_si256(_mm256_blendv_epi8(normal, subnormal, is_subnormal), sign);
    /* byte 0 of each 32-bit lane, in order */
    const __m256i bytes = _mm256_shuffle_epi8(code, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                     -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                                                     -1, -1, -1, -1, -1, -1));
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
}

static void write_row_fp8_avx2(const void *src, int64_t src_offset, uint8_t *dst, int kv_size, int dtype,
                               int kv_dtype, float scale) {
    const __m256 divisor = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 8 <= kv_size; i += 8) {
        __m256 x = load8_f32(src, src_offset + i, dtype);
        if (scale != 1.0f) x = _mm256_div_ps(x, divisor); /* a division, as kv_quant.py's: not a reciprocal */
        _mm_storel_epi64((__m128i *)(dst + i), f32x8_to_fp8(x, kv_dtype));
    }
    for (; i < kv_size; i++) {
        const float x = load1(src, src_offset + i, dtype);
        dst[i] = f32_to_fp8(scale == 1.0f ? x : x / scale, kv_dtype);
    }
}
#pragma GCC pop_options
