"""Decode steps of SmolLM2's Q4_1 GGUF in process, four paths in turns: --weights native
with a decode step's layers in one C call (models/cpu_decode_stack.py, the default), the
same with the blocks held as the file has them (PAGEDKV_QUANT_REPACK=0: not interleaved,
csrc/quant_x8.h), native through the per-layer modules, and --weights dequantize. One sequence, greedy,
tokens/s per round and their median (no services, no gRPC; harness/paged_runner.py does the
bookkeeping, and its logits each step). A quick check where bench/serve/bench_quantized.py's service
pairs are too slow to start on a loaded machine.

    .venv/bin/python -m bench.engine.quantized_decode_inprocess [--threads 2] [--rounds 5] [--steps 32]
"""

import argparse
import os
import statistics
import time

import torch

from harness.paged_runner import PagedRunner

from model_service.loading.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round")
    parser.add_argument("--skip-dequantize", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = load_model("smollm2", torch.float32, "cpu", weights="native")
    os.environ["PAGEDKV_QUANT_REPACK"] = "0"
    file_layout = load_model("smollm2", torch.float32, "cpu", weights="native")
    del os.environ["PAGEDKV_QUANT_REPACK"]
    paths = {"native, one call a step": (native, True), "native, file's layout, one call a step": (file_layout, True),
             "native, per layer": (native, False)}
    if not args.skip_dequantize:
        paths["dequantize"] = (load_model("smollm2", torch.float32, "cpu", weights="dequantize"), True)
    rates: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(args.rounds):
        names = list(paths)
        names = names[round_index % len(names):] + names[:round_index % len(names)]  # who goes first rotates
        for name in names:
            loaded, stack = paths[name]
            loaded.model.decode_stack_enabled = stack
            runner = PagedRunner(loaded.model, loaded.config)
            (logits,) = runner.step([("a", list(range(1, 41)))], 0)  # a 40-token prompt
            token = int(logits[-1].argmax())
            started = time.perf_counter()
            for _ in range(args.steps):
                (logits,) = runner.step([("a", [token])], 1)
                token = int(logits[-1].argmax())
            rates[name].append(args.steps / (time.perf_counter() - started))
    print(f"| path | decode tokens/s, median | rounds | ({args.threads} threads, {args.steps} steps a round) |")
    print("| --- | --- | --- | --- |")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} | |")


if __name__ == "__main__":
    main()
