/* quant_matmul.c's AVX2 level (included by it on x86): quant_simd.h with maddubs for its
 * integer dot products, the *_avx2 functions. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define QS(name) name##_avx2
#define QS_DOT32(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#define QS_DOT32_ACC(acc, u, s) _mm256_add_epi32((acc), QS_DOT32(u, s))
#define QS_X8_FLIP_S8 0 /* maddubs's int16 pairs would saturate on 255 x 127 */
#define QS_X16 0
#include "quant_simd.h"
#undef QS
#undef QS_DOT32
#undef QS_DOT32_ACC
#undef QS_X8_FLIP_S8
#undef QS_X16
#pragma GCC pop_options
