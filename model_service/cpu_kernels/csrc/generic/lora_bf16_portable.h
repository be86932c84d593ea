/* lora_sgmv_bf16.c's portable level (included by it): sixteen lanes of GCC's vector
 * extension (cpu_math.h's f32x16), a bfloat16 widened by a shift and rounded back to
 * nearest even with integer operations, as cpu_math.h's scalar conversions do; tails a
 * value at a time. */

typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) f32x16 widen16_portable(const uint16_t *p) {
    u16x16 half;
    memcpy(&half, p, sizeof half);
    return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
}

static inline __attribute__((always_inline)) void store16_portable(uint16_t *p, f32x16 v) {
    const u32x16 bits = (u32x16)v, nan = (u32x16)(v != v);
    const u32x16 rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    const u16x16 half = __builtin_convertvector(((rounded & ~nan) | ((bits | 0x400000u) & nan)) >> 16, u16x16);
    memcpy(p, &half, sizeof half);
}

static inline __attribute__((always_inline)) f32x16 load16_portable(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The lanes' sum, by a tree (cpu_math.h's dot says why). */
static inline __attribute__((always_inline)) float sum16_portable(f32x16 lanes) {
    lanes += __builtin_shuffle(lanes, (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    lanes += __builtin_shuffle(lanes, (i32x16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    lanes += __builtin_shuffle(lanes, (i32x16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    return lanes[0] + lanes[1];
}

static float bf16_dot_portable(const uint16_t *x, const uint16_t *y, int n) {
    f32x16 lanes = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) lanes += widen16_portable(x + i) * widen16_portable(y + i);
    float sum = sum16_portable(lanes);
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    return sum;
}

/* s · b's row o, its first rank - rank % 16 terms by lanes. */
static inline float expand_dot_portable(const float *s, int rank, const uint16_t *b_row) {
    f32x16 lanes = {0};
    int j = 0;
    for (; j + 16 <= rank; j += 16) lanes += load16_portable(s + j) * widen16_portable(b_row + j);
    float sum = sum16_portable(lanes);
    for (; j < rank; j++) sum += s[j] * bf16_to_f32(b_row[j]);
    return sum;
}

static void bf16_expand_portable(const float *s, int rank, const uint16_t *b, int out_f, uint16_t *out) {
    for (int o = 0; o < out_f; o++)
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + expand_dot_portable(s, rank, b + (int64_t)o * rank));
}

static void bf16_expand_t_portable(const float *s, int rank, const float *b_t, int out_f, uint16_t *out) {
    int o = 0;
    for (; o + 16 <= out_f; o += 16) {
        f32x16 sum = {0};
        for (int j = 0; j < rank; j++) sum += s[j] * load16_portable(b_t + (int64_t)j * out_f + o);
        store16_portable(out + o, widen16_portable(out + o) + sum);
    }
    for (; o < out_f; o++) {
        float sum = 0.0f;
        for (int j = 0; j < rank; j++) sum += s[j] * b_t[(int64_t)j * out_f + o];
        out[o] = f32_to_bf16(bf16_to_f32(out[o]) + sum);
    }
}

static void bf16_add_portable(float alpha, const float *delta, uint16_t *out, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) store16_portable(out + i, widen16_portable(out + i) + alpha * load16_portable(delta + i));
    for (; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(out[i]) + alpha * delta[i]);
}

static void bf16_shrink_portable(const uint16_t *x, const uint16_t *a, int rank, int in_f, float scaling,
                                 float *shrunk) {
    for (int j = 0; j < rank; j++) shrunk[j] = scaling * bf16_dot_portable(x, a + (int64_t)j * in_f, in_f);
}
