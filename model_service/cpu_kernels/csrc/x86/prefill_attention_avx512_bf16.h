/* prefill_attention.c's AVX-512 BF16 level (included by it on x86; its header comment says
 * how the level works): sixteen queries a 512-bit vector, tile16_avx512_bf16. */

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>

/* exp_f32 (cpu_math.h) sixteen lanes at a time: the same reduction and polynomial. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), big), big);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(k, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* Query head h, the sequence's queries t0 .. t0 + 15 (those past query_len are empty lanes). */
static void tile16_avx512_bf16(const prefill_call *c, const prefill_seq *seq, int h, int t0) {
    static const uint16_t zeros[PREFILL_MAX_HEAD_DIM]; /* the K/V row of a key past the context */
    const int hd = c->head_dim, pairs = hd / 2, kv_head = h / (c->q_heads / c->kv_heads);
    const int lanes = seq->query_len - t0 < PREFILL_LANES ? seq->query_len - t0 : PREFILL_LANES;
    const int first_position = seq->context_len - seq->query_len + t0;
    uint16_t panel[PREFILL_MAX_HEAD_DIM / 2][PREFILL_LANES][2] __attribute__((aligned(64)));
    float acc[PREFILL_MAX_HEAD_DIM][PREFILL_LANES] __attribute__((aligned(64)));
    float values[PREFILL_LANES][PREFILL_MAX_HEAD_DIM];
    uint16_t keys[PREFILL_LANES][PREFILL_MAX_HEAD_DIM];
    int32_t first_key[PREFILL_LANES], end_key[PREFILL_LANES];

    memset(panel, 0, sizeof panel[0] * (size_t)pairs);
    for (int lane = 0; lane < lanes; lane++) {
        const uint16_t *row = (const uint16_t *)seq->q + (int64_t)(t0 + lane) * c->q_row_stride + (int64_t)h * hd;
        for (int p = 0; p < pairs; p++) {
            panel[p][lane][0] = row[2 * p];
            panel[p][lane][1] = row[2 * p + 1];
        }
    }
    int lo, hi;
    lane_key_ranges(c, first_position, lanes, PREFILL_LANES, first_key, end_key, &lo, &hi);
    memset(acc, 0, sizeof acc[0] * (size_t)hd);
    const __m512i lane_first = _mm512_loadu_si512(first_key), lane_end = _mm512_loadu_si512(end_key);
    const __m512 scale = _mm512_set1_ps(c->scale);
    __m512 row_max = _mm512_set1_ps(-FLT_MAX), row_sum = _mm512_setzero_ps();
    const int64_t token_stride = (int64_t)c->kv_heads * hd;

    for (int kb = lo - lo % PREFILL_LANES; kb < hi; kb += PREFILL_LANES) {
        /* the block's key rows side by side (one base address for the broadcasts below),
         * its value rows as float32 */
        for (int j = 0; j < PREFILL_LANES; j++) {
            const int key = kb + j;
            const uint16_t *k_row = zeros, *v_row = zeros;
            if (key < hi) {
                const int64_t slot = (int64_t)seq->table[key / c->block_size] * c->block_size + key % c->block_size;
                k_row = (const uint16_t *)c->k_cache + slot * token_stride + (int64_t)kv_head * hd;
                v_row = (const uint16_t *)c->v_cache + slot * token_stride + (int64_t)kv_head * hd;
            }
            memcpy(keys[j], k_row, sizeof(uint16_t) * (size_t)hd);
            for (int d = 0; d < hd; d += 16)
                _mm512_storeu_ps(values[j] + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v_row + d))), 16)));
        }
        __m512 s[PREFILL_LANES];
        for (int j = 0; j < PREFILL_LANES; j++) s[j] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++) {
            const __m512bh line = (__m512bh)_mm512_load_si512(panel[p]);
            for (int j = 0; j < PREFILL_LANES; j++) {
                int32_t pair;
                memcpy(&pair, keys[j] + 2 * p, sizeof pair);
                s[j] = _mm512_dpbf16_ps(s[j], line, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
        __mmask16 visible[PREFILL_LANES];
        __m512 block_max = row_max;
        for (int j = 0; j < PREFILL_LANES; j++) {
            const __m512i key = _mm512_set1_epi32(kb + j);
            visible[j] = _mm512_cmple_epi32_mask(lane_first, key) & _mm512_cmplt_epi32_mask(key, lane_end);
            s[j] = _mm512_mul_ps(s[j], scale);
            block_max = _mm512_mask_max_ps(block_max, visible[j], block_max, s[j]);
        }
        /* exactly 1 where the block raised no lane's maximum */
        const __m512 correction = exp16(_mm512_sub_ps(row_max, block_max));
        row_max = block_max;
        row_sum = _mm512_mul_ps(row_sum, correction);
        for (int j = 0; j < PREFILL_LANES; j++) {
            s[j] = _mm512_maskz_mov_ps(visible[j], exp16(_mm512_sub_ps(s[j], block_max)));
            row_sum = _mm512_add_ps(row_sum, s[j]);
        }
        for (int d = 0; d < hd; d++) {
            __m512 out = _mm512_mul_ps(_mm512_load_ps(acc[d]), correction);
            for (int j = 0; j < PREFILL_LANES; j++) out = _mm512_fmadd_ps(s[j], _mm512_set1_ps(values[j][d]), out);
            _mm512_store_ps(acc[d], out);
        }
    }
    float inverse[PREFILL_LANES];
    _mm512_storeu_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), row_sum));
    for (int lane = 0; lane < lanes; lane++) {
        uint16_t *row = (uint16_t *)seq->out + (int64_t)(t0 + lane) * c->out_row_stride + (int64_t)h * hd;
        for (int d = 0; d < hd; d++) row[d] = f32_to_bf16(acc[d][lane] * inverse[lane]);
    }
}

#pragma GCC pop_options
