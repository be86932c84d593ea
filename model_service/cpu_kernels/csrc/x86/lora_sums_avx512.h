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

#endif
