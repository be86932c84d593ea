/* The LoRA kernels' AVX-512F reduction of sixteen registers at once (included by their
 * AVX-512 levels, under the level's target pragma): an expand's sixteen outputs, each
 * summed over its register's lanes, come out in one register, where a reduction each
 * costs its own shuffles and adds. */
#ifndef PAGEDKV_LORA_SUMS_AVX512_H
#define PAGEDKV_LORA_SUMS_AVX512_H

/* Lane i: the sum of v[i]'s lanes. Halves, then quarters, then the four lanes of each
 * quarter are added across registers, which leaves output 4i + k in lane 4k + i: one
 * permute puts them in order. */
static inline __m512 sums16_avx512(const __m512 *v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(y0), _mm512_castps_pd(y1));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(y0), _mm512_castps_pd(y1));
    const __m512 z = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* sums16_avx512's sums over vectors of outputs: lane o of the result is what sums16_avx512
 * gives output o from a register whose lane l is lanes[l]'s lane o (so lanes[l] holds lane
 * l of sixteen outputs' registers). Its adds, followed through the shuffles above:
 * A_e = (l[e] + l[8 + e]) + (l[4 + e] + l[12 + e]) for e < 4, then (A_0 + A_2) + (A_1 + A_3),
 * each add's operands in the same order, so the two give the same bits. */
static inline __m512 tree16_avx512(const __m512 *lanes) {
    __m512 quarter[4];
    for (int e = 0; e < 4; e++)
        quarter[e] = _mm512_add_ps(_mm512_add_ps(lanes[e], lanes[8 + e]), _mm512_add_ps(lanes[4 + e], lanes[12 + e]));
    return _mm512_add_ps(_mm512_add_ps(quarter[0], quarter[2]), _mm512_add_ps(quarter[1], quarter[3]));
}

#endif
