/* Every function the kernel library exports: the one statement of its interface.
 *
 * Each source that defines one of these includes this header, so the compiler holds the
 * definitions to it (and -Werror=missing-prototypes refuses an exported function that is
 * not here); decode_stack.c calls the other kernels through it; and build.py reads the
 * ctypes argument and return types from it (cpu_kernels/header.py), so Python never keeps
 * a copy of its own.
 *
 * header.py reads a strict subset of C, and refuses anything else: comments, preprocessor
 * lines, `typedef struct NAME NAME;`, and prototypes `int|void name(type name, ...);`
 * whose parameters are `void`, int, int64_t or float, or a pointer to any type.
 *
 * Levels: each family's functions that take a `level` take the index of its level as
 * levels.py and the family's wrapper module list them (portable first); each family's
 * *_best_level / *_cpu_level answers the highest index this CPU runs. */
#ifndef PAGEDKV_KERNELS_H
#define PAGEDKV_KERNELS_H

#include <stdint.h>

/* decode_stack.c's description of a model (its layout is mirrored by the Python side). */
typedef struct stack_model stack_model;
/* A step's run of rows of one LoRA adapter (lora_runs.h; the same). */
typedef struct lora_run lora_run;

/* ---- paged decode attention (paged_decode.c) ---- */

int paged_decode_best_level(void);
int paged_decode_avx512(void);
int paged_decode_attention_at(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, int64_t table_row_stride, const int32_t *context_lens,
                              int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size, float scale,
                              int sliding_window, int dtype, void *out, int num_threads, int kv_dtype, float k_scale,
                              float v_scale, int level);
int paged_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_row_stride, const int32_t *context_lens,
                           int num_seqs, int q_heads, int kv_heads, int head_dim, int block_size, float scale,
                           int sliding_window, int dtype, void *out, int num_threads, int kv_dtype, float k_scale,
                           float v_scale);

/* ---- a layer's elementwise ops (layer_ops.c) ---- */

void rms_norm(const void *x, int64_t x_row_stride, const void *weight, void *out, int rows, int cols, float eps,
              int dtype, int num_threads);
void add_rms_norm(void *hidden, const void *delta, int64_t delta_row_stride, const void *weight, void *out,
                  int rows, int cols, float eps, int dtype, int num_threads);
void silu_mul(const void *gate_up, void *out, int rows, int inter, int dtype, int num_threads);
void rotary_in_place(void *x, int64_t x_row_stride, int rows, int heads, int head_dim, const void *cos_table,
                     const void *sin_table, const int64_t *positions, int dtype, int num_threads);

/* ---- greedy sampling (argmax.c) ---- */

void argmax_rows(const void *x, int64_t row_stride, int rows, int cols, int dtype, int64_t *out, int num_threads);

/* ---- quantized products (quant_matmul.c) ---- */

int quant_best_level(void);
int quant_linear(const void *x, int64_t x_stride, int tokens, int cols, int dtype, int segments,
                 const int64_t *weights, const int32_t *types, const int32_t *rows, void *y, int64_t y_stride,
                 int level, int num_threads);
int quant_dequantize_rows(const uint8_t *weights, int type, int cols, const int64_t *indices, int n, void *out,
                          int dtype, int num_threads);
int quant_dequantize_linear(int segments, const int64_t *weights, const int32_t *types, const int32_t *rows, int cols,
                            int row_begin, int row_end, void *out, int dtype, int level, int num_threads);
int quant_repack_x8(uint8_t *blocks, int type, int rows, int cols);
int quant_quantize_activations(const void *x, int64_t x_stride, int tokens, int cols, int dtype, int level, int8_t *q,
                               float *d, float *sums, int32_t *isums);

/* ---- a decode step's layers in one call (decode_stack.c) ---- */

int decode_stack(const stack_model *m, void *hidden, void *out, int tokens, const int64_t *positions,
                 const int64_t *slots, void *kv_pool, int64_t num_blocks, const int32_t *tables,
                 int64_t table_row_stride, const int32_t *context_lens, int kv_dtype, const lora_run *lora_runs,
                 int lora_num_runs, int lora_level, int num_threads);

/* ---- bfloat16 linears (bf16_matmul.c) ---- */

int bf16_cpu_level(void);
int bf16_pack_panels(const uint16_t *w, int64_t w_stride, int rows, int cols, uint16_t *panels);
int bf16_linear(const void *x, int64_t x_stride, int tokens, int cols, int rows, const void *panels, void *y,
                int64_t y_stride, int level, int num_threads);

/* ---- float32 linears (f32_matmul.c) ---- */

int f32_cpu_level(void);
int f32_pack_panels(const float *w, int64_t w_stride, int rows, int cols, float *panels);
int f32_linear(const float *x, int64_t x_stride, int tokens, int cols, int rows, const float *panels, float *y,
               int64_t y_stride, int level, int num_threads);

/* ---- prefill attention (prefill_attention.c) ---- */

int prefill_best_level(void);
int prefill_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                      const int32_t *tables, int64_t table_row_stride, const int32_t *query_lens,
                      const int32_t *context_lens, int num_seqs, int q_heads, int kv_heads, int head_dim,
                      int block_size, float scale, int sliding_window, void *out, int64_t out_row_stride, int dtype,
                      int level, int num_threads);

/* ---- K/V writes (kv_write.c) ---- */

int kv_write_best_level(void);
int write_kv_at(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
                int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale,
                float v_scale, int num_threads, int level);
int write_kv(const void *k, int64_t k_row_stride, const void *v, int64_t v_row_stride, int tokens, int kv_size,
             int dtype, const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype, float k_scale, float v_scale,
             int num_threads);

/* ---- LoRA's segmented product (lora_sgmv.c: float32 rows; lora_sgmv_bf16.c: bfloat16) ---- */

int lora_best_level(void);
int lora_shrink_expand(const float *x, int64_t x_row_stride, int rows, int in_f, const float *a, int rank,
                       const float *b, int out_f, float scaling, float *out, int64_t out_row_stride, int level,
                       int num_threads);
int lora_shrink_expand_bf16(const uint16_t *x, int64_t x_row_stride, int rows, int in_f, const uint16_t *a,
                            int rank, const uint16_t *b, int out_f, float scaling, uint16_t *out,
                            int64_t out_row_stride, int level, int num_threads);
/* A step's runs for one projection's targets, in one call (lora_runs.c). */
int lora_add_runs(const lora_run *runs, int num_runs, int layer, int count, const int *targets, const int *columns,
                  const void *x, int64_t x_stride, int in_features, void *y, int64_t y_stride, int dtype, int level,
                  int num_threads);

#endif
