/* y = W x for weights kept in GGUF's quantized blocks (quant_blocks.h): the activations
 * are quantized on the fly to 8 bits per 32 values, and each 32-weight sub-block is
 * multiplied by them with integer dot products, as llama.cpp does; no float copy of W.
 *
 * Three levels, picked by the caller (`level`, see quant_best_level): portable C,
 * AVX2 (maddubs), AVX-512 VNNI (dpbusd on 256-bit vectors), each a row of quant_levels
 * (cpu_levels.h's scheme). The SIMD levels are built with `#pragma GCC target` whatever
 * -march says, so one library serves every level the CPU has, and a test can run each.
 *
 * A linear may hold several segments of rows, each of its own type (a fused QKV whose V
 * rows are Q6_K and Q and K rows Q4_K, as Q4_K_M files have): one call quantizes x once
 * and fills every segment's columns of y. Rows split across threads in tiles of
 * QUANT_ROW_TILE; tokens go QUANT_TOKEN_TILE at a time, so a prefill or a batch of decodes
 * unpacks each sub-block once per four tokens. A segment held with eight rows interleaved
 * (quant_x8.h: Q4_0, Q4_1, Q8_0) goes a group of eight rows at a time instead, and at
 * the AVX-512 level two groups at a time, eight tokens a tile (x8_segment).
 */
#include <omp.h>
#include <stdlib.h>

#include "cpu_levels.h"
#include "cpu_math.h"
#include "pagedkv_kernels.h"
#include "quant_blocks.h"
#include "quant_x8.h"

#define QUANT_TOKEN_TILE 4
/* Tokens an interleaved group's unpacked sub-block serves at a time (x86/quant_simd.h's
 * x8_group): eight float accumulators and the eight weight vectors stay in registers
 * (AVX-512 has 32 vector registers; at the AVX2 level some spill). */
#define QUANT_X8_TOKENS 4
/* The same for two groups a 512-bit vector (x86/quant_simd.h's x16_group, the AVX-512 level):
 * 16 float accumulators, 8 weight vectors and the integer sums fill its 32 registers. */
#define QUANT_X16_TOKENS 8
#define QUANT_ROW_TILE 16
/* Up to this many tokens every thread quantizes the activations itself (quant_linear). */
#define QUANT_OWN_COPY_TOKENS 4

enum { QLEVEL_PORTABLE = 0, QLEVEL_AVX2 = 1, QLEVEL_AVX512_VNNI = 2 };

typedef void (*dot_fn)(const uint8_t *row, const quant_acts *acts, int64_t t0, int nt, int subs, float *out);
/* Two rows times one token (the SIMD levels; NULL at the portable one). */
typedef void (*pair_fn)(const uint8_t *row0, const uint8_t *row1, const quant_acts *acts, int64_t token, int subs,
                        float *out);
/* The 8 rows of an interleaved group times tokens t0 .. t0 + nt - 1 (nt <= QUANT_X8_TOKENS),
 * out[8 t + r] (the SIMD levels; NULL at the portable one). */
typedef void (*x8_fn)(const uint8_t *group, const quant_acts *acts, int64_t t0, int nt, int subs, float *out);
/* Two groups, group_bytes apart, times tokens t0 .. t0 + nt - 1 (nt <= QUANT_X16_TOKENS),
 * out[16 t + r] (the AVX-512 level; NULL at the others). */
typedef void (*x16_fn)(const uint8_t *group, int64_t group_bytes, const quant_acts *acts, int64_t t0, int nt,
                       int subs, float *out);

#include "generic/quant_matmul_portable.h"

/* Every float16 value as float32 (256 KiB, filled when the library loads): the SIMD
 * levels read block scales through it (x86/quant_simd.h's half). */
static float half_table[65536];

__attribute__((constructor)) static void fill_half_table(void) {
    for (uint32_t bits = 0; bits < 65536; bits++) {
        const uint8_t bytes[2] = {(uint8_t)(bits & 0xff), (uint8_t)(bits >> 8)};
        half_table[bits] = half_to_f32(bytes);
    }
}

/* ---- x86 SIMD levels ---- */

#if CPU_LEVELS_X86
#include <immintrin.h>

#include "x86/quant_matmul_avx2.h"
#include "x86/quant_matmul_avx512_vnni.h"
#endif

/* What differs by level: the per-type kernels (0 where a level has none: the portable
 * level's pair, x8 and x16; the AVX2 level's x16), the activations' quantization, and the
 * SIMD levels' dequantization for the float product. */
typedef void (*quantize_fn)(const void *x, int64_t offset, int cols, int dtype, int8_t *q, float *d, float *sums,
                            int32_t *isums);
typedef void (*dequantize_fn)(int type, const uint8_t *blocks, int subs, void *out, int64_t out_offset, int dtype);
typedef struct {
    dot_fn (*dot)(int type);
    pair_fn (*pair)(int type);
    x8_fn (*x8)(int base);
    x16_fn (*x16)(int base);
    quantize_fn quantize;
    dequantize_fn dequantize_row, dequantize_group_x8;
} quant_level;

static void quantize_row(const void *x, int64_t offset, int cols, int dtype, int8_t *q, float *d, float *sums,
                         int32_t *isums);

static const quant_level quant_levels[] = {
    [QLEVEL_PORTABLE] = {portable_select, 0, 0, 0, quantize_row, 0, 0},
#if CPU_LEVELS_X86
    [QLEVEL_AVX2] = {select_avx2, select_pair_avx2, select_x8_avx2, 0, quantize_row_avx2, dequantize_row_avx2,
                     dequantize_group_x8_avx2},
    [QLEVEL_AVX512_VNNI] = {select_vnni, select_pair_vnni, select_x8_vnni, select_x16_vnni, quantize_row_vnni,
                            dequantize_row_vnni, dequantize_group_x8_vnni},
#endif
};
static const cpu_check_fn quant_checks[] = {0, X86_LEVEL(cpu_avx2_fma), X86_LEVEL(cpu_avx512_vnni)};

/* The highest level this CPU runs. */
int quant_best_level(void) { return best_level(quant_checks); }

/* ---- activations ---- */

/* Row `offset` of x (cols values) -> 8-bit values, a scale per 32 (amax / 127), scale
 * times sum per 16, and sum per 32. (x86/quant_simd.h's quantize_row, the SIMD levels' copy
 * in vectors, must give the same bytes.) */
static void quantize_row(const void *x, int64_t offset, int cols, int dtype, int8_t *q, float *d, float *sums,
                         int32_t *isums) {
    float block[32];
    for (int s = 0; s < cols / 32; s++) {
        load_row(block, x, offset + 32 * s, 32, dtype);
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(block[i]));
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[s] = amax / 127.0f;
        int first = 0, second = 0;
        for (int i = 0; i < 32; i++) {
            const int8_t value = (int8_t)nearbyintf(block[i] * inverse);
            q[32 * s + i] = value;
            if (i < 16) first += value;
            else second += value;
        }
        sums[2 * s] = d[s] * (float)first;
        sums[2 * s + 1] = d[s] * (float)second;
        isums[s] = first + second;
    }
}

/* Token t of x quantized into its place in acts (whose arrays the caller owns). */
static inline void quantize_token(quantize_fn quantize, const void *x, int64_t x_stride, int t, int cols, int dtype,
                                  const quant_acts *acts) {
    const int subs = cols / 32;
    quantize(x, (int64_t)t * x_stride, cols, dtype, (int8_t *)acts->q + (int64_t)t * cols,
             (float *)acts->d + (int64_t)t * subs, (float *)acts->scaled_sums + (int64_t)t * subs * 2,
             (int32_t *)acts->isums + (int64_t)t * subs);
}

/* Rows QUANT_PREFETCH_ROWS ahead are asked for before a row is read: a decode step
 * reads each weight once, from memory rather than cache, and the hardware prefetcher
 * alone left the kernel at ~60 % of its in-cache speed there (BENCHMARKS.md, "One call a
 * decode step"). Past the last row of a matrix the hint reads nothing it faults on. */
#define QUANT_PREFETCH_ROWS 4

static inline void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset, 0, 3);
}

/* The 8 rows of an interleaved group times one token, at the portable level: each row
 * written back as the file's blocks, then dot_portable. */
static void x8_portable(int base, const uint8_t *group, const quant_acts *acts, int64_t token, int subs, float *out) {
    const int bytes = qtype_block_bytes(base);
    uint8_t row[subs * bytes];
    for (int r = 0; r < 8; r++) {
        for (int s = 0; s < subs; s++) x8_gather_block(base, group, s, r, row + s * bytes);
        dot_portable(base, row, acts, token, 1, subs, out + r);
    }
}

/* An interleaved segment's share of quant_linear (inside its parallel region: the tiles
 * split across its threads): y[t, row0 + r] for its `count` rows, a group of eight at a
 * time, QUANT_X8_TOKENS tokens a tile, or at the AVX-512 level two groups at a time,
 * QUANT_X16_TOKENS tokens a tile (the groups' bytes stay in L1 between token tiles), the
 * next rows asked for before they are read. */
static void x8_segment(const quant_level *at, int type, const uint8_t *weights, int count, int cols,
                       const quant_acts *acts, int tokens, void *y, int64_t y_stride, int64_t row0, int dtype) {
    const int base = qtype_base(type), subs = cols / 32;
    const x8_fn x8 = at->x8 ? at->x8(base) : 0;
    const x16_fn x16 = at->x16 ? at->x16(base) : 0;
    const int64_t group_bytes = 8 * qtype_row_bytes(base, cols);
    const int tiles = (count + QUANT_ROW_TILE - 1) / QUANT_ROW_TILE;
#pragma omp for schedule(static) nowait
    for (int tile = 0; tile < tiles; tile++) {
        const int first = tile * QUANT_ROW_TILE;
        const int last = first + QUANT_ROW_TILE < count ? first + QUANT_ROW_TILE : count;
        for (int g = first; g < last;) {
            const uint8_t *group = weights + (int64_t)(g / 8) * group_bytes;
            const int wide = x16 && g + 16 <= last; /* two groups a vector */
            const int width = wide ? 16 : 8, tile_tokens = wide ? QUANT_X16_TOKENS : QUANT_X8_TOKENS;
            prefetch_row(group + width / 8 * group_bytes, width / 8 * group_bytes);
            float out[16 * QUANT_X16_TOKENS];
            for (int t0 = 0; t0 < tokens; t0 += tile_tokens) {
                const int nt = tokens - t0 < tile_tokens ? tokens - t0 : tile_tokens;
                if (wide) x16(group, group_bytes, acts, t0, nt, subs, out);
                else if (x8) x8(group, acts, t0, nt, subs, out);
                else
                    for (int t = 0; t < nt; t++) x8_portable(base, group, acts, t0 + t, subs, out + 8 * t);
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < width; r++)
                        store1(y, (int64_t)(t0 + t) * y_stride + row0 + g + r, out[width * t + r], dtype);
            }
            g += width;
        }
    }
}

/* y[t, row0 + r] for the `segments` segments of rows: segment i has rows[i] rows of
 * types[i] at weights[i] (row-major blocks, cols / block weights blocks a row). x: tokens
 * rows of cols values (x_stride apart, dtype); y: tokens rows y_stride apart, same dtype.
 * Returns 0, -1 for a type without a kernel or cols not a multiple of its block, -2 when
 * scratch memory cannot be had. */
int quant_linear(const void *x, int64_t x_stride, int tokens, int cols, int dtype, int segments,
                 const int64_t *weights, const int32_t *types, const int32_t *rows, void *y, int64_t y_stride,
                 int level, int num_threads) {
    if (cols % 32 != 0 || tokens <= 0 || !qtype_segments_fit(segments, types, rows, cols)) return -1;
    const int subs = cols / 32;
    /* Few tokens: each thread quantizes them all into its own copy, the same bytes, rather
     * than waiting at a barrier for the others' share; a decode step makes a few hundred
     * of these calls, and each barrier waits for the slower thread. */
    const int own_copies = tokens <= QUANT_OWN_COPY_TOKENS ? (num_threads > 0 ? num_threads : 1) : 1;
    const size_t n = (size_t)own_copies * tokens;
    int8_t *q = malloc(n * cols);
    float *d = malloc(n * subs * sizeof(float));
    float *sums = malloc(n * subs * 2 * sizeof(float));
    int32_t *isums = malloc(n * subs * sizeof(int32_t));
    if (q == NULL || d == NULL || sums == NULL || isums == NULL) {
        free(q);
        free(d);
        free(sums);
        free(isums);
        return -2;
    }
    const quant_level *at = &LEVEL_PICK(quant_levels, level);
    const quantize_fn quantize = at->quantize;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t copy = own_copies > 1 ? (int64_t)omp_get_thread_num() * tokens : 0;
        const quant_acts acts = {q + copy * cols, d + copy * subs, sums + copy * subs * 2, isums + copy * subs, cols};
        if (own_copies > 1)
            for (int t = 0; t < tokens; t++)
                quantize_token(quantize, x, x_stride, t, cols, dtype, &acts);
        else {
#pragma omp for schedule(static)
            for (int t = 0; t < tokens; t++)
                quantize_token(quantize, x, x_stride, t, cols, dtype, &acts);
        }
        int64_t row0 = 0;
        for (int i = 0; i < segments; i++) {
            if (qtype_is_x8(types[i])) {
                x8_segment(at, types[i], (const uint8_t *)(intptr_t)weights[i], rows[i], cols, &acts, tokens, y,
                           y_stride, row0, dtype);
                row0 += rows[i];
                continue;
            }
            const dot_fn dot = at->dot(types[i]);
            const pair_fn pair = tokens == 1 && at->pair ? at->pair(types[i]) : 0;
            const uint8_t *base = (const uint8_t *)(intptr_t)weights[i];
            const int64_t row_bytes = qtype_row_bytes(types[i], cols);
            const int count = rows[i], tiles = (count + QUANT_ROW_TILE - 1) / QUANT_ROW_TILE;
#pragma omp for schedule(static) nowait
            for (int tile = 0; tile < tiles; tile++) {
                const int first = tile * QUANT_ROW_TILE;
                const int last = first + QUANT_ROW_TILE < count ? first + QUANT_ROW_TILE : count;
                float out[QUANT_TOKEN_TILE];
                if (pair) { /* one token: rows two at a time */
                    int r = first;
                    for (; r + 1 < last; r += 2) {
                        prefetch_row(base + (r + QUANT_PREFETCH_ROWS) * row_bytes, 2 * row_bytes);
                        pair(base + r * row_bytes, base + (r + 1) * row_bytes, &acts, 0, subs, out);
                        store1(y, row0 + r, out[0], dtype);
                        store1(y, row0 + r + 1, out[1], dtype);
                    }
                    if (r < last) {
                        dot(base + r * row_bytes, &acts, 0, 1, subs, out);
                        store1(y, row0 + r, out[0], dtype);
                    }
                    continue;
                }
                for (int t0 = 0; t0 < tokens; t0 += QUANT_TOKEN_TILE) {
                    const int nt = tokens - t0 < QUANT_TOKEN_TILE ? tokens - t0 : QUANT_TOKEN_TILE;
                    for (int r = first; r < last; r++) {
                        if (t0 == 0) prefetch_row(base + (r + QUANT_PREFETCH_ROWS) * row_bytes, row_bytes);
                        dot(base + r * row_bytes, &acts, t0, nt, subs, out);
                        for (int t = 0; t < nt; t++) store1(y, (int64_t)(t0 + t) * y_stride + row0 + r, out[t], dtype);
                    }
                }
            }
            row0 += count;
        }
    }
    free(q);
    free(d);
    free(sums);
    free(isums);
    return 0;
}

/* x's tokens rows quantized as quant_linear quantizes them at `level`: q [tokens, cols],
 * d [tokens, cols / 32], sums [tokens, cols / 16], isums [tokens, cols / 32], for the
 * tests' check that every level gives the same bytes. Returns 0, or -1 for cols not a multiple
 * of 32. */
int quant_quantize_activations(const void *x, int64_t x_stride, int tokens, int cols, int dtype, int level,
                               int8_t *q, float *d, float *sums, int32_t *isums) {
    if (cols % 32 != 0) return -1;
    const quant_acts acts = {q, d, sums, isums, cols};
    for (int t = 0; t < tokens; t++)
        quantize_token(LEVEL_PICK(quant_levels, level).quantize, x, x_stride, t, cols, dtype, &acts);
    return 0;
}

/* Rows [row_begin, row_end) of a linear's segments (as quant_linear takes them)
 * dequantized into out [row_end - row_begin, cols] of dtype (float32 or bfloat16) at a
 * SIMD level: the weights of a batched product that multiplies in floats (quant_matmul.py
 * says when). Returns 0, or -1 for a level, type or dtype without this path. */
int quant_dequantize_linear(int segments, const int64_t *weights, const int32_t *types, const int32_t *rows,
                            int cols, int row_begin, int row_end, void *out, int dtype, int level, int num_threads) {
    if ((dtype != DTYPE_F32 && dtype != DTYPE_BF16) || level < QLEVEL_AVX2 || cols % 32 != 0
        || !qtype_segments_fit(segments, types, rows, cols))
        return -1;
    const quant_level *at = &LEVEL_PICK(quant_levels, level);
    if (at->dequantize_row == 0) return -1; /* a build without the SIMD levels */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int r = row_begin; r < row_end; r++) {
        int segment = 0, first = 0;
        while (r >= first + rows[segment]) first += rows[segment++];
        const int type = qtype_base(types[segment]);
        const int64_t row_bytes = qtype_row_bytes(type, cols);
        const uint8_t *segment_blocks = (const uint8_t *)(intptr_t)weights[segment];
        uint8_t gathered[qtype_is_x8(types[segment]) ? row_bytes : 1];
        const uint8_t *row = segment_blocks + (r - first) * row_bytes;
        if (qtype_is_x8(types[segment])) {
            /* A group wholly in the range is done at its first row, eight rows at once;
             * a row of a group cut by the range's ends is written back as the file's. */
            const int group_start = r - (r - first) % 8;
            if (group_start >= row_begin && group_start + 8 <= row_end) {
                if (r != group_start) continue;
                const uint8_t *group = segment_blocks + (int64_t)(r - first) * row_bytes;
                const int64_t out_offset = (int64_t)(r - row_begin) * cols;
                at->dequantize_group_x8(type, group, cols / 32, out, out_offset, dtype);
                continue;
            }
            x8_gather_row(types[segment], segment_blocks, r - first, cols, gathered);
            row = gathered;
        }
        const int64_t out_offset = (int64_t)(r - row_begin) * cols;
        at->dequantize_row(type, row, cols / 32, out, out_offset, dtype);
    }
    return 0;
}
