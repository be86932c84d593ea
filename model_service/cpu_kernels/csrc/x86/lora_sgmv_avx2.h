/* lora_sgmv.c's AVX2 level (included by it on x86): eight lanes at a time, with FMA. */

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lora_sums_avx2.h"

static float dot_avx2(const float *x, const float *y, int n) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), odd);
    }
    for (; i + 8 <= n; i += 8) even = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), even);
    const __m256 both = _mm256_add_ps(even, odd);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    float sum = _mm_cvtss_f32(half);
    for (; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static void axpy_avx2(float alpha, const float *x, float *y, int n) {
    const __m256 scale = _mm256_set1_ps(alpha);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += alpha * x[i];
}

/* out[o] += s · b's row o for every output: eight outputs at a time, each one's products over
 * the rank's whole vectors in a register, the eight registers reduced together
 * (sums8_avx2), the rank's tail added. */
static void expand_avx2(const float *s, int rank, const float *b, int out_f, float *out) {
    const int whole = rank - rank % 8;
    int o = 0;
    for (; o + 8 <= out_f; o += 8) {
        __m256 lanes[8];
        float tails[8];
        for (int i = 0; i < 8; i++) {
            const float *b_row = b + (int64_t)(o + i) * rank;
            __m256 sum = _mm256_setzero_ps();
            for (int j = 0; j < whole; j += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(s + j), _mm256_loadu_ps(b_row + j), sum);
            lanes[i] = sum;
            float tail = 0.0f;
            for (int j = whole; j < rank; j++) tail += s[j] * b_row[j];
            tails[i] = tail;
        }
        _mm256_storeu_ps(out + o, _mm256_add_ps(_mm256_loadu_ps(out + o),
                                                _mm256_add_ps(sums8_avx2(lanes), _mm256_loadu_ps(tails))));
    }
    for (; o < out_f; o++) out[o] += dot_avx2(s, b + (int64_t)o * rank, rank);
}

/* shrunk[j] = scaling * (x · a's row j) for eight rows of a: each loaded vector of x serves
 * the eight, whose sums are independent chains (a dot product a row is one chain of
 * dependent FMAs), reduced together. */
static void shrink8_avx2(const float *x, const float *a, int in_f, float scaling, float *shrunk) {
    const int whole = in_f - in_f % 8;
    __m256 lanes[8];
    float tails[8];
    PANEL_UNROLL
    for (int i = 0; i < 8; i++) lanes[i] = _mm256_setzero_ps();
    for (int k = 0; k < whole; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        PANEL_UNROLL
        for (int i = 0; i < 8; i++) lanes[i] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(a + (int64_t)i * in_f + k), lanes[i]);
    }
    for (int i = 0; i < 8; i++) {
        float tail = 0.0f;
        for (int k = whole; k < in_f; k++) tail += x[k] * a[(int64_t)i * in_f + k];
        tails[i] = tail;
    }
    _mm256_storeu_ps(shrunk, _mm256_mul_ps(_mm256_set1_ps(scaling), _mm256_add_ps(sums8_avx2(lanes), _mm256_loadu_ps(tails))));
}

static void shrink_avx2(const float *x, const float *a, int rank, int in_f, float scaling, float *shrunk) {
    int j = 0;
    for (; j + 8 <= rank; j += 8) shrink8_avx2(x, a + (int64_t)j * in_f, in_f, scaling, shrunk + j);
    for (; j < rank; j++) shrunk[j] = scaling * dot_avx2(x, a + (int64_t)j * in_f, in_f);
}

#pragma GCC pop_options
