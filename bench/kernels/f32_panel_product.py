"""float32 linears every way pagedkv can run them, in turns in one process: torch's plain
product (the BLAS torch was built with, MKL on x86), oneDNN on the weight packed once
(models/packed_linear.py) and the float32 panel kernel (cpu_kernels/csrc/f32_matmul.c) at
each level asked for, at SmolLM2-135M's shapes and the random 19M Llama's (hidden 256,
intermediate 688, vocabulary 32000).

    .venv/bin/python -m bench.kernels.f32_panel_product [--shapes llama19m,smollm2 lm_head,4096x1024]
        [--tokens 1,8,32,48,256] [--levels chosen|all|avx2,avx512] [--threads 2] [--rounds 3]
        [--seconds 0.2] [--clock wall|thread]

Each row: the best round's µs a call of each path, and torch's time over each other path's
(above 1: that path wins). Every path is checked against torch's product first (float32
sums in another order: close, not equal). --levels all runs every panel level this CPU
has, so one machine compares its AVX2 level with its best (a level it lacks is said and
skipped). A step's lm_head takes each sequence's last row alone, so lm_head rows stop at
64 tokens. With --threads 1 --clock thread it times the calling thread's CPU time, which
holds steadier than the wall clock on a machine other work shares; with one thread each
panel level's GFLOP/s is also read against that level's FMA peak on one thread
(fma_peak.py: the ceiling any float32 product can reach there).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from bench.kernels.fma_peak import peaks
from bench.kernels.quant_product import add_turn_arguments, best_in_turns
from model_service.cpu_kernels import f32_matmul, levels
from model_service.models.packed_linear import PackedLinear

SHAPES = {
    "smollm2 qkv": (1728, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
    "llama19m qkv": (768, 256), "llama19m gate_up": (1376, 256), "llama19m down": (256, 688),
    "llama19m lm_head": (32000, 256),
}
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def chosen_shapes(spec: str) -> dict[str, tuple[int, int]]:
    """Names of SHAPES, prefixes of them ("llama19m") or ROWSxCOLS, comma-separated."""
    if not spec:
        return dict(SHAPES)
    chosen = {}
    for item in spec.split(","):
        if "x" in item and item.replace("x", "").isdigit():
            rows, cols = map(int, item.split("x"))
            chosen[item] = (rows, cols)
            continue
        matches = {name: shape for name, shape in SHAPES.items() if name == item or name.startswith(item + " ")}
        if not matches:
            raise SystemExit(f"unknown shape {item!r}: one of {', '.join(SHAPES)}, a model prefix, or ROWSxCOLS")
        chosen.update(matches)
    return chosen


def panel_levels(spec: str) -> list[str]:
    """The panel levels to run: the one this process chose, every one the CPU has, or a list."""
    best = levels.best(f32_matmul.FAMILY.name)
    if spec == "chosen":
        index = f32_matmul.chosen_level()
        return [] if index is None else [f32_matmul.LEVELS[index]]
    wanted = f32_matmul.LEVELS[1:] if spec == "all" else spec.split(",")
    runnable = []
    for name in wanted:
        if name not in f32_matmul.LEVELS:
            raise SystemExit(f"unknown level {name!r}: one of {', '.join(f32_matmul.LEVELS)}")
        if f32_matmul.LEVELS.index(name) > best:
            print(f"skipped: this CPU cannot run the {name} level (its best is {f32_matmul.LEVELS[best]})")
            continue
        runnable.append(name)
    return runnable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="", help="default: every shape of SHAPES")
    parser.add_argument("--tokens", default="1,8,32,48,256")
    parser.add_argument("--levels", default="chosen",
                        help="panel levels: chosen (this process's), all (every one this CPU has), or a list")
    add_turn_arguments(parser, seconds=0.2)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="thread: the calling thread's CPU time (only with --threads 1)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread times the calling thread alone: use it with --threads 1")
    torch.set_num_threads(args.threads)
    tokens = [int(count) for count in args.tokens.split(",")]
    panel_names = panel_levels(args.levels)
    paths = ["torch", "onednn", *(f"panels {name}" for name in panel_names)]
    print(f"{args.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.clock} clock")
    peak = peaks() if args.threads == 1 else {}
    against_peak = [name for name in panel_names if name in peak]
    for name in against_peak:
        print(f"{name} FMA peak, one thread: {peak[name]:.1f} GFLOP/s")
    print(f"| shape | rows x cols | tokens | {' | '.join(f'{path} µs' for path in paths)} | "
          f"{' | '.join(f'torch / {path}' for path in paths[1:])} |"
          + "".join(f" panels {name} GFLOP/s (of peak) |" for name in against_peak))
    print("| --- " * (3 + 2 * len(paths) - 1 + len(against_peak)) + "|")
    with torch.inference_mode():
        for name, (rows, cols) in chosen_shapes(args.shapes).items():
            linear = nn.Linear(cols, rows, bias=False).requires_grad_(False)
            weight = linear.weight
            onednn = PackedLinear.from_linear(linear, keep_weight=True)
            panels = f32_matmul.pack_panels(weight)
            for count in tokens:
                if name.endswith("lm_head") and count > 64:
                    continue
                x = torch.randn(count, cols)
                calls = {"torch": lambda x=x: F.linear(x, weight), "onednn": lambda x=x: onednn(x)}
                for level in panel_names:
                    calls[f"panels {level}"] = (lambda x=x, index=f32_matmul.LEVELS.index(level):
                                                f32_matmul.linear(x, panels, rows, index))
                expected = F.linear(x, weight)
                for call in calls.values():
                    torch.testing.assert_close(call(), expected, rtol=1e-4, atol=1e-4)
                best = best_in_turns(calls, args.rounds, args.seconds, CLOCKS[args.clock])
                times = " | ".join(f"{best[path]:.1f}" for path in paths)
                ratios = " | ".join(f"{best['torch'] / best[path]:.2f}" for path in paths[1:])
                flops = 2 * rows * cols * count
                rates = "".join(f" {flops / best[f'panels {level}'] / 1e3:.0f} "
                                f"({flops / best[f'panels {level}'] / 1e3 / peak[level]:.0%}) |" for level in against_peak)
                print(f"| {name} | {rows} x {cols} | {count} | {times} | {ratios} |{rates}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
