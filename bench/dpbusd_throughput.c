/* Instruction throughput of the products the quantized kernels could use, on this CPU:
 * 256- and 512-bit VNNI dpbusd (int8), AVX512-BF16 dpbf16ps, and 256-bit FMA, each as 12
 * independent chains (more than any latency needs), in cycles an instruction at the
 * clock --ghz names (measure it with a chain of dependent adds, or read it off
 * /proc/cpuinfo). Why csrc/quant_simd.h's AVX-512 tiles take two interleaved groups a
 * 512-bit vector: where a 512-bit dpbusd issues as fast as a 256-bit one, it does twice
 * the work an instruction.
 *
 *     gcc -O3 -march=native bench/dpbusd_throughput.c -o /tmp/dpbusd && /tmp/dpbusd 3.87
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N 200000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS(T, OP, INIT, NAME)                                                                       \
    {                                                                                                   \
        T a0 = INIT, a1 = INIT, a2 = INIT, a3 = INIT, a4 = INIT, a5 = INIT, a6 = INIT, a7 = INIT,       \
          a8 = INIT, a9 = INIT, a10 = INIT, a11 = INIT;                                                 \
        const double start = now();                                                                     \
        for (long k = 0; k < N; k++) {                                                                  \
            a0 = OP(a0); a1 = OP(a1); a2 = OP(a2); a3 = OP(a3); a4 = OP(a4); a5 = OP(a5);               \
            a6 = OP(a6); a7 = OP(a7); a8 = OP(a8); a9 = OP(a9); a10 = OP(a10); a11 = OP(a11);           \
        }                                                                                               \
        const double seconds = now() - start;                                                           \
        __asm__ volatile("" ::"x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5), "x"(a6), "x"(a7),  \
                         "x"(a8), "x"(a9), "x"(a10), "x"(a11));                                         \
        printf("%-22s %.3f cycles an instruction\n", NAME, seconds * ghz * 1e9 / (N * 12.0));           \
    }

static __m256i u256, s256;
static __m512i u512, s512;
static __m256bh x256, y256;
static __m256 f, g;
#define DP256(a) _mm256_dpbusd_epi32(a, u256, s256)
#define DP512(a) _mm512_dpbusd_epi32(a, u512, s512)
#define BF256(a) _mm256_dpbf16_ps(a, x256, y256)
#define FMA256(a) _mm256_fmadd_ps(a, f, g)

int main(int argc, char **argv) {
    const double ghz = argc > 1 ? atof(argv[1]) : 1.0;
    u256 = _mm256_set1_epi8(3);
    s256 = _mm256_set1_epi8(5);
    u512 = _mm512_set1_epi8(3);
    s512 = _mm512_set1_epi8(5);
    x256 = (__m256bh)_mm256_set1_epi16(0x3f80);
    y256 = x256;
    f = _mm256_set1_ps(1.0f);
    g = _mm256_setzero_ps();
    CHAINS(__m256i, DP256, _mm256_setzero_si256(), "dpbusd, 256-bit")
    CHAINS(__m512i, DP512, _mm512_setzero_si512(), "dpbusd, 512-bit")
    CHAINS(__m256, BF256, _mm256_setzero_ps(), "dpbf16ps, 256-bit")
    CHAINS(__m256, FMA256, _mm256_setzero_ps(), "fmadd, 256-bit")
    return 0;
}
