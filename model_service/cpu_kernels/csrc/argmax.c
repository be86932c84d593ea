/* Greedy sampling's argmax: each row's index of its largest value, read in the logits'
 * storage type.
 *
 * With bfloat16 logits the torch path converted the whole [batch, vocab] block to
 * float32 (a pass that wrote twice what it read) and then took numpy's argmax over it;
 * at batch 48 over a 32,000-token vocabulary the two were about 0.8 ms of a 6 ms decode
 * step of the 19M W48 Llama. Converting a value to float32 is exact, so the answer is
 * the same index.
 *
 * Semantics are torch.argmax's: the first index of the maximum, and a NaN counts as
 * larger than everything (the first NaN wins). ARGMAX_LANES lanes each keep their best
 * value and its index (a later index takes a lane only when strictly larger, so each lane
 * keeps its first); the lanes are then merged by value, ties by index, so the answer is the
 * same whatever the lane count. Sixteen lanes where the build has AVX-512, eight otherwise:
 * GCC lowers a vector wider than the machine's through the stack, which on AVX2 made the
 * loop slower than scalar code.
 */
#include "cpu_math.h"
#include "pagedkv_kernels.h"

#if defined(__AVX512F__)
#define ARGMAX_LANES 16
#else
#define ARGMAX_LANES 8
#endif
typedef float lanes_f32 __attribute__((vector_size(4 * ARGMAX_LANES), aligned(4)));
typedef int32_t lanes_i32 __attribute__((vector_size(4 * ARGMAX_LANES)));
typedef uint32_t lanes_u32 __attribute__((vector_size(4 * ARGMAX_LANES)));
typedef uint16_t lanes_u16 __attribute__((vector_size(2 * ARGMAX_LANES), aligned(2)));
typedef _Float16 lanes_f16 __attribute__((vector_size(2 * ARGMAX_LANES), aligned(2)));

static inline __attribute__((always_inline)) lanes_f32 load_lanes_as_f32(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) {
        lanes_f32 v;
        memcpy(&v, (const float *)base + i, sizeof v);
        return v;
    }
    if (dtype == DTYPE_BF16) {
        lanes_u16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (lanes_f32)(__builtin_convertvector(h, lanes_u32) << 16);
    }
    lanes_f16 h;
    memcpy(&h, (const _Float16 *)base + i, sizeof h);
    return __builtin_convertvector(h, lanes_f32);
}

/* Whether value a at index ia beats the best so far, b at ib (ib < 0: none yet). */
static inline int beats(float a, int64_t ia, float b, int64_t ib) {
    if (ib < 0) return 1;
    if (b != b) return a != a && ia < ib;  /* a NaN is beaten only by an earlier NaN */
    if (a != a) return 1;
    return a > b || (a == b && ia < ib);
}

static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t offset, int cols, int dtype) {
    lanes_f32 best = {0};
    lanes_i32 best_at, at;
    for (int lane = 0; lane < ARGMAX_LANES; lane++) {
        best_at[lane] = -1;
        at[lane] = lane;
    }
    int i = 0;
    for (; i + ARGMAX_LANES <= cols; i += ARGMAX_LANES, at += ARGMAX_LANES) {
        const lanes_f32 v = load_lanes_as_f32(x, offset + i, dtype);
        /* take a lane: none yet, strictly larger, or the first NaN over a number */
        const lanes_i32 take = (best_at < 0) | (v > best) | ((v != v) & (best == best));
        best = (lanes_f32)((take & (lanes_i32)v) | (~take & (lanes_i32)best));
        best_at = (take & at) | (~take & best_at);
    }
    float value = 0.0f;
    int64_t index = -1;
    for (int lane = 0; lane < ARGMAX_LANES; lane++)
        if (best_at[lane] >= 0 && beats(best[lane], best_at[lane], value, index)) {
            value = best[lane];
            index = best_at[lane];
        }
    for (; i < cols; i++) { /* the tail: indices after every lane's */
        const float v = load1(x, offset + i, dtype);
        if (beats(v, i, value, index)) {
            value = v;
            index = i;
        }
    }
    return index;
}

/* out[r] = argmax of row r (cols > 0), rows row_stride elements apart. */
void argmax_rows(const void *x, int64_t row_stride, int rows, int cols, int dtype, int64_t *out, int num_threads) {
#define ARGMAX_ROWS(DTYPE)                                                                      \
    _Pragma("omp parallel for num_threads(num_threads) if (rows > 1 && (int64_t)rows * cols >= 65536)") \
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x, (int64_t)r * row_stride, cols, DTYPE);
    switch (dtype) {
    case DTYPE_F32: ARGMAX_ROWS(DTYPE_F32); break;
    case DTYPE_BF16: ARGMAX_ROWS(DTYPE_BF16); break;
    default: ARGMAX_ROWS(DTYPE_F16); break;
    }
#undef ARGMAX_ROWS
}
