/* lora_sgmv_bf16.c's AVX2 level (included by it on x86): eight lanes with FMA, a bfloat16
 * widened to float32 by a 16-bit shift of its zero-extended word, rounded back to nearest
 * even with integer operations (cpu_math.h's f32_to_bf16, eight at a time); tails a value
 * at a time. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lora_sums_avx2.h"

static inline __m256 widen8_avx2(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline void store8_avx2(uint16_t *p, __m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    /* packus packs within each 128-bit half: words 0-3 and 4-7 land in quadwords 0 and 2 */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline float sum8_avx2(__m256 v) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}

static float bf16_dot_avx2(const uint16_t *x, const uint16_t *y, int n) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        even = _mm256_fmadd_ps(widen8_avx2(x + i), widen8_avx2(y + i), even);
        odd = _mm256_fmadd_ps(widen8_avx2(x + i + 8), widen8_avx2(y + i + 8), odd);
    }
    for (; i + 8 <= n; i += 8) even = _mm256_fmadd_ps(widen8_avx2(x + i), widen8_avx2(y + i), even);
    float sum = sum8_avx2(_mm256_add_ps(even, odd));
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

/* Outputs [o, out_f) one at a time: an expand's outputs past its last whole eight. */
static void bf16_expand_rest_avx2(const float *s, int rank, const uint16_t *b, int o, int out_f, uint16_t *out) {
    const int whole = rank - rank % 8;
    for (; o < out_f; o++) {
        const uint16_t *b_row = b + (int64_t)o * rank;
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < whole; j += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(s + j), widen8_avx2(b_row + j), sum);
        float tail = 0.0f;
        for (int j = whole; j < rank; j++) tail += s[j] * bf16_to_f32(b_row[j]);
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + (sum8_avx2(sum) + tail));
    }
}

/* Eight outputs at a time: each output's products over the rank's whole vectors in a
 * register, the eight registers reduced together (sums8_avx2), the rank's tail added. */
static void bf16_expand_avx2(const float *s, int rank, const uint16_t *b, int out_f, uint16_t *out) {
    const int whole = rank - rank % 8;
    int o = 0;
    for (; o + 8 <= out_f; o += 8) {
        __m256 lanes[8];
        float tails[8];
        for (int i = 0; i < 8; i++) {
            const uint16_t *b_row = b + (int64_t)(o + i) * rank;
            __m256 sum = _mm256_setzero_ps();
            for (int j = 0; j < whole; j += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(s + j), widen8_avx2(b_row + j), sum);
            lanes[i] = sum;
            float tail = 0.0f;
            for (int j = whole; j < rank; j++) tail += s[j] * bf16_to_f32(b_row[j]);
            tails[i] = tail;
        }
        const __m256 sums = _mm256_add_ps(sums8_avx2(lanes), _mm256_loadu_ps(tails));
        store8_avx2(out + o, _mm256_add_ps(widen8_avx2(out + o), sums));
    }
    bf16_expand_rest_avx2(s, rank, b, o, out_f, out);
}

static void bf16_expand_t_avx2(const float *s, int rank, const float *b_t, int out_f, uint16_t *out) {
    int o = 0;
    for (; o + 8 <= out_f; o += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < rank; j++)
            sum = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_loadu_ps(b_t + (int64_t)j * out_f + o), sum);
        store8_avx2(out + o, _mm256_add_ps(widen8_avx2(out + o), sum));
    }
    for (; o < out_f; o++) {
        float sum = 0.0f;
        for (int j = 0; j < rank; j++) sum += s[j] * b_t[(int64_t)j * out_f + o];
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + sum);
    }
}

static void bf16_add_avx2(float alpha, const float *delta, uint16_t *out, int n) {
    const __m256 scale = _mm256_set1_ps(alpha);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        store8_avx2(out + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(delta + i), widen8_avx2(out + i)));
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(out[i]) + alpha * delta[i]);
}

/* shrunk[j] = scaling * (x · a's row j) for eight rows of a: each widened vector of x serves
 * the eight, whose sums are independent chains (a dot product a row is one chain of
 * dependent FMAs), reduced together. The rows are read from a (bfloat16) or, where `wide`
 * (a constant where inlined), from a_wide, the same rows widened beforehand
 * (lora_group_bf16_avx2.h): the same sums in the same order, so the same bits. */
static inline __attribute__((always_inline)) void shrink8_of_avx2(const uint16_t *x, const uint16_t *a,
                                                                  const float *a_wide, int wide, int in_f,
                                                                  float scaling, float *shrunk) {
    const int whole = in_f - in_f % 8;
    __m256 lanes[8];
    float tails[8];
    PANEL_UNROLL
    for (int i = 0; i < 8; i++) lanes[i] = _mm256_setzero_ps();
    for (int k = 0; k < whole; k += 8) {
        const __m256 xv = widen8_avx2(x + k);
        PANEL_UNROLL
        for (int i = 0; i < 8; i++) {
            const int64_t at = (int64_t)i * in_f + k;
            lanes[i] = _mm256_fmadd_ps(xv, wide ? _mm256_loadu_ps(a_wide + at) : widen8_avx2(a + at), lanes[i]);
        }
    }
    for (int i = 0; i < 8; i++) {
        float tail = 0.0f;
        for (int k = whole; k < in_f; k++) {
            const int64_t at = (int64_t)i * in_f + k;
            tail += bf16_to_f32(x[k]) * (wide ? a_wide[at] : bf16_to_f32(a[at]));
        }
        tails[i] = tail;
    }
    _mm256_storeu_ps(shrunk, _mm256_mul_ps(_mm256_set1_ps(scaling), _mm256_add_ps(sums8_avx2(lanes), _mm256_loadu_ps(tails))));
}

static void bf16_shrink8_avx2(const uint16_t *x, const uint16_t *a, int in_f, float scaling, float *shrunk) {
    shrink8_of_avx2(x, a, NULL, 0, in_f, scaling, shrunk);
}

static void bf16_shrink_avx2(const uint16_t *x, const uint16_t *a, int rank, int in_f, float scaling, float *shrunk) {
    int j = 0;
    for (; j + 8 <= rank; j += 8) bf16_shrink8_avx2(x, a + (int64_t)j * in_f, in_f, scaling, shrunk + j);
    for (; j < rank; j++) shrunk[j] = scaling * bf16_dot_avx2(x, a + (int64_t)j * in_f, in_f);
}

#pragma GCC pop_options
