/* prefill_attention.c's AVX-512 level (included by it on x86): generic/prefill_attention_tile.h's
 * body at sixteen lanes, one 512-bit vector of queries, keys sixteen a block, built for
 * AVX-512F with AVX2, FMA and F16C (as decode attention's AVX-512 case; cpu_avx512f_avx2
 * checks the CPU has all four): tile16_avx512. It takes float32 pools, at this level and
 * at AVX-512 BF16 (whose dpbf16ps tile takes bfloat16 pools only), and bfloat16 pools at
 * this level, their rows widened to float32 as the eight-lane tile widens them. */

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#define PREFILL_TILE_W 16
#include "../generic/prefill_attention_tile.h"
#undef PREFILL_TILE_W

static void tile16_avx512(const prefill_call *c, const prefill_seq *seq, int h, int t0) {
    tile16_cases(c, seq, h, t0);
}
#pragma GCC pop_options
