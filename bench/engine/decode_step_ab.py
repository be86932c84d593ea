"""One decode step of a float32 model on CPU, three ways in turns in one process: torch's
linears layer by layer (PAGEDKV_F32_KERNELS=torch), the float32 panel kernel layer by layer,
and the panels in decode_stack.c's one call; each the step's forward pass and its lm_head,
at a few batch sizes, every sequence's context the same length.

    .venv/bin/python -m bench.engine.decode_step_ab [--model w48|PATH] [--batches 1,16,48]
        [--context 128] [--threads 2] [--rounds 5] [--seconds 0.3]

Each row: the best round's ms a step of each, wall time and the process's CPU time (both
threads, spinning included: on a machine shared with other work the wall time is mostly
waiting for a core, the CPU time much less so), and torch / the stack by each. The stack's logits are checked against the per-layer
panels' first (the same bits) and against torch's (close).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.serve.bench_generate import write_w48_checkpoint
from bench.kernels.quant_product import add_turn_arguments

from model_service.attention.metadata import AttentionMetadata
from model_service.cpu_kernels import f32_matmul
from model_service.loading.loader import load_model

BLOCK = 16


def load(path: Path, kernels: str):
    os.environ[f32_matmul.ENV] = kernels
    try:
        return load_model(str(path), torch.float32, "cpu").model
    finally:
        del os.environ[f32_matmul.ENV]


def decode_step(config, batch: int, context: int):
    """(input ids, positions, pool, metadata) of a step of `batch` sequences at `context`."""
    blocks = (context + BLOCK - 1) // BLOCK
    pool = torch.randn(config.num_layers, 2, batch * blocks + 1, BLOCK, config.num_kv_heads, config.head_dim) * 0.5
    tables = torch.arange(1, batch * blocks + 1, dtype=torch.int32).view(batch, blocks)
    last = context - 1
    meta = AttentionMetadata(
        slot_mapping=(tables[:, last // BLOCK].long() * BLOCK + last % BLOCK), block_tables=tables,
        context_lens=torch.full((batch,), context, dtype=torch.int32), query_lens=(1,) * batch,
        context_lens_host=(context,) * batch, num_decode_seqs=batch, block_size=BLOCK)
    ids = torch.randint(3, config.vocab_size, (batch,))
    return ids, torch.full((batch,), last, dtype=torch.int64), pool, meta


def best_in_turns(paths: dict, rounds: int, seconds: float) -> dict[str, tuple[float, float]]:
    """Each path's best (wall, CPU) ms a call over `rounds` rounds, the paths taking turns."""
    best = {name: (float("inf"), float("inf")) for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            calls, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - wall0 < seconds or calls < 3:
                fn()
                calls += 1
            wall, cpu = (time.perf_counter() - wall0) / calls, (time.process_time() - cpu0) / calls
            best[name] = (min(best[name][0], 1e3 * wall), min(best[name][1], 1e3 * cpu))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="w48")
    parser.add_argument("--batches", default="1,16,48")
    parser.add_argument("--context", type=int, default=128)
    add_turn_arguments(parser, seconds=0.3)
    parser.set_defaults(rounds=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        path = write_w48_checkpoint(Path(tmp) / "w48") if args.model == "w48" else Path(args.model)
        plain, panels = load(path, "torch"), load(path, "auto")
        if f32_matmul.chosen_level() is None:
            print("this CPU runs no panel level: nothing to compare")
            return 1
        config = panels.config

        def step(model, stack: bool, inputs):
            model.decode_stack_enabled = stack
            return model.compute_logits(model(*inputs))

        print(f"{args.threads} threads, context {args.context}, panels at "
              f"{f32_matmul.LEVELS[f32_matmul.chosen_level()]}")
        print("| batch | torch, per layer: wall / CPU ms | panels, per layer | panels, one C call "
              "| torch / one call: wall, CPU |")
        print("| --- | --- | --- | --- | --- |")
        for batch in [int(b) for b in args.batches.split(",")]:
            inputs = decode_step(config, batch, args.context)
            # the pool is written at one slot a sequence, the same values each time: every path sees the same
            stacked, layered = step(panels, True, inputs), step(panels, False, inputs)
            assert torch.equal(stacked, layered), "the stack's logits differ from the per-layer panels'"
            torch.testing.assert_close(stacked, step(plain, False, inputs), rtol=1e-3, atol=1e-3)
            best = best_in_turns({"torch": lambda: step(plain, False, inputs),
                                  "layers": lambda: step(panels, False, inputs),
                                  "stack": lambda: step(panels, True, inputs)}, args.rounds, args.seconds)
            cells = " | ".join(f"{best[name][0]:.2f} / {best[name][1]:.2f}" for name in ("torch", "layers", "stack"))
            print(f"| {batch} | {cells} | {best['torch'][0] / best['stack'][0]:.2f}, "
                  f"{best['torch'][1] / best['stack'][1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
