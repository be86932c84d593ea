/* A float32 panel product at the AVX2 level, for bench/f32_panel_product.py only: the
 * bfloat16 kernel's idea (csrc/bf16_matmul.c) with float32 weights, panels of 16 rows
 * [cols][16] (one column of 16 rows a 64-byte line, two 256-bit loads), FMA into float32
 * sums, a token's sums over the columns in order whatever its tile (its bits the same at
 * any batch). The bench measures it against torch's float32 linear to decide whether
 * float32 models should take it; built by the bench with -O3 -march=native -fopenmp. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define ROWS 16
#define PREFETCH 16

void f32_pack(const float *w, int rows, int cols, float *panels) {
    const int count = (rows + ROWS - 1) / ROWS;
    for (int p = 0; p < count; p++)
        for (int k = 0; k < cols; k++)
            for (int r = 0; r < ROWS; r++) {
                const int row = p * ROWS + r;
                panels[((int64_t)p * cols + k) * ROWS + r] = row < rows ? w[(int64_t)row * cols + k] : 0.0f;
            }
}

static inline __attribute__((always_inline)) void tile(const float *panel, int64_t panel_elems, const int NP,
                                                       const float *x, int64_t x_stride, const int NT, int cols,
                                                       float *y, int64_t y_stride, int row0, int rows) {
    __m256 acc[4][2][3];
    for (int p = 0; p < NP; p++)
        for (int t = 0; t < NT; t++) acc[p][0][t] = acc[p][1][t] = _mm256_setzero_ps();
    for (int k = 0; k < cols; k++) {
        for (int p = 0; p < NP; p++)
            _mm_prefetch((const char *)(panel + p * panel_elems + (int64_t)(k + PREFETCH) * ROWS), _MM_HINT_T0);
        for (int p = 0; p < NP; p++) {
            const float *line = panel + p * panel_elems + (int64_t)k * ROWS;
            const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
            for (int t = 0; t < NT; t++) {
                const __m256 xs = _mm256_broadcast_ss(x + t * x_stride + k);
                acc[p][0][t] = _mm256_fmadd_ps(w0, xs, acc[p][0][t]);
                acc[p][1][t] = _mm256_fmadd_ps(w1, xs, acc[p][1][t]);
            }
        }
    }
    for (int p = 0; p < NP; p++) {
        const int first = row0 + p * ROWS, valid = rows - first < ROWS ? rows - first : ROWS;
        for (int t = 0; t < NT; t++) {
            float out[ROWS];
            _mm256_storeu_ps(out, acc[p][0][t]);
            _mm256_storeu_ps(out + 8, acc[p][1][t]);
            memcpy(y + t * y_stride + first, out, (size_t)valid * sizeof(float));
        }
    }
}

static void tile_any(const float *panel, int64_t panel_elems, int np, const float *x, int64_t x_stride, int nt,
                     int cols, float *y, int64_t y_stride, int row0, int rows) {
#define C(NP, NT)                                                                        \
    if (np == NP && nt == NT) {                                                          \
        tile(panel, panel_elems, NP, x, x_stride, NT, cols, y, y_stride, row0, rows);    \
        return;                                                                          \
    }
    C(4, 1) C(2, 1) C(2, 2) C(2, 3) C(1, 1) C(1, 2) C(1, 3)
#undef C
}

void f32_linear(const float *x, int64_t x_stride, int tokens, int cols, int rows, const float *panels, float *y,
                int64_t y_stride, int num_threads) {
    const int num_panels = (rows + ROWS - 1) / ROWS, group = tokens == 1 ? 4 : 2, token_tile = 3;
    const int64_t panel_elems = (int64_t)cols * ROWS;
    const int groups = (num_panels + group - 1) / group;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && groups > 1)
    {
        const int workers = omp_get_num_threads(), me = omp_get_thread_num();
        const int g0 = (int)((int64_t)groups * me / workers), g1 = (int)((int64_t)groups * (me + 1) / workers);
        for (int t0 = 0; t0 < tokens; t0 += 128) {
            const int t_end = t0 + 128 < tokens ? t0 + 128 : tokens;
            for (int g = g0; g < g1; g++) {
                const int p0 = g * group, np = p0 + group <= num_panels ? group : num_panels - p0;
                for (int t = t0; t < t_end; t += token_tile) {
                    const int nt = t + token_tile <= t_end ? token_tile : t_end - t;
                    for (int p = p0; p < p0 + np;) {
                        const int here = np - (p - p0) >= group ? group : 1;
                        tile_any(panels + p * panel_elems, panel_elems, here, x + t * x_stride, x_stride, nt, cols,
                                 y + t * y_stride, y_stride, p * ROWS, rows);
                        p += here;
                    }
                }
            }
        }
    }
}
