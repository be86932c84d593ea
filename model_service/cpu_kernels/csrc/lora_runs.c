/* A step's LoRA deltas for one projection in one call: every run of rows, for each of the
 * projection's targets (q, k and v write apart into the fused qkv's columns and read the
 * same x, as do gate and up), through lora_sgmv.c's or lora_sgmv_bf16.c's kernel. The
 * decode stack (decode_stack.c) and the per-layer path (models/lora_delta.py, through
 * cpu_kernels/lora_runs.py) both call it, so a step's deltas are the same bits on either.
 *
 * Each run's rows get the bits lora_shrink_expand gives the run alone (below: some go
 * through a grouped path that keeps them), so a row's delta does not depend on how the runs
 * are shared out. What this adds is the order: the
 * callers list the runs of one adapter next to each other (lora_runs.py sorts them), and
 * the work is shared out by (adapter, target), so one thread takes all of an adapter's runs
 * of a target back to back while its factors are in its cache. Requests spread over
 * adapters make runs of one row each, whose neighbours are other adapters': taken in row
 * order, every row would fetch its adapter's factors again from further out in memory.
 *
 * The (adapter, target) items share out one parallel region between the threads, the
 * adapters with the most rows first (dynamic scheduling evens out the rest), each run on
 * one thread. A single item runs on all threads, the kernel sharing out its rows.
 *
 * An item's short runs (under LORA_TRANSPOSE_ROWS rows: a decode step's, each sequence its
 * own run) go to lora_group or lora_group_bf16 together where the level has a grouped path:
 * the adapter's factors transposed (and widened) once for all of those rows rather than
 * used row by row, each row's delta still the bits its run gets alone. */
#include <stdlib.h>

#include "cpu_math.h"
#include "lora_runs.h"
#include "lora_sgmv.h"
#include "pagedkv_kernels.h"

/* Rows of an adapter's short runs from which an item takes them together: one row gains
 * nothing from factors transposed (and widened) for it alone. */
#define LORA_GROUP_ROWS 2

/* A run the kernels take row by row with dot products (lora_sgmv.c says why), whose rows
 * lora_group(_bf16) may take together with the adapter's other such rows. */
static int is_short(const lora_run *run) { return run->end - run->start < LORA_TRANSPOSE_ROWS; }

static int one_run(const lora_run *run, const lora_factor *f, int column, const void *x, int64_t x_stride,
                   int in_features, void *y, int64_t y_stride, int dtype, int level, int num_threads) {
    const int64_t x_at = (int64_t)run->start * x_stride, y_at = (int64_t)run->start * y_stride + column;
    const int rows = run->end - run->start;
    if (dtype == DTYPE_BF16)
        return lora_shrink_expand_bf16((const uint16_t *)x + x_at, x_stride, rows, in_features,
                                       (const uint16_t *)(intptr_t)f->a, f->rank, (const uint16_t *)(intptr_t)f->b,
                                       f->out_features, run->scaling, (uint16_t *)y + y_at, y_stride, level,
                                       num_threads);
    return lora_shrink_expand((const float *)x + x_at, x_stride, rows, in_features, (const float *)(intptr_t)f->a,
                              f->rank, (const float *)(intptr_t)f->b, f->out_features, run->scaling,
                              (float *)y + y_at, y_stride, level, num_threads);
}

/* One adapter's runs, [first, last) of the step's, and the rows of its short ones. */
typedef struct {
    int first, last;
    const int *short_rows;
    int short_count;
} run_group;

/* lora_group's or lora_group_bf16's status for a group's short rows. */
static int group_rows(const run_group *g, const lora_factor *f, int column, const void *x, int64_t x_stride,
                      int in_features, void *y, int64_t y_stride, int dtype, int level, float scaling) {
    if (dtype == DTYPE_BF16)
        return lora_group_bf16((const uint16_t *)x, x_stride, g->short_rows, g->short_count, in_features,
                               (const uint16_t *)(intptr_t)f->a, f->rank, (const uint16_t *)(intptr_t)f->b,
                               f->out_features, scaling, (uint16_t *)y + column, y_stride, level);
    return lora_group((const float *)x, x_stride, g->short_rows, g->short_count, in_features,
                      (const float *)(intptr_t)f->a, f->rank, (const float *)(intptr_t)f->b, f->out_features, scaling,
                      (float *)y + column, y_stride, level);
}

/* A group's runs for one target: its short runs' rows together where they are enough and
 * the level has a grouped path (lora_group, lora_group_bf16), the rest run by run.
 * The runs of one adapter share its scaling. */
static int one_item(const lora_run *runs, const run_group *g, int layer, int target, int column, const void *x,
                    int64_t x_stride, int in_features, void *y, int64_t y_stride, int dtype, int level,
                    int num_threads) {
    if (layer >= runs[g->first].layers) return 0;
    const lora_factor *f = &runs[g->first].factors[layer * LORA_TARGETS + target];
    if (f->a == 0) return 0;
    int grouped = 0;
    if (g->short_count >= LORA_GROUP_ROWS) {
        const int status = group_rows(g, f, column, x, x_stride, in_features, y, y_stride, dtype, level,
                                      runs[g->first].scaling);
        if (status > 0) return status;
        grouped = status == 0;
    }
    int status = 0;
    for (int r = g->first; r < g->last && status == 0; r++)
        if (!(grouped && is_short(&runs[r])))
            status = one_run(&runs[r], f, column, x, x_stride, in_features, y, y_stride, dtype, level, num_threads);
    return status;
}

/* Returns 0; 1 for a target outside the table, or a dtype other than float32 and bfloat16;
 * 3 without memory; else the kernel's status (lora_shrink_expand's). */
int lora_add_runs(const lora_run *runs, int num_runs, int layer, int count, const int *targets, const int *columns,
                  const void *x, int64_t x_stride, int in_features, void *y, int64_t y_stride, int dtype, int level,
                  int num_threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 1;
    for (int t = 0; t < count; t++)
        if (targets[t] < 0 || targets[t] >= LORA_TARGETS) return 1;
    if (num_runs <= 0 || count <= 0) return 0;
    /* groups[g]: adapter group g (a stretch of runs sharing one table), its short runs' rows
     * listed in short_rows; rows[g]: its rows; order: the groups by rows, most first, ties
     * in table order. */
    int short_total = 0;
    for (int r = 0; r < num_runs; r++)
        if (is_short(&runs[r])) short_total += runs[r].end - runs[r].start;
    run_group *groups =
        malloc((size_t)num_runs * sizeof(run_group) + (size_t)(2 * num_runs + short_total) * sizeof(int));
    if (groups == NULL) return 3;
    int *rows = (int *)(groups + num_runs), *order = rows + num_runs, *short_rows = order + num_runs, count_groups = 0;
    for (int r = 0, listed = 0; r < num_runs; r++) {
        if (r == 0 || runs[r].factors != runs[r - 1].factors) {
            groups[count_groups] = (run_group){r, r, short_rows + listed, 0};
            rows[count_groups++] = 0;
        }
        run_group *g = &groups[count_groups - 1];
        g->last = r + 1;
        rows[count_groups - 1] += runs[r].end - runs[r].start;
        if (!is_short(&runs[r])) continue;
        for (int row = runs[r].start; row < runs[r].end; row++) short_rows[listed++] = row;
        g->short_count += runs[r].end - runs[r].start;
    }
    for (int g = 0; g < count_groups; g++) {
        int at = g;
        for (; at > 0 && rows[order[at - 1]] < rows[g]; at--) order[at] = order[at - 1];
        order[at] = g;
    }
    const int items = count_groups * count;
    int status = 0;
    if (items > 1 && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) reduction(| : status)
        for (int i = 0; i < items; i++) {
            const int t = i % count;
            status |= one_item(runs, &groups[order[i / count]], layer, targets[t], columns[t], x, x_stride,
                               in_features, y, y_stride, dtype, level, 1);
        }
    } else {
        for (int i = 0; i < items && status == 0; i++) {
            const int t = i % count;
            status = one_item(runs, &groups[order[i / count]], layer, targets[t], columns[t], x, x_stride,
                              in_features, y, y_stride, dtype, level, num_threads);
        }
    }
    free(groups);
    return status;
}
