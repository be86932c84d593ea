/* lora_sgmv.c's AVX-512F level (included by it on x86): sixteen lanes at a time, the tail
 * under a mask. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_sums_avx512.h"

static float dot_avx512(const float *x, const float *y, int n) {
    __m512 sum = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), sum);
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + i), _mm512_maskz_loadu_ps(tail, y + i), sum);
    }
    return _mm512_reduce_add_ps(sum);
}

static void axpy_avx512(float alpha, const float *x, float *y, int n) {
    const __m512 scale = _mm512_set1_ps(alpha);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, tail, _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(tail, x + i),
                                                           _mm512_maskz_loadu_ps(tail, y + i)));
    }
}

/* out[o] += s · b's row o for every output: sixteen outputs at a time, each one's products
 * over the rank in a register (its tail under a mask), the sixteen registers reduced
 * together (sums16_avx512). */
static void expand_avx512(const float *s, int rank, const float *b, int out_f, float *out) {
    const __mmask16 tail = (__mmask16)((1u << (rank % 16)) - 1u);
    const int whole = rank - rank % 16;
    int o = 0;
    for (; o + 16 <= out_f; o += 16) {
        __m512 lanes[16];
        for (int i = 0; i < 16; i++) {
            const float *b_row = b + (int64_t)(o + i) * rank;
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < whole; j += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(s + j), _mm512_loadu_ps(b_row + j), sum);
            if (tail != 0)
                sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, s + whole), _mm512_maskz_loadu_ps(tail, b_row + whole), sum);
            lanes[i] = sum;
        }
        _mm512_storeu_ps(out + o, _mm512_add_ps(_mm512_loadu_ps(out + o), sums16_avx512(lanes)));
    }
    for (; o < out_f; o++) out[o] += dot_avx512(s, b + (int64_t)o * rank, rank);
}

#pragma GCC pop_options
