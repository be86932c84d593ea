/* Q4_0, Q4_1 and Q8_0 blocks of eight rows interleaved: the layout the quantized linears
 * hold these types in (quant_repack_x8 rearranges a file's rows at load, in place).
 *
 * Read one row at a time, a 32-weight sub-block costs its own horizontal sum, its own
 * scale lookups and a scalar multiply-add for its min or offset; for a decode step's one
 * token that bookkeeping, not the integer products, was most of the instructions (about
 * nine a row and sub-block). Interleaved, one 256-bit integer dot product covers the
 * same 4 weights of 8 rows (lane r: row r), against those 4 activations broadcast, so a
 * group's 8 results add up lane by lane (no horizontal sum), and the 8 scales (and mins)
 * are one float16 vector.
 *
 * A block of the file is [float16 fields][payload]: Q4_0 [d][16 bytes of nibbles], Q4_1
 * [d][m][16 bytes], Q8_0 [d][32 int8]. Interleaved, the 8 rows' blocks of one sub-block s
 * are, in place of those 8 blocks (the same bytes, so the same size):
 *     for each float16 field f:   8 values, row r's at 2r          (16 bytes)
 *     for each 4-byte chunk j of the payload: 8 chunks, row r's at 4r   (32 bytes)
 * Nibble chunk j holds weights 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high nibbles),
 * as the file's byte order has them; an int8 chunk j holds weights 4j..4j+3.
 */
#ifndef PAGEDKV_QUANT_X8_H
#define PAGEDKV_QUANT_X8_H

#include "quant_blocks.h"

/* Bytes of float16 fields in a block of the type (its payload follows them). */
static inline int x8_header_bytes(int base) { return base == QTYPE_Q4_1 ? 4 : 2; }

/* Row `lane` of an interleaved group's sub-block s, written as the file's block. */
static inline void x8_gather_block(int base, const uint8_t *group, int64_t s, int lane, uint8_t *block) {
    const int bytes = qtype_block_bytes(base), header = x8_header_bytes(base);
    const uint8_t *g = group + s * 8 * bytes;
    for (int f = 0; f < header / 2; f++) memcpy(block + 2 * f, g + 16 * f + 2 * lane, 2);
    for (int j = 0; j < (bytes - header) / 4; j++) memcpy(block + header + 4 * j, g + 8 * header + 32 * j + 4 * lane, 4);
}

/* The inverse: the file's block of row `lane`, sub-block s, into the group. */
static inline void x8_scatter_block(int base, uint8_t *group, int64_t s, int lane, const uint8_t *block) {
    const int bytes = qtype_block_bytes(base), header = x8_header_bytes(base);
    uint8_t *g = group + s * 8 * bytes;
    for (int f = 0; f < header / 2; f++) memcpy(g + 16 * f + 2 * lane, block + 2 * f, 2);
    for (int j = 0; j < (bytes - header) / 4; j++) memcpy(g + 8 * header + 32 * j + 4 * lane, block + header + 4 * j, 4);
}

/* Row r of an interleaved segment (rows of cols weights at base), as the file's row. */
static inline void x8_gather_row(int type, const uint8_t *segment, int64_t r, int cols, uint8_t *row) {
    const int base = qtype_base(type), bytes = qtype_block_bytes(base);
    const int64_t row_bytes = qtype_row_bytes(base, cols);
    const uint8_t *group = segment + (r / 8) * 8 * row_bytes;
    for (int64_t s = 0; s < cols / 32; s++) x8_gather_block(base, group, s, (int)(r % 8), row + s * bytes);
}

#endif
