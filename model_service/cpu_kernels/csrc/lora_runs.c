/* A step's LoRA deltas for one projection in one call: every run of rows, for each of the
 * projection's targets (q, k and v write apart into the fused qkv's columns and read the
 * same x, as do gate and up), through lora_sgmv.c's or lora_sgmv_bf16.c's kernel. The
 * decode stack (decode_stack.c) and the per-layer path (models/lora_delta.py, through
 * cpu_kernels/lora_runs.py) both call it, so a step's deltas are the same bits on either.
 *
 * Each run goes through lora_shrink_expand with its own rows, as it would alone, so a row's
 * delta does not depend on how the runs are shared out. What this adds is the order: the
 * callers list the runs of one adapter next to each other (lora_runs.py sorts them), and
 * the work is shared out by (adapter, target), so one thread takes all of an adapter's runs
 * of a target back to back while its factors are in its cache. Requests spread over
 * adapters make runs of one row each, whose neighbours are other adapters': taken in row
 * order, every row would fetch its adapter's factors again from further out in memory.
 *
 * The (adapter, target) items share out one parallel region between the threads, the
 * adapters with the most rows first (dynamic scheduling evens out the rest), each run on
 * one thread. A single item runs on all threads, the kernel sharing out its rows. */
#include <stdlib.h>

#include "cpu_math.h"
#include "lora_runs.h"
#include "pagedkv_kernels.h"

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

/* The runs [first, last) of one adapter, for one target. */
static int one_item(const lora_run *runs, int first, int last, int layer, int target, int column, const void *x,
                    int64_t x_stride, int in_features, void *y, int64_t y_stride, int dtype, int level,
                    int num_threads) {
    if (layer >= runs[first].layers) return 0;
    const lora_factor *f = &runs[first].factors[layer * LORA_TARGETS + target];
    if (f->a == 0) return 0;
    int status = 0;
    for (int r = first; r < last && status == 0; r++)
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
    /* starts[g]: the first run of adapter group g (a stretch of runs sharing one table);
     * rows[g]: its rows; order: the groups by rows, most first, ties in table order. */
    int *starts = malloc((size_t)(3 * num_runs + 1) * sizeof(int));
    if (starts == NULL) return 3;
    int *rows = starts + num_runs + 1, *order = rows + num_runs, groups = 0;
    for (int r = 0; r < num_runs; r++) {
        if (r == 0 || runs[r].factors != runs[r - 1].factors) {
            starts[groups] = r;
            rows[groups++] = 0;
        }
        rows[groups - 1] += runs[r].end - runs[r].start;
    }
    starts[groups] = num_runs;
    for (int g = 0; g < groups; g++) {
        int at = g;
        for (; at > 0 && rows[order[at - 1]] < rows[g]; at--) order[at] = order[at - 1];
        order[at] = g;
    }
    const int items = groups * count;
    int status = 0;
    if (items > 1 && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) reduction(| : status)
        for (int i = 0; i < items; i++) {
            const int g = order[i / count], t = i % count;
            status |= one_item(runs, starts[g], starts[g + 1], layer, targets[t], columns[t], x, x_stride,
                               in_features, y, y_stride, dtype, level, 1);
        }
    } else {
        for (int i = 0; i < items && status == 0; i++) {
            const int g = order[i / count], t = i % count;
            status = one_item(runs, starts[g], starts[g + 1], layer, targets[t], columns[t], x, x_stride,
                              in_features, y, y_stride, dtype, level, num_threads);
        }
    }
    free(starts);
    return status;
}
