/* The quantized blocks' layouts read and rearranged outside the products: rows looked up
 * as floats (a quantized embedding; the tests' check of the layouts) and the file's rows
 * interleaved in eights at load (quant_x8.h), which quant_matmul.c's kernels read. */
#include <stdlib.h>

#include "cpu_math.h"
#include "pagedkv_kernels.h"
#include "quant_blocks.h"
#include "quant_x8.h"

/* out[i] = row indices[i] of W dequantized (cols values, dtype), indices NULL: rows 0..n-1.
 * The embedding lookup of a quantized token_embd, and the tests' check of the layouts. */
int quant_dequantize_rows(const uint8_t *weights, int type, int cols, const int64_t *indices, int n, void *out,
                          int dtype, int num_threads) {
    if (qtype_block_bytes(type) == 0 || cols % qtype_block_weights(type) != 0) return -1;
    const int64_t row_bytes = qtype_row_bytes(type, cols);
    const int x8 = qtype_is_x8(type);
    type = qtype_base(type);
#pragma omp parallel for num_threads(num_threads) if (n > 1)
    for (int i = 0; i < n; i++) {
        const int64_t index = indices ? indices[i] : i;
        uint8_t gathered[x8 ? row_bytes : 1];
        const uint8_t *row = weights + index * row_bytes;
        if (x8) {
            x8_gather_row(type | QTYPE_X8, weights, index, cols, gathered);
            row = gathered;
        }
        int8_t v[32];
        float scale[2], min, values[32];
        for (int s = 0; s < cols / 32; s++) {
            unpack_sub(type, row, s, v, scale, &min);
            for (int k = 0; k < 32; k++) values[k] = scale[k / 16] * (float)v[k] + min;
            store_row(out, (int64_t)i * cols + 32 * s, values, 32, dtype);
        }
    }
    return 0;
}

/* Rearranges `rows` rows of cols weights of the type (the file's blocks) in place into
 * interleaved groups of eight (quant_x8.h). Returns the layout's type code (type |
 * QTYPE_X8), or -1 where there is none (another type, rows not a multiple of 8), -2
 * without scratch memory; the blocks are untouched then. */
int quant_repack_x8(uint8_t *blocks, int type, int rows, int cols) {
    if (!qtype_has_x8(type) || qtype_is_x8(type) || rows % 8 != 0 || cols % 32 != 0) return -1;
    const int bytes = qtype_block_bytes(type);
    const int64_t row_bytes = qtype_row_bytes(type, cols), group_bytes = 8 * row_bytes;
    uint8_t *copy = malloc(group_bytes);
    if (copy == NULL) return -2;
    for (int64_t g = 0; g < rows / 8; g++) {
        uint8_t *group = blocks + g * group_bytes;
        memcpy(copy, group, group_bytes);
        for (int r = 0; r < 8; r++)
            for (int s = 0; s < cols / 32; s++) x8_scatter_block(type, group, s, r, copy + r * row_bytes + s * bytes);
    }
    free(copy);
    return type | QTYPE_X8;
}
