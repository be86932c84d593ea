/* lora_sgmv_bf16.c's AVX-512F level (included by it on x86): sixteen lanes, a bfloat16
 * widened by a 16-bit shift of its zero-extended word, rounded back to nearest even with
 * integer operations and narrowed by vpmovdw. AVX-512F alone has no 16-bit masked loads
 * (those are AVX-512BW's), so a tail of eight goes through a 128-bit load, zero-extended,
 * and what is left a value at a time. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_sums_avx512.h"

static inline __m512 widen16_avx512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Eight values in the low lanes, zeros above. */
static inline __m512 widen8_avx512(const uint16_t *p) {
    const __m256i words = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16));
}

static inline void store16_avx512(uint16_t *p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i chosen = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(chosen, 16)));
}

static float bf16_dot_avx512(const uint16_t *x, const uint16_t *y, int n) {
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        even = _mm512_fmadd_ps(widen16_avx512(x + i), widen16_avx512(y + i), even);
        odd = _mm512_fmadd_ps(widen16_avx512(x + i + 16), widen16_avx512(y + i + 16), odd);
    }
    for (; i + 16 <= n; i += 16) even = _mm512_fmadd_ps(widen16_avx512(x + i), widen16_avx512(y + i), even);
    if (i + 8 <= n) {
        odd = _mm512_fmadd_ps(widen8_avx512(x + i), widen8_avx512(y + i), odd);
        i += 8;
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

/* s · b's row: the lanes' partial sums (a register), the rank's last rank % 8 terms in *tail. */
static inline __m512 expand_lanes_avx512(const float *s, int rank, const uint16_t *b_row, float *tail) {
    __m512 sum = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= rank; j += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(s + j), widen16_avx512(b_row + j), sum);
    if (j + 8 <= rank) {
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(0xff, s + j), widen8_avx512(b_row + j), sum);
        j += 8;
    }
    float rest = 0.0f;
    for (; j < rank; j++) rest += s[j] * bf16_to_f32(b_row[j]);
    *tail = rest;
    return sum;
}

/* Outputs [o, out_f) one at a time: an expand's outputs past its last whole sixteen. */
static void bf16_expand_rest_avx512(const float *s, int rank, const uint16_t *b, int o, int out_f, uint16_t *out) {
    for (; o < out_f; o++) {
        float tail;
        const float sum = _mm512_reduce_add_ps(expand_lanes_avx512(s, rank, b + (int64_t)o * rank, &tail)) + tail;
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + sum);
    }
}

/* Sixteen outputs at a time, their sixteen registers reduced together (sums16_avx512). */
static void bf16_expand_avx512(const float *s, int rank, const uint16_t *b, int out_f, uint16_t *out) {
    int o = 0;
    for (; o + 16 <= out_f; o += 16) {
        __m512 lanes[16];
        float tails[16];
        for (int i = 0; i < 16; i++) lanes[i] = expand_lanes_avx512(s, rank, b + (int64_t)(o + i) * rank, &tails[i]);
        const __m512 sums = _mm512_add_ps(sums16_avx512(lanes), _mm512_loadu_ps(tails));
        store16_avx512(out + o, _mm512_add_ps(widen16_avx512(out + o), sums));
    }
    bf16_expand_rest_avx512(s, rank, b, o, out_f, out);
}

static void bf16_expand_t_avx512(const float *s, int rank, const float *b_t, int out_f, uint16_t *out) {
    int o = 0;
    for (; o + 16 <= out_f; o += 16) {
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < rank; j++)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), _mm512_loadu_ps(b_t + (int64_t)j * out_f + o), sum);
        store16_avx512(out + o, _mm512_add_ps(widen16_avx512(out + o), sum));
    }
    for (; o < out_f; o++) {
        float sum = 0.0f;
        for (int j = 0; j < rank; j++) sum += s[j] * b_t[(int64_t)j * out_f + o];
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + sum);
    }
}

static void bf16_add_avx512(float alpha, const float *delta, uint16_t *out, int n) {
    const __m512 scale = _mm512_set1_ps(alpha);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        store16_avx512(out + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(delta + i), widen16_avx512(out + i)));
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(out[i]) + alpha * delta[i]);
}

/* shrunk[j] = scaling * (x · a's row j) for `n` rows of a (n constant where inlined, so the
 * sums stay in registers): each widened vector of x serves the n rows, whose sums are
 * independent chains, where a dot product a row is one chain of dependent FMAs. The rows
 * are read from a (bfloat16) or, where `wide` (a constant where inlined), from a_wide, the
 * same rows widened to float32 beforehand (lora_group_bf16_avx512.h): widening is exact, and the
 * sums run in the same order either way, so both give the same bits. */
static inline __attribute__((always_inline)) void shrink_rows_of_avx512(const uint16_t *x, const uint16_t *a,
                                                                        const float *a_wide, int wide, int n,
                                                                        int in_f, float scaling, float *shrunk) {
    __m512 lanes[16];
    float tails[16] = {0};
    PANEL_UNROLL
    for (int i = 0; i < 16; i++) lanes[i] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= in_f; k += 16) {
        const __m512 xv = widen16_avx512(x + k);
        PANEL_UNROLL
        for (int i = 0; i < n; i++) {
            const int64_t at = (int64_t)i * in_f + k;
            lanes[i] = _mm512_fmadd_ps(xv, wide ? _mm512_loadu_ps(a_wide + at) : widen16_avx512(a + at), lanes[i]);
        }
    }
    if (k + 8 <= in_f) {
        const __m512 xv = widen8_avx512(x + k);
        PANEL_UNROLL
        for (int i = 0; i < n; i++) {
            const int64_t at = (int64_t)i * in_f + k;
            lanes[i] = _mm512_fmadd_ps(xv, wide ? _mm512_maskz_loadu_ps(0xff, a_wide + at) : widen8_avx512(a + at),
                                       lanes[i]);
        }
        k += 8;
    }
    for (int i = 0; i < n; i++)
        for (int t = k; t < in_f; t++) {
            const int64_t at = (int64_t)i * in_f + t;
            tails[i] += bf16_to_f32(x[t]) * (wide ? a_wide[at] : bf16_to_f32(a[at]));
        }
    const __m512 sums = _mm512_add_ps(sums16_avx512(lanes), _mm512_loadu_ps(tails));
    _mm512_mask_storeu_ps(shrunk, (__mmask16)((1u << n) - 1u), _mm512_mul_ps(_mm512_set1_ps(scaling), sums));
}

static inline __attribute__((always_inline)) void bf16_shrink_rows_avx512(const uint16_t *x, const uint16_t *a, int n,
                                                                          int in_f, float scaling, float *shrunk) {
    shrink_rows_of_avx512(x, a, NULL, 0, n, in_f, scaling, shrunk);
}

/* The shrink: sixteen rows of a at a time, then eight, then one by one. */
static void bf16_shrink_avx512(const uint16_t *x, const uint16_t *a, int rank, int in_f, float scaling,
                               float *shrunk) {
    int j = 0;
    for (; j + 16 <= rank; j += 16) bf16_shrink_rows_avx512(x, a + (int64_t)j * in_f, 16, in_f, scaling, shrunk + j);
    if (j + 8 <= rank) {
        bf16_shrink_rows_avx512(x, a + (int64_t)j * in_f, 8, in_f, scaling, shrunk + j);
        j += 8;
    }
    for (; j < rank; j++) shrunk[j] = scaling * bf16_dot_avx512(x, a + (int64_t)j * in_f, in_f);
}

#pragma GCC pop_options
