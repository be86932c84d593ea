/* The loop that bf16_matmul.c and f32_matmul.c share: how a product y = x W^T over weights
 * held in panels of 16 rows is split between threads and cut into register tiles.
 *
 * Threads split the panels, each a contiguous run of groups so its panels stream in order;
 * a group is `group` panels (four for the fewest tokens: four independent sums keep a
 * load of lines in flight; two otherwise), taken for a tile of up to `token_tile` tokens
 * (as many as the level's registers hold sums for); a tail of panels goes one at a time
 * (the SIMD tiles have cases for 4, 2 and 1). Tokens go BLOCK at a time: their x rows stay
 * in L2 while the panels stream through once a block.
 *
 * Every tile sums a token's products over the columns in order, in one register lane: a
 * token's result is the same bits whatever tile and batch it is in, which is what lets
 * decode_stack.c and the per-layer path share the kernels. */
#ifndef PAGEDKV_PANEL_DRIVER_H
#define PAGEDKV_PANEL_DRIVER_H

#include <omp.h>
#include <stdint.h>

#define PANEL_ROWS 16
#define PANEL_TOKEN_BLOCK 128

/* Put before every loop that indexes a tile's array of register sums (over its panels,
 * halves or tokens, constants where the tile is inlined): GCC keeps such an array in
 * registers only when each index is a constant, that is when every loop over it is unrolled
 * whole; otherwise it stores each sum to the stack at every column, and the stores, not the
 * FMAs, set the tile's pace. */
#define PANEL_UNROLL _Pragma("GCC unroll 16")

/* A tile: np panels (panel_elems apart) times nt tokens (x rows x_stride elements apart),
 * y rows y_stride apart from column row0; `depth` the panels' columns (or column pairs). */
typedef void (*panel_tile_fn)(const void *panel, int64_t panel_elems, int np, const void *x, int64_t x_stride,
                              int nt, int depth, void *y, int64_t y_stride, int row0, int rows);

/* Writes np panels (panel_elems elements apart) as float32 panels of the same number of
 * elements, one after another at out, in the layout the plan's tile reads. */
typedef void (*panel_widen_fn)(const void *panels, int64_t panel_elems, int np, float *out);

typedef struct {
    panel_tile_fn tile;
    int group, token_tile;
    size_t weight_bytes, x_bytes, y_bytes; /* an element of the panels, of x, of y */
    /* Products of fewer multiply-adds (tokens x rows x cols) run on the calling thread:
     * splitting them saves less than waking the other threads costs, and on a machine
     * whose cores are all busy a parallel region waits for a descheduled thread. 0: any
     * product with more than one group is split. */
    int64_t min_parallel_macs;
    /* NULL, or: each group of panels is widened once a block of tokens into a thread's
     * scratch (panel_scratch_floats each), which the tile then reads. */
    panel_widen_fn widen;
} panel_plan;

/* The floats of a thread's scratch for a plan with `widen`. */
static inline int64_t panel_scratch_floats(const panel_plan *plan, int64_t panel_elems) {
    return plan->widen ? (int64_t)plan->group * panel_elems : 0;
}

/* What a level of a panel product brings to its plan (a row of the kernel's table of levels,
 * cpu_levels.h): its tile; `few_group` panels a group up to `few_tokens` tokens, `group`
 * past them; its tile's tokens; the bytes of an element of x as the tile reads it. */
typedef struct {
    panel_tile_fn tile;
    int few_tokens, few_group, group, token_tile;
    size_t x_bytes;
} panel_level;

static inline panel_plan panel_plan_at(const panel_level *level, int tokens, size_t weight_bytes, size_t y_bytes,
                                       int64_t min_parallel_macs) {
    const panel_plan plan = {level->tile, tokens <= level->few_tokens ? level->few_group : level->group,
                             level->token_tile, weight_bytes, level->x_bytes, y_bytes, min_parallel_macs, NULL};
    return plan;
}

/* scratch: with plan->widen, num_threads scratches of panel_scratch_floats floats, one after
 * another; else NULL. */
static inline void panel_drive(const panel_plan *plan, const void *panels, int64_t panel_elems, int depth, int rows,
                               const void *x, int64_t x_stride, int tokens, void *y, int64_t y_stride,
                               int num_threads, float *scratch) {
    const int num_panels = (rows + PANEL_ROWS - 1) / PANEL_ROWS, group = plan->group;
    const int groups = (num_panels + group - 1) / group;
    const char *ws = panels, *xs = x;
    char *ys = y;
    const int split = num_threads > 1 && groups > 1 && (int64_t)tokens * rows * depth >= plan->min_parallel_macs;
#pragma omp parallel num_threads(num_threads) if (split)
    {
        const int workers = omp_get_num_threads(), me = omp_get_thread_num();
        const int g0 = (int)((int64_t)groups * me / workers), g1 = (int)((int64_t)groups * (me + 1) / workers);
        float *mine = plan->widen ? scratch + (size_t)me * panel_scratch_floats(plan, panel_elems) : NULL;
        for (int t0 = 0; t0 < tokens; t0 += PANEL_TOKEN_BLOCK) {
            const int t_end = t0 + PANEL_TOKEN_BLOCK < tokens ? t0 + PANEL_TOKEN_BLOCK : tokens;
            for (int g = g0; g < g1; g++) {
                const int p0 = g * group, np = p0 + group <= num_panels ? group : num_panels - p0;
                const char *group_panels = ws + (size_t)p0 * panel_elems * plan->weight_bytes;
                size_t element = plan->weight_bytes;
                if (mine != NULL) {
                    plan->widen(group_panels, panel_elems, np, mine);
                    group_panels = (const char *)mine;
                    element = sizeof(float);
                }
                for (int t = t0; t < t_end; t += plan->token_tile) {
                    const int nt = t + plan->token_tile <= t_end ? plan->token_tile : t_end - t;
                    for (int p = p0; p < p0 + np;) {
                        const int here = np - (p - p0) >= group ? group : 1;
                        plan->tile(group_panels + (size_t)(p - p0) * panel_elems * element, panel_elems, here,
                                   xs + (size_t)t * x_stride * plan->x_bytes, x_stride, nt, depth,
                                   ys + (size_t)t * y_stride * plan->y_bytes, y_stride, p * PANEL_ROWS, rows);
                        p += here;
                    }
                }
            }
        }
    }
}

#endif
