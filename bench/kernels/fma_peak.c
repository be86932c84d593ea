/* The FMA peak of one thread at each vector width: twelve independent chains of fused
 * multiply-adds on registers, nothing loaded or stored, so the loop runs at the core's
 * FMA issue rate. bench/kernels/fma_peak.py builds it and reports GFLOP/s a level, the
 * ceiling the panel kernels' GFLOP/s are read against.
 *
 * Each function returns the sum of its chains, so the compiler keeps the loop. */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

__attribute__((target("avx2,fma"))) float fma_peak_avx2(int64_t iterations) {
    __m256 acc[CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
    for (int64_t i = 0; i < iterations; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    }
    __m256 total = acc[0];
    for (int c = 1; c < CHAINS; c++) total = _mm256_add_ps(total, acc[c]);
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    return lanes[0] + lanes[7];
}

__attribute__((target("avx512f"))) float fma_peak_avx512(int64_t iterations) {
    __m512 acc[CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
    for (int64_t i = 0; i < iterations; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
    }
    __m512 total = acc[0];
    for (int c = 1; c < CHAINS; c++) total = _mm512_add_ps(total, acc[c]);
    return _mm512_reduce_add_ps(total);
}
