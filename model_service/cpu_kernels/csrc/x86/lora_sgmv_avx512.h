/* lora_sgmv.c's AVX-512F level (included by it on x86): sixteen lanes at a time, the tail
 * under a mask. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

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

#pragma GCC pop_options
