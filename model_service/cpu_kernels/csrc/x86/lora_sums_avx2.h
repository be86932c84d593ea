/* The LoRA kernels' AVX2 reduction of eight registers at once (included by their AVX2
 * levels, under the level's target pragma): an expand's eight outputs, each summed over
 * its register's lanes, come out in one register, where a reduction each costs its own
 * shuffles and adds. */
#ifndef PAGEDKV_LORA_SUMS_AVX2_H
#define PAGEDKV_LORA_SUMS_AVX2_H

/* Lane i: the sum of v[i]'s lanes. */
static inline __m256 sums8_avx2(const __m256 *v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

#endif
