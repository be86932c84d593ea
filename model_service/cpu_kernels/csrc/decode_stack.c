/* A whole decode step's decoder layers in one call, for models whose linears are held in
 * quantized blocks (quant_matmul.c) or in panels of their own dtype (bf16_matmul.c's for a
 * bfloat16 model, f32_matmul.c's for a float32 one).
 *
 * A decode step of one stream on a 30-layer model is ~300 small operations; through
 * PyTorch each costs a dispatch, a tensor and, for the C kernels, a ctypes call, and at
 * SmolLM2's size those costs were a third of the step (BENCHMARKS.md, "One call a decode
 * step"). Here the layers run back to back in C: the same kernels, in the same order, on
 * the same buffers, as models/llama.py's per-layer path, so the results are the same bits
 * (tests/test_decode_stack.py holds them to it).
 *
 * Per layer, for the step's T tokens (one per sequence):
 *   normed  = rms_norm(hidden)                  (the first layer), else
 *   hidden += mlp_out; normed = rms_norm(hidden)
 *   qkv     = normed W_qkv^T; rotary on q and k in place
 *   K/V of each token -> its slot of the pool; attention over each sequence's blocks
 *   hidden += attn W_o^T; normed = rms_norm(hidden)
 *   mlp_out = silu_mul(normed W_gate_up^T) W_down^T
 * and after the last layer hidden += mlp_out, out = final_norm(hidden).
 *
 * With LoRA adapters (float32 or bfloat16 activations, the factors in the same dtype),
 * each projection's output then takes its adapters' deltas, all runs of the step in one
 * call of lora_runs.c's lora_add_runs: the call models/lora_delta.py's LoraStep makes on
 * the per-layer path, at the same points (q, k, v into the fused qkv's columns before
 * rotary; o; gate, up before silu_mul; down).
 *
 * What it does not take (the caller checks, and the per-layer path serves instead): biases,
 * a pool of another dtype than the activations, but for an 8-bit pool under float32
 * activations (what paged_decode_attention reads).
 */
#include <stdlib.h>

#include "cpu_math.h"
#include "lora_runs.h"
#include "pagedkv_kernels.h"

#define STACK_MAX_SEGMENTS 4
/* A linear's type when its one segment is bfloat16 panels (bf16_linear), not quantized
 * blocks: above every ggml type code and its interleaved variant (quant_matmul.py's X8). */
#define STACK_BF16_PANELS 0x1000
/* And when it is float32 panels (f32_linear). */
#define STACK_F32_PANELS 0x1001

/* One linear's rows as quant_linear takes them, or panels (STACK_BF16_PANELS, STACK_F32_PANELS). */
typedef struct {
    int32_t segments;
    int32_t types[STACK_MAX_SEGMENTS];
    int32_t rows[STACK_MAX_SEGMENTS];
    int64_t weights[STACK_MAX_SEGMENTS];
} stack_linear;

typedef struct {
    int64_t input_norm, post_attention_norm; /* weight pointers, [hidden] in dtype */
    stack_linear qkv, o, gate_up, down;
    int32_t sliding_window; /* 0: full attention */
    float k_scale, v_scale; /* an 8-bit pool's (attention/kv_quant.py); 1 otherwise */
} stack_layer;

struct stack_model { /* pagedkv_kernels.h names it */
    int32_t num_layers, hidden, q_heads, kv_heads, head_dim, intermediate;
    int32_t dtype, block_size, level;
    float eps, scale;
    int64_t final_norm, cos_table, sin_table; /* [hidden]; rotary tables [positions, head_dim / 2] */
    const stack_layer *layers;
    int32_t bf16_level; /* bf16_linear's, for bfloat16 panel linears */
    int32_t f32_level;  /* f32_linear's, for float32 panel linears */
};

/* The targets whose deltas go into one projection's output, where their columns start
 * (lora_runs.c adds them, for all of a step's runs in one call). */
typedef struct {
    int count;
    int targets[3], columns[3];
} lora_outputs;

typedef struct {
    const lora_run *runs;
    int num_runs, level, dtype; /* dtype: the activations' and the factors', DTYPE_F32 or DTYPE_BF16 */
} stack_lora;

static int add_lora(const stack_lora *lora, int layer, lora_outputs outputs, const void *x, int64_t x_stride,
                    int in_features, void *y, int64_t y_stride, int num_threads) {
    return lora_add_runs(lora->runs, lora->num_runs, layer, outputs.count, outputs.targets, outputs.columns, x,
                         x_stride, in_features, y, y_stride, lora->dtype, lora->level, num_threads);
}

static size_t dtype_bytes(int dtype) {
    return dtype == DTYPE_F32 ? 4 : dtype == DTYPE_FP8_E4M3 || dtype == DTYPE_FP8_E5M2 ? 1 : 2;
}

static int linear(const stack_model *m, const stack_linear *w, const void *x, int tokens, int cols, void *y,
                  int64_t y_stride, int num_threads) {
    if (w->types[0] == STACK_BF16_PANELS)
        return bf16_linear(x, cols, tokens, cols, w->rows[0], (const void *)(intptr_t)w->weights[0], y, y_stride,
                           m->bf16_level, num_threads);
    if (w->types[0] == STACK_F32_PANELS)
        return f32_linear(x, cols, tokens, cols, w->rows[0], (const float *)(intptr_t)w->weights[0], y, y_stride,
                          m->f32_level, num_threads);
    const int dtype = m->dtype, level = m->level;
    return quant_linear(x, cols, tokens, cols, dtype, w->segments, w->weights, w->types, w->rows, y, y_stride,
                        level, num_threads);
}

/* hidden: [tokens, hidden] contiguous, the embeddings in and the residual stream after
 * (added to in place, as the per-layer path does); out: [tokens, hidden], the final
 * norm's output. kv_pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] in
 * kv_dtype (dtype, or an 8-bit type with dtype float32). slots: each token's slot (block * block_size + offset); tables, context_lens: the
 * sequences' block tables (int32, table_row_stride apart) and lengths after this step.
 * Returns 0, -1 on a kernel's refusal (a shape past its limits: the step stops at that
 * call, and the caller fails it), -2 without scratch memory. */
int decode_stack(const stack_model *m, void *hidden, void *out, int tokens, const int64_t *positions,
                 const int64_t *slots, void *kv_pool, int64_t num_blocks, const int32_t *tables,
                 int64_t table_row_stride, const int32_t *context_lens, int kv_dtype, const lora_run *lora_runs,
                 int lora_num_runs, int lora_level, int num_threads) {
    const int dtype = m->dtype, width = m->hidden, head_dim = m->head_dim;
    const stack_lora lora = {lora_runs, lora_num_runs, lora_level, dtype};
    if (lora_num_runs > 0 && dtype != DTYPE_F32 && dtype != DTYPE_BF16) return -1;
    const int q_size = m->q_heads * head_dim, kv_size = m->kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
    const size_t elem = dtype_bytes(dtype), kv_elem = dtype_bytes(kv_dtype);
    /* One scratch allocation: normed, qkv, attention out, o / mlp out, gate_up, act. */
    const size_t normed_n = (size_t)tokens * width, qkv_n = (size_t)tokens * qkv_size,
                 attn_n = (size_t)tokens * q_size, delta_n = (size_t)tokens * width,
                 gate_up_n = (size_t)tokens * 2 * m->intermediate, act_n = (size_t)tokens * m->intermediate;
    char *scratch = malloc((normed_n + qkv_n + attn_n + delta_n + gate_up_n + act_n) * elem);
    if (scratch == NULL) return -2;
    char *normed = scratch, *qkv = normed + normed_n * elem, *attn = qkv + qkv_n * elem,
         *delta = attn + attn_n * elem, *gate_up = delta + delta_n * elem, *act = gate_up + gate_up_n * elem;
    const int64_t layer_elems = 2 * num_blocks * m->block_size * (int64_t)kv_size;
    int status = 0;

    for (int l = 0; l < m->num_layers; l++) {
        const stack_layer *layer = &m->layers[l];
        if (l == 0)
            rms_norm(hidden, width, (const void *)(intptr_t)layer->input_norm, normed, tokens, width, m->eps, dtype,
                     num_threads);
        else
            add_rms_norm(hidden, delta, width, (const void *)(intptr_t)layer->input_norm, normed, tokens, width,
                         m->eps, dtype, num_threads);
        status = linear(m, &layer->qkv, normed, tokens, width, qkv, qkv_size, num_threads);
        if (status != 0) break;
        if (lora.num_runs > 0) {
            const lora_outputs qkv_targets = {3, {LORA_Q, LORA_K, LORA_V}, {0, q_size, q_size + kv_size}};
            status = add_lora(&lora, l, qkv_targets, normed, width, width, qkv, qkv_size, num_threads);
            if (status != 0) break;
        }
        rotary_in_place(qkv, qkv_size, tokens, m->q_heads + m->kv_heads, head_dim,
                        (const void *)(intptr_t)m->cos_table, (const void *)(intptr_t)m->sin_table, positions,
                        dtype, num_threads);
        char *k_cache = (char *)kv_pool + (size_t)(l * layer_elems) * kv_elem;
        char *v_cache = k_cache + (size_t)(layer_elems / 2) * kv_elem;
        status = write_kv(qkv + (size_t)q_size * elem, qkv_size, qkv + (size_t)(q_size + kv_size) * elem, qkv_size,
                          tokens, kv_size, dtype, slots, k_cache, v_cache, kv_dtype, layer->k_scale, layer->v_scale,
                          num_threads);
        if (status != 0) break;
        status = paged_decode_attention(qkv, qkv_size, k_cache, v_cache, tables, table_row_stride, context_lens,
                                        tokens, m->q_heads, m->kv_heads, head_dim, m->block_size, m->scale,
                                        layer->sliding_window, dtype, attn, num_threads, kv_dtype, layer->k_scale,
                                        layer->v_scale);
        if (status != 0) break;
        status = linear(m, &layer->o, attn, tokens, q_size, delta, width, num_threads);
        if (status == 0 && lora.num_runs > 0)
            status = add_lora(&lora, l, (lora_outputs){1, {LORA_O}, {0}}, attn, q_size, q_size, delta, width,
                              num_threads);
        if (status != 0) break;
        add_rms_norm(hidden, delta, width, (const void *)(intptr_t)layer->post_attention_norm, normed, tokens,
                     width, m->eps, dtype, num_threads);
        status = linear(m, &layer->gate_up, normed, tokens, width, gate_up, 2 * m->intermediate, num_threads);
        if (status == 0 && lora.num_runs > 0) {
            const lora_outputs gate_up_targets = {2, {LORA_GATE, LORA_UP}, {0, m->intermediate}};
            status = add_lora(&lora, l, gate_up_targets, normed, width, width, gate_up, 2 * m->intermediate,
                              num_threads);
        }
        if (status != 0) break;
        silu_mul(gate_up, act, tokens, m->intermediate, dtype, num_threads);
        status = linear(m, &layer->down, act, tokens, m->intermediate, delta, width, num_threads);
        if (status == 0 && lora.num_runs > 0)
            status = add_lora(&lora, l, (lora_outputs){1, {LORA_DOWN}, {0}}, act, m->intermediate, m->intermediate,
                              delta, width, num_threads);
        if (status != 0) break;
    }
    if (status == 0)
        add_rms_norm(hidden, delta, width, (const void *)(intptr_t)m->final_norm, out, tokens, width, m->eps, dtype,
                     num_threads);
    free(scratch);
    return status == 0 ? 0 : -1;
}
