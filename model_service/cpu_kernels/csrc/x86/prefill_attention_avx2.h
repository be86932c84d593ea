/* prefill_attention.c's AVX2 level (included by it on x86): the portable eight-lane tile
 * (generic/prefill_attention_tile.h), built for AVX2, FMA and F16C. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static void tile8_avx2(const prefill_call *c, const prefill_seq *seq, int h, int t0) { tile8_cases(c, seq, h, t0); }
#pragma GCC pop_options
