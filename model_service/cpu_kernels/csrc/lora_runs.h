/* How lora_runs.c is told a step's adapters: each run of rows of one adapter, with that
 * adapter's factors for every (layer, target). decode_stack.c and lora_runs.py (the
 * per-layer path) describe runs this way, so both hand lora_add_runs the same work. */
#ifndef PAGEDKV_LORA_RUNS_H
#define PAGEDKV_LORA_RUNS_H

#include <stdint.h>

/* An adapter's factors for one (layer, target), row-major a [rank, in], b [out, rank];
 * a == 0 where the adapter does not train that target on that layer. */
typedef struct {
    int64_t a, b;
    int32_t rank, out_features;
} lora_factor;

/* The targets in a table's order (lora/peft_adapter.py's TARGETS). */
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_TARGETS };

struct lora_run { /* pagedkv_kernels.h names it */
    int32_t start, end; /* the step's rows [start, end) */
    float scaling;
    int32_t layers;             /* the table's layers: a layer past them is one the adapter leaves alone */
    const lora_factor *factors; /* [layers][LORA_TARGETS]; runs of one adapter share one table */
};

#endif
