/* kv_write.c's portable level (included by it): f32_to_fp8 a value at a time. */

static void write_row_fp8_portable(const void *src, int64_t src_offset, uint8_t *dst, int kv_size, int dtype,
                                   int kv_dtype, float scale) {
    if (scale == 1.0f) { /* kv_quant.py divides only by a scale other than one */
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype), kv_dtype);
    } else {
        for (int i = 0; i < kv_size; i++) dst[i] = f32_to_fp8(load1(src, src_offset + i, dtype) / scale, kv_dtype);
    }
}
