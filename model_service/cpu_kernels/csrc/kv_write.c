/* This step's K and V into their slots of the pool, in place: one call a layer instead of
 * torch's index_copy_ a tensor (and, for an 8-bit pool, the divide, clamp and conversion
 * before it: five dispatches and three temporaries a tensor).
 *
 * k and v: [tokens, kv_size] rows (kv_size = kv_heads * head_dim contiguous), row_stride
 * elements apart, in dtype; k_cache and v_cache: one layer's K and V, [slots, kv_size] in
 * kv_dtype, which is dtype (a copy) or an 8-bit type (values divided by their scale,
 * saturated and rounded: cpu_math.h's f32_to_fp8, what attention/kv_quant.py's quantize
 * gives). A negative slot (a padding row) is skipped.
 *
 * Two levels for the 8-bit conversion (kv_write.py's LEVELS; kv_write_levels, cpu_levels.h's
 * scheme): portable, f32_to_fp8 a value
 * at a time (its branch between subnormal and normal results keeps GCC from vectorizing
 * it), and AVX2, the same steps eight values at a time with both results computed and one
 * selected by mask. The two store the same bytes.
 */
#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"

enum { KV_WRITE_PORTABLE = 0, KV_WRITE_AVX2 = 1 };

/* One row of dtype into an 8-bit one, divided by scale (unless it is 1). */
typedef void (*fp8_row_fn)(const void *src, int64_t src_offset, uint8_t *dst, int kv_size, int dtype, int kv_dtype,
                           float scale);

#include "generic/kv_write_portable.h"

#if CPU_LEVELS_X86
#include "x86/kv_write_avx2.h"
#endif

static const fp8_row_fn kv_write_levels[] = {
    [KV_WRITE_PORTABLE] = write_row_fp8_portable,
    [KV_WRITE_AVX2] = X86_LEVEL(write_row_fp8_avx2),
};
static const cpu_check_fn kv_write_checks[] = {0, X86_LEVEL(cpu_avx2_fma_f16c)};

/* The highest level this CPU runs. */
int kv_write_best_level(void) { return best_level(kv_write_checks); }

static inline __attribute__((always_inline)) void write_row(const void *src, int64_t src_offset, void *cache,
                                                            int64_t slot, int kv_size, int dtype, int kv_dtype,
                                                            float scale, fp8_row_fn fp8_row) {
    const int64_t dst_offset = slot * kv_size;
    if (kv_dtype == dtype) {
        const size_t bytes = dtype == DTYPE_F32 ? 4 : 2;
        memcpy((char *)cache + dst_offset * bytes, (const char *)src + src_offset * bytes, kv_size * bytes);
        return;
    }
    fp8_row(src, src_offset, (uint8_t *)cache + dst_offset, kv_size, dtype, kv_dtype, scale);
}

/* Returns 0, or 1 for a kv_dtype that is neither dtype nor an 8-bit type, 2 for a level
 * above kv_write_best_level. */
int write_kv_at(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
                int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
                float v_scale, int num_threads, int level) {
    if (kv_dtype != dtype && kv_dtype != DTYPE_FP8_E4M3 && kv_dtype != DTYPE_FP8_E5M2) return 1;
    if (level < KV_WRITE_PORTABLE || level > kv_write_best_level()) return 2;
    const fp8_row_fn fp8_row = LEVEL_PICK(kv_write_levels, level);
#pragma omp parallel for num_threads(num_threads) if (tokens > 8 && 2 * (int64_t)tokens * kv_size >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        write_row(k, (int64_t)t * k_row_stride, k_cache, slots[t], kv_size, dtype, kv_dtype, k_scale, fp8_row);
        write_row(v, (int64_t)t * v_row_stride, v_cache, slots[t], kv_size, dtype, kv_dtype, v_scale, fp8_row);
    }
    return 0;
}

/* write_kv_at at the best level this CPU runs (decode_stack.c's call). */
int write_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
             int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
             float v_scale, int num_threads) {
    return write_kv_at(k, k_row_stride, v, v_row_stride, tokens, kv_size, dtype, slots, k_cache, v_cache, kv_dtype,
                       k_scale, v_scale, num_threads, kv_write_best_level());
}
