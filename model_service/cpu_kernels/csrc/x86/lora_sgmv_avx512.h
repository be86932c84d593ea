/* lora_sgmv.c's AVX-512F level (included by it on x86): sixteen lanes at a time, the tail
 * under a mask. */

#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include "lora_sums_avx512.h"

static float dot_avx512(const float *x, const float *y, int n) {
    __m512 sum = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), sum);
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + i), _mm512_maskz_loadu_ps(tail, y + i), sum);
    }
    return _mm512_reduce_add_ps(sum);
}

static void axpy_avx512(float alpha, const float *x, float *y, int n) {
    const __m512 scale = _mm512_set1_ps(alpha);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, tail, _mm512_fmadd_ps(scale, _mm512_maskz_loadu_ps(tail, x + i),
                                                           _mm512_maskz_loadu_ps(tail, y + i)));
    }
}

/* out[o] += s · b's row o for every output: sixteen outputs at a time, each one's products
 * over the rank in a register (its tail under a mask), the sixteen registers reduced
 * together (sums16_avx512). */
static void expand_avx512(const float *s, int rank, const float *b, int out_f, float *out) {
    const __mmask16 tail = (__mmask16)((1u << (rank % 16)) - 1u);
    const int whole = rank - rank % 16;
    int o = 0;
    for (; o + 16 <= out_f; o += 16) {
        __m512 lanes[16];
        for (int i = 0; i < 16; i++) {
            const float *b_row = b + (int64_t)(o + i) * rank;
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < whole; j += 16) sum = _mm512_fmadd_ps(_mm512_loadu_ps(s + j), _mm512_loadu_ps(b_row + j), sum);
            if (tail != 0)
                sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, s + whole), _mm512_maskz_loadu_ps(tail, b_row + whole), sum);
            lanes[i] = sum;
        }
        _mm512_storeu_ps(out + o, _mm512_add_ps(_mm512_loadu_ps(out + o), sums16_avx512(lanes)));
    }
    for (; o < out_f; o++) out[o] += dot_avx512(s, b + (int64_t)o * rank, rank);
}

/* shrunk[j] = scaling * (x · a's row j) for `n` rows of a (n constant where inlined, so the
 * sums stay in registers): each loaded vector of x serves the n rows, whose sums are
 * independent chains, where a dot product a row is one chain of dependent FMAs. */
static inline __attribute__((always_inline)) void shrink_rows_avx512(const float *x, const float *a, int n,
                                                                     int in_f, float scaling, float *shrunk) {
    const int whole = in_f - in_f % 16;
    const __mmask16 tail = (__mmask16)((1u << (in_f % 16)) - 1u);
    __m512 lanes[16];
    PANEL_UNROLL
    for (int i = 0; i < 16; i++) lanes[i] = _mm512_setzero_ps();
    for (int k = 0; k < whole; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        PANEL_UNROLL
        for (int i = 0; i < n; i++) lanes[i] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(a + (int64_t)i * in_f + k), lanes[i]);
    }
    if (tail != 0) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, x + whole);
        PANEL_UNROLL
        for (int i = 0; i < n; i++)
            lanes[i] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, a + (int64_t)i * in_f + whole), lanes[i]);
    }
    _mm512_mask_storeu_ps(shrunk, (__mmask16)((1u << n) - 1u),
                          _mm512_mul_ps(_mm512_set1_ps(scaling), sums16_avx512(lanes)));
}

/* The shrink: sixteen rows of a at a time, then eight, then one by one. */
static void shrink_avx512(const float *x, const float *a, int rank, int in_f, float scaling, float *shrunk) {
    int j = 0;
    for (; j + 16 <= rank; j += 16) shrink_rows_avx512(x, a + (int64_t)j * in_f, 16, in_f, scaling, shrunk + j);
    if (j + 8 <= rank) {
        shrink_rows_avx512(x, a + (int64_t)j * in_f, 8, in_f, scaling, shrunk + j);
        j += 8;
    }
    for (; j < rank; j++) shrunk[j] = scaling * dot_avx512(x, a + (int64_t)j * in_f, in_f);
}

#pragma GCC pop_options
