/* This step's K and V into their slots of the pool, in place: one call a layer instead of
 * torch's index_copy_ a tensor (and, for an 8-bit pool, the divide, clamp and conversion
 * before it: five dispatches and three temporaries a tensor).
 *
 * k and v: [tokens, kv_size] rows (kv_size = kv_heads * head_dim contiguous), row_stride
 * elements apart, in dtype; k_cache and v_cache: one layer's K and V, [slots, kv_size] in
 * kv_dtype, which is dtype (a copy) or an 8-bit type (values divided by their scale,
 * saturated and rounded: cpu_math.h's f32_to_fp8, what attention/kv_quant.py's quantize
 * gives). A negative slot (a padding row) is skipped.
 *
 * Two levels for the 8-bit conversion (kv_write.py's LEVELS; kv_write_levels, cpu_levels.h's
 * scheme): portable, f32_to_fp8 a value
 * at a time (its branch between subnormal and normal results keeps GCC from vectorizing
 * it), and AVX2, the same steps eight values at a time with both results computed and one
 * selected by mask. The two store the same bytes.
 */
#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"

enum { KV_WRITE_PORTABLE = 0, KV_WRITE_AVX2 = 1 };

/* One row of dtype into an 8-bit one, divided by scale (unless it is 1). */
typedef void (*fp8_row_fn)(const void *src, int64_t src_offset, uint8_t *dst, int kv_size, int dtype, int kv_dtype,
                           float scale);

static void write_row_fp8_portable(const void *src, int64_t src_offset, uint8_t *dst, int kv_size, int dtype,
                                   int kv_dtype, float scale) {
    if (scale == 1.0f) { /* kv_quant.py divides only by a scale other than one */
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype), kv_dtype);
    } else {
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype) / scale, kv_dtype);
    }
}

#if CPU_LEVELS_X86
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
#endif

static const fp8_row_fn kv_write_levels[] = {
    [KV_WRITE_PORTABLE] = write_row_fp8_portable,
    [KV_WRITE_AVX2] = X86_LEVEL(write_row_fp8_avx2),
};
static const cpu_check_fn kv_write_checks[] = {0, X86_LEVEL(cpu_avx2_fma_f16c)};

/* The highest level this CPU runs. */
int kv_write_best_level(void) { return best_level(kv_write_checks); }

static inline __attribute__((always_inline)) void write_row(const void *src, int64_t src_offset, void *cache,
                                                            int64_t slot, int kv_size, int dtype, int kv_dtype,
                                                            float scale, fp8_row_fn fp8_row) {
    const int64_t dst_offset = slot * kv_size;
    if (kv_dtype == dtype) {
        const size_t bytes = dtype == DTYPE_F32 ? 4 : 2;
        memcpy((char *)cache + dst_offset * bytes, (const char *)src + src_offset * bytes, kv_size * bytes);
        return;
    }
    fp8_row(src, src_offset, (uint8_t *)cache + dst_offset, kv_size, dtype, kv_dtype, scale);
}

/* Returns 0, or 1 for a kv_dtype that is neither dtype nor an 8-bit type, 2 for a level
 * above kv_write_best_level. */
int write_kv_at(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
                int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
                float v_scale, int num_threads, int level) {
    if (kv_dtype != dtype && kv_dtype != DTYPE_FP8_E4M3 && kv_dtype != DTYPE_FP8_E5M2) return 1;
    if (level < KV_WRITE_PORTABLE || level > kv_write_best_level()) return 2;
    const fp8_row_fn fp8_row = LEVEL_PICK(kv_write_levels, level);
#pragma omp parallel for num_threads(num_threads) if (tokens > 8 && 2 * (int64_t)tokens * kv_size >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        write_row(k, (int64_t)t * k_row_stride, k_cache, slots[t], kv_size, dtype, kv_dtype, k_scale, fp8_row);
        write_row(v, (int64_t)t * v_row_stride, v_cache, slots[t], kv_size, dtype, kv_dtype, v_scale, fp8_row);
    }
    return 0;
}

/* write_kv_at at the best level this CPU runs (decode_stack.c's call). */
int write_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
             int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
             float v_scale, int num_threads) {
    return write_kv_at(k, k_row_stride, v, v_row_stride, tokens, kv_size, dtype, slots, k_cache, v_cache, kv_dtype,
                       k_scale, v_scale, num_threads, kv_write_best_level());
}
