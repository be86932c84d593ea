/* f32_matmul.c's portable level (included by it; its header comment says how the level
 * works): tile_portable. */

static void tile_portable(const void *panel_v, int64_t panel_elems, int np, const void *xv, int64_t x_stride, int nt,
                          int cols, void *y_v, int64_t y_stride, int row0, int rows) {
    const float *x = xv, *panel = panel_v;
    float *y = y_v;
    for (int p = 0; p < np; p++) {
        const float *w = panel + p * panel_elems;
        for (int t = 0; t < nt; t++) {
            const float *xt = x + t * x_stride;
            float acc[PANEL_ROWS] = {0};
            for (int k = 0; k < cols; k++)
                PANEL_UNROLL for (int r = 0; r < PANEL_ROWS; r++)
                    acc[r] = fmaf(w[(int64_t)k * PANEL_ROWS + r], xt[k], acc[r]);
            store_rows(y + t * y_stride, acc, row0 + p * PANEL_ROWS, rows);
        }
    }
}
