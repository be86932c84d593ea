/* bf16_matmul.c's portable level (included by it; its header comment says how the level
 * works): tile_portable. */

static inline float word_low(uint32_t word) { /* the even column's weight: its word's low half */
    const uint32_t bits = word << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float word_high(uint32_t word) { /* the odd column's: the top half */
    const uint32_t bits = word & 0xffff0000u;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void tile_portable(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride,
                          int nt, int pairs, void *y_v, int64_t y_stride, int row0, int rows) {
    const uint16_t *x = xv, *panel = panel_v;
    uint16_t *y = y_v;
    for (int p = 0; p < np; p++) {
        const uint16_t *w = panel + p * panel_elems;
        for (int t = 0; t < nt; t++) {
            const uint16_t *xt = x + t * x_stride;
            float acc[BF16_PANEL_ROWS] = {0};
            for (int k = 0; k < pairs; k++) {
                const float x0 = bf16_to_f32(xt[2 * k]), x1 = bf16_to_f32(xt[2 * k + 1]);
                uint32_t words[BF16_PANEL_ROWS];
                memcpy(words, w + (int64_t)k * 2 * BF16_PANEL_ROWS, sizeof words);
                /* two separate adds a pair, in the AVX2 level's order */
                for (int r = 0; r < BF16_PANEL_ROWS; r++) acc[r] += word_low(words[r]) * x0;
                for (int r = 0; r < BF16_PANEL_ROWS; r++) acc[r] += word_high(words[r]) * x1;
            }
            const int first = row0 + p * BF16_PANEL_ROWS;
            for (int r = 0; r < BF16_PANEL_ROWS && first + r < rows; r++)
                y[t * y_stride + first + r] = f32_to_bf16(acc[r]);
        }
    }
}
