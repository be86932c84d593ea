/* quant_matmul.c's AVX-512 VNNI level (included by it on x86): quant_simd.h with dpbusd for
 * its integer dot products and two interleaved groups a vector, the *_vnni functions. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define QS(name) name##_vnni
#define QS_DOT32(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#define QS_DOT32_ACC(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define QS_X8_FLIP_S8 1
#define QS_X16 1
#include "quant_simd.h"
#undef QS
#undef QS_DOT32
#undef QS_DOT32_ACC
#undef QS_X8_FLIP_S8
#undef QS_X16
#pragma GCC pop_options
