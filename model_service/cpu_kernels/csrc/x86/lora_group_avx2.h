/* What the LoRA kernels' grouped rows share at the AVX2 level (lora_group_bf16_avx2.h,
 * lora_group_f32_avx2.h; included under each one's target pragma): lora_group_avx512.h's
 * grouping in eight lanes. b is transposed once for all of an adapter's short rows, eight
 * outputs to a register, and lane l of eight outputs' sums (grouped_lanes_avx2) is added
 * in sums8_avx2's order (tree8_avx2), so each row's delta is the run-by-run kernel's bits.
 * Ranks that are whole eights only. */
#ifndef PAGEDKV_LORA_GROUP_AVX2_H
#define PAGEDKV_LORA_GROUP_AVX2_H

/* sums8_avx2's sums over vectors of outputs (lanes[l] holds lane l of eight outputs'
 * registers): its horizontal adds, followed through, give each output
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline __m256 tree8_avx2(const __m256 *lanes) {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lanes[0], lanes[1]), _mm256_add_ps(lanes[2], lanes[3])),
                         _mm256_add_ps(_mm256_add_ps(lanes[4], lanes[5]), _mm256_add_ps(lanes[6], lanes[7])));
}

/* r transposed in place (lane i of r[l] becomes lane l of r[i]): pairs of lanes, then pairs
 * of pairs within each 128-bit half, then the halves. */
static inline void transpose8_avx2(__m256 *r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Eight values of b from `at` as float32: b bfloat16 where `bf16`, else float32. */
static inline __attribute__((always_inline)) __m256 row8_avx2(const void *b, int bf16, int64_t at) {
    if (!bf16) return _mm256_loadu_ps((const float *)b + at);
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)b + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* b_t[j, o] = b[o, j] as float32 (`bf16`, a constant where inlined, as row8_avx2's), for o
 * below `width` (whole eights of outputs) and j below `rank` (whole eights). */
static inline __attribute__((always_inline)) void transposed_avx2(const void *b, int bf16, int rank, int width,
                                                                  float *b_t) {
    for (int o = 0; o < width; o += 8)
        for (int j = 0; j < rank; j += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = row8_avx2(b, bf16, (int64_t)(o + i) * rank + j);
            transpose8_avx2(r);
            for (int l = 0; l < 8; l++) _mm256_storeu_ps(b_t + (int64_t)(j + l) * width + o, r[l]);
        }
}

/* Outputs [o, o + 8)'s sums over the rank by lane, as the run-by-run expand's registers hold
 * them: lanes[l] = sum over the rank's eights c of s[8c + l] * b[o.., 8c + l], in c's order,
 * the first a product added to zero. */
static inline __attribute__((always_inline)) void grouped_lanes_avx2(const float *s, int rank, const float *b_t,
                                                                     int width, int o, __m256 *lanes) {
    PANEL_UNROLL
    for (int l = 0; l < 8; l++)
        lanes[l] = _mm256_fmadd_ps(_mm256_set1_ps(s[l]), _mm256_loadu_ps(b_t + (int64_t)l * width + o),
                                   _mm256_setzero_ps());
    for (int j = 8; j < rank; j += 8) {
        PANEL_UNROLL
        for (int l = 0; l < 8; l++)
            lanes[l] = _mm256_fmadd_ps(_mm256_set1_ps(s[j + l]), _mm256_loadu_ps(b_t + (int64_t)(j + l) * width + o),
                                       lanes[l]);
    }
}

#endif
