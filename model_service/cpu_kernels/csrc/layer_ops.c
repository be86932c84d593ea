/* A decoder layer's elementwise work, fused: RMSNorm (with the residual add before it),
 * SiLU-and-multiply, and rotary embedding in place.
 *
 * In eager torch each of these is several ops, each a pass over the activations and a
 * dispatch of its own: a bfloat16 RMSNorm was seven (to float32, pow, mean, add, rsqrt,
 * mul, back, times the weight), rotary six. At one stream of a 30-layer model the
 * dispatches cost more than the arithmetic; in a prefill the passes do.
 *
 * Rounding follows the torch code they replace (models/fused_ops.py has it): float32
 * arithmetic, rounded to the storage type wherever that code holds a 16-bit
 * intermediate, so bfloat16 results match it up to float32 summation order.
 *
 * Every function takes the thread count to use (see paged_decode.c) and splits rows.
 */
#include "cpu_math.h"
#include "pagedkv_kernels.h"

/* A value as the storage type holds it (a 16-bit torch op rounds its output). */
static inline __attribute__((always_inline)) float round_to(float x, int dtype) {
    if (dtype == DTYPE_BF16) return bf16_to_f32(f32_to_bf16(x));
    if (dtype == DTYPE_F16) return (float)(_Float16)x;
    return x;
}

/* Calls BODY with dtype a compile-time constant, so each case vectorizes on its own. */
#define FOR_DTYPE(dtype, BODY)                 \
    switch (dtype) {                           \
    case DTYPE_F32: BODY(DTYPE_F32); break;    \
    case DTYPE_BF16: BODY(DTYPE_BF16); break;  \
    default: BODY(DTYPE_F16); break;           \
    }

/* out = weight * norm(x), norm(x) = x / sqrt(mean(x^2) + eps) in float32; 16-bit types
 * round norm(x) before the weight multiplies it (transformers' LlamaRMSNorm). */
static inline __attribute__((always_inline)) void norm_row(const void *x, int64_t x_offset, const void *weight,
                                                           void *out, int64_t out_offset, int cols, float eps,
                                                           int dtype) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < cols; i++) {
        const float v = load1(x, x_offset + i, dtype);
        squares += v * v;
    }
    const float inv = 1.0f / sqrtf(squares / (float)cols + eps);
#pragma omp simd
    for (int i = 0; i < cols; i++) {
        const float normed = load1(x, x_offset + i, dtype) * inv;
        store1(out, out_offset + i, load1(weight, i, dtype) * round_to(normed, dtype), dtype);
    }
}

void rms_norm(const void *x, int64_t x_row_stride, const void *weight, void *out, int rows, int cols,
              float eps, int dtype, int num_threads) {
    const int64_t elements = (int64_t)rows * cols;
#define RMS_NORM(DT)                                                                             \
    _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && elements >= PARALLEL_MIN_ELEMENTS)") \
    for (int r = 0; r < rows; r++) norm_row(x, (int64_t)r * x_row_stride, weight, out, (int64_t)r * cols, cols, eps, DT);
    FOR_DTYPE(dtype, RMS_NORM)
#undef RMS_NORM
}

/* hidden += delta (rounded to the storage type, as torch's add is), then
 * out = rms_norm(hidden): the residual add and the next norm in one pass. hidden and out
 * are contiguous [rows, cols]; delta rows are delta_row_stride apart. */
void add_rms_norm(void *hidden, const void *delta, int64_t delta_row_stride, const void *weight, void *out,
                  int rows, int cols, float eps, int dtype, int num_threads) {
    const int64_t elements = (int64_t)rows * cols;
#define ADD_RMS_NORM(DT)                                                                         \
    _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && elements >= PARALLEL_MIN_ELEMENTS)") \
    for (int r = 0; r < rows; r++) {                                                             \
        const int64_t row = (int64_t)r * cols, delta_row = (int64_t)r * delta_row_stride;        \
        _Pragma("omp simd")                                                                      \
        for (int i = 0; i < cols; i++)                                                           \
            store1(hidden, row + i, load1(hidden, row + i, DT) + load1(delta, delta_row + i, DT), DT); \
        norm_row(hidden, row, weight, out, row, cols, eps, DT);                                  \
    }
    FOR_DTYPE(dtype, ADD_RMS_NORM)
#undef ADD_RMS_NORM
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up is contiguous
 * [rows, 2 * inter] (the fused gate/up projection), out contiguous [rows, inter]. */
void silu_mul(const void *gate_up, void *out, int rows, int inter, int dtype, int num_threads) {
    const int64_t elements = (int64_t)rows * inter;
#define SILU_MUL(DT)                                                                             \
    _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && elements >= PARALLEL_MIN_ELEMENTS)") \
    for (int r = 0; r < rows; r++) {                                                             \
        const int64_t in_row = (int64_t)r * 2 * inter, out_row = (int64_t)r * inter;             \
        _Pragma("omp simd")                                                                      \
        for (int i = 0; i < inter; i++) {                                                        \
            const float gate = load1(gate_up, in_row + i, DT);                                   \
            const float silu = round_to(gate / (1.0f + exp_f32(-gate)), DT);                     \
            store1(out, out_row + i, silu * load1(gate_up, in_row + inter + i, DT), DT);         \
        }                                                                                        \
    }
    FOR_DTYPE(dtype, SILU_MUL)
#undef SILU_MUL
}

/* Rotates heads [0, heads) of every row of x in place, half-split (transformers'
 * rotate_half): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin from tables
 * [positions, head_dim / 2] in the storage type at each row's position. Rows are
 * x_row_stride apart, heads head_dim apart (q and k heads of the fused projection). */
void rotary_in_place(void *x, int64_t x_row_stride, int rows, int heads, int head_dim, const void *cos_table,
                     const void *sin_table, const int64_t *positions, int dtype, int num_threads) {
    const int half = head_dim / 2;
    const int64_t elements = (int64_t)rows * heads * head_dim;
#define ROTARY(DT)                                                                               \
    _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && elements >= PARALLEL_MIN_ELEMENTS)") \
    for (int r = 0; r < rows; r++) {                                                             \
        const int64_t table_row = positions[r] * half;                                           \
        for (int h = 0; h < heads; h++) {                                                        \
            const int64_t head = (int64_t)r * x_row_stride + (int64_t)h * head_dim;              \
            _Pragma("omp simd")                                                                  \
            for (int i = 0; i < half; i++) {                                                     \
                const float c = load1(cos_table, table_row + i, DT), s = load1(sin_table, table_row + i, DT); \
                const float x1 = load1(x, head + i, DT), x2 = load1(x, head + half + i, DT);     \
                store1(x, head + i, round_to(x1 * c, DT) - round_to(x2 * s, DT), DT);            \
                store1(x, head + half + i, round_to(x2 * c, DT) + round_to(x1 * s, DT), DT);     \
            }                                                                                    \
        }                                                                                        \
    }
    FOR_DTYPE(dtype, ROTARY)
#undef ROTARY
}
