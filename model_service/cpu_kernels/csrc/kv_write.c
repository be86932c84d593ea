/* This step's K and V into their slots of the pool, in place: one call a layer instead of
 * torch's index_copy_ a tensor (and, for an 8-bit pool, the divide, clamp and conversion
 * before it: five dispatches and three temporaries a tensor).
 *
 * k and v: [tokens, kv_size] rows (kv_size = kv_heads * head_dim contiguous), row_stride
 * elements apart, in dtype; k_cache and v_cache: one layer's K and V, [slots, kv_size] in
 * kv_dtype, which is dtype or an 8-bit type (values divided by their scale, saturated and
 * rounded: cpu_math.h's f32_to_fp8, what attention/kv_quant.py's quantize gives). A
 * negative slot (a padding row) is skipped.
 */
#include "cpu_math.h"

static inline __attribute__((always_inline)) void write_row(const void *src, int64_t src_offset, void *cache,
                                                            int64_t slot, int kv_size, int dtype, int kv_dtype,
                                                            float scale) {
    const int64_t dst_offset = slot * kv_size;
    if (kv_dtype == dtype) {
        const size_t bytes = dtype == DTYPE_F32 ? 4 : 2;
        memcpy((char *)cache + dst_offset * bytes, (const char *)src + src_offset * bytes, kv_size * bytes);
        return;
    }
    uint8_t *dst = (uint8_t *)cache + dst_offset;
    if (scale == 1.0f) { /* kv_quant.py divides only by a scale other than one */
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype), kv_dtype);
    } else {
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype) / scale, kv_dtype);
    }
}

/* Returns 0, or 1 for a kv_dtype that is neither dtype nor an 8-bit type. */
int write_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
             int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
             float v_scale, int num_threads) {
    if (kv_dtype != dtype && kv_dtype != DTYPE_FP8_E4M3 && kv_dtype != DTYPE_FP8_E5M2) return 1;
#pragma omp parallel for num_threads(num_threads) if (tokens > 8)
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        write_row(k, (int64_t)t * k_row_stride, k_cache, slots[t], kv_size, dtype, kv_dtype, k_scale);
        write_row(v, (int64_t)t * v_row_stride, v_cache, slots[t], kv_size, dtype, kv_dtype, v_scale);
    }
    return 0;
}
