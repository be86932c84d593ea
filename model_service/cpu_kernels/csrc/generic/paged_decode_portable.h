/* paged_decode.c's portable level (included by it): attend_one, the float32 arithmetic
 * every SIMD case keeps, and its cases by head_dim and dtype (HEAD_DIM_CASES). */

/* One (sequence, kv head): its `group` query heads against its visible keys. Always
 * inlined into attend_specialized's cases, so head_dim and dtype are constants there and
 * the row loops unroll into straight vector code. */
static inline __attribute__((always_inline)) void attend_one(const void *q, const void *k_cache, const void *v_cache,
                       const int32_t *table, int first_key, int end_key, int kv_head, int kv_heads,
                       int group, int head_dim, int block_size, float scale, int dtype, int kv_dtype,
                       float out_scale, void *out, int64_t out_offset, int64_t q_offset) {
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float scores[MAX_GROUP][MAX_BLOCK_SIZE];
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    float kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM];

    for (int g = 0; g < group; g++) {
        load_row(qf[g], q, q_offset + (int64_t)g * head_dim, head_dim, dtype);
        for (int d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.0f; }
        row_max[g] = -INFINITY;
        row_sum[g] = 0.0f;
    }
    if (end_key <= first_key) { /* nothing visible: zeros, not 0/0 */
        for (int g = 0; g < group; g++) store_row(out, out_offset + (int64_t)g * head_dim, acc[g], head_dim, dtype);
        return;
    }
    const int64_t token_stride = (int64_t)kv_heads * head_dim;
    for (int block_start = first_key - first_key % block_size; block_start < end_key; block_start += block_size) {
        const int64_t block = table[block_start / block_size];
        const int lo = block_start < first_key ? first_key - block_start : 0;
        const int hi = block_start + block_size > end_key ? end_key - block_start : block_size;
        const int64_t base = (block * block_size) * token_stride + (int64_t)kv_head * head_dim;

        for (int t = lo; t < hi; t++) {
            load_row(kf, k_cache, base + t * token_stride, head_dim, kv_dtype);
            for (int g = 0; g < group; g++) scores[g][t] = dot(qf[g], kf, head_dim);
        }
        for (int g = 0; g < group; g++) {
            float block_max = row_max[g];
            for (int t = lo; t < hi; t++) block_max = scores[g][t] > block_max ? scores[g][t] : block_max;
            const float correction = exp_f32(row_max[g] - block_max); /* ~0 on the first block: -inf clamps to -87 */
            row_max[g] = block_max;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = lo; t < hi; t++) {
                const float p = exp_f32(scores[g][t] - block_max);
                scores[g][t] = p;
                sum += p;
            }
            row_sum[g] = row_sum[g] * correction + sum;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) acc[g][d] *= correction;
        }
        for (int t = lo; t < hi; t++) {
            load_row(vf, v_cache, base + t * token_stride, head_dim, kv_dtype);
            for (int g = 0; g < group; g++) {
                const float p = scores[g][t];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = out_scale / row_sum[g];
        for (int d = 0; d < head_dim; d++) acc[g][d] *= inv;
        store_row(out, out_offset + (int64_t)g * head_dim, acc[g], head_dim, dtype);
    }
}

#define ATTEND(HEAD_DIM, DTYPE, KV_DTYPE)                                                        \
    attend_one(q, k_cache, v_cache, table, first_key, end_key, kv_head, kv_heads, group, HEAD_DIM, \
               block_size, scale, DTYPE, KV_DTYPE, out_scale, out, out_offset, q_offset)
#define HEAD_DIM_CASES(DTYPE, KV_DTYPE)                        \
    case 32: ATTEND(32, DTYPE, KV_DTYPE); return;              \
    case 64: ATTEND(64, DTYPE, KV_DTYPE); return;              \
    case 80: ATTEND(80, DTYPE, KV_DTYPE); return;              \
    case 96: ATTEND(96, DTYPE, KV_DTYPE); return;              \
    case 128: ATTEND(128, DTYPE, KV_DTYPE); return;            \
    case 256: ATTEND(256, DTYPE, KV_DTYPE); return;            \
    default: ATTEND(head_dim, DTYPE, KV_DTYPE); return;
