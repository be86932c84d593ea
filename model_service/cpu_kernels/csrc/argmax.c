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
 * larger than everything (the first NaN wins). Sixteen lanes each keep their best value
 * and its index (a later index takes a lane only when strictly larger, so each lane
 * keeps its first); the lanes are then merged by value, ties by index.
 */
#include "cpu_math.h"
#include "pagedkv_kernels.h"

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef _Float16 f16x16 __attribute__((vector_size(32), aligned(2)));

static inline __attribute__((always_inline)) f32x16 load16_as_f32(const void *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) {
        f32x16 v;
        memcpy(&v, (const float *)base + i, sizeof v);
        return v;
    }
    if (dtype == DTYPE_BF16) {
        u16x16 h;
        memcpy(&h, (const uint16_t *)base + i, sizeof h);
        return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
    }
    f16x16 h;
    memcpy(&h, (const _Float16 *)base + i, sizeof h);
    return __builtin_convertvector(h, f32x16);
}

/* Whether value a at index ia beats the best so far, b at ib (ib < 0: none yet). */
static inline int beats(float a, int64_t ia, float b, int64_t ib) {
    if (ib < 0) return 1;
    if (b != b) return a != a && ia < ib;  /* a NaN is beaten only by an earlier NaN */
    if (a != a) return 1;
    return a > b || (a == b && ia < ib);
}

static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t offset, int cols, int dtype) {
    f32x16 best = {0};
    i32x16 best_at = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    i32x16 at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int i = 0;
    for (; i + 16 <= cols; i += 16, at += 16) {
        const f32x16 v = load16_as_f32(x, offset + i, dtype);
        /* take a lane: none yet, strictly larger, or the first NaN over a number */
        const i32x16 take = (best_at < 0) | (v > best) | ((v != v) & (best == best));
        best = (f32x16)((take & (i32x16)v) | (~take & (i32x16)best));
        best_at = (take & at) | (~take & best_at);
    }
    float value = 0.0f;
    int64_t index = -1;
    for (int lane = 0; lane < 16; lane++)
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
