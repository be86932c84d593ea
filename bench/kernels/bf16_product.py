"""bfloat16 linears at SmolLM2's shapes by the C kernel (bf16_matmul.c's panels, at the
CPU's best level or --level), by torch in bfloat16 (oneDNN's packed product, PackedLinear,
where this CPU's oneDNN has bfloat16; torch's eager F.linear elsewhere) and by torch in
float32 on the same weights widened, in turns in one process: one product at a time
(weights that stay in cache when the call repeats), and a decode step's 120 layer linears
of 30 distinct layers (212 MB in bfloat16, read from memory as a real step reads them).

    .venv/bin/python -m bench.kernels.bf16_product [--tokens 1,4,8,16,32,64,256,2048]
        [--level avx2] [--threads 2] [--rounds 3] [--seconds 0.3] [--skip-single]

Each round runs every path for --seconds; the tables have the best round's time (the
machine is shared: the best is the least disturbed), and each path's time over the C
kernel's (above 1: the C kernel is faster).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

from model_service.cpu_kernels import bf16_matmul
from model_service.models.packed_linear import PackedLinear, packing_supported
from model_service.models.panel_linear import PanelLinear
from bench.kernels.quant_product import SHAPES, add_turn_arguments, best_in_turns, kernel_library

LM_HEAD = (49152, 576)
LAYERS = 30


def paths(rows: int, cols: int, level: int, seed: int) -> dict:
    """The same weight as each path multiplies it: name -> callable(x bfloat16)."""
    torch.manual_seed(seed)
    linear = nn.Linear(cols, rows, bias=False).to(torch.bfloat16)
    panels = PanelLinear.from_linear(linear, level)
    widened = linear.weight.detach().float()
    if packing_supported("cpu", torch.bfloat16):
        bf16 = PackedLinear.from_linear(linear)
    else:
        weight = linear.weight.detach()
        bf16 = lambda x: F.linear(x, weight)  # noqa: E731
    return {"C": panels, "torch bf16": bf16, "float32": lambda x: F.linear(x.float(), widened)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4,8,16,32,64,256,2048")
    parser.add_argument("--level", choices=bf16_matmul.LEVELS, help="the C kernel's (default: the CPU's best)")
    add_turn_arguments(parser, seconds=0.3)
    parser.add_argument("--skip-single", action="store_true", help="only the 120 linears of a step")
    args = parser.parse_args()
    library = kernel_library(args)
    if library is None:
        return 1
    level = bf16_matmul.LEVELS.index(args.level) if args.level else bf16_matmul.cpu_level()
    if level > bf16_matmul.cpu_level():
        print(f"this CPU runs {bf16_matmul.LEVELS[bf16_matmul.cpu_level()]} at best")
        return 1
    tokens = [int(count) for count in args.tokens.split(",")]
    bf16_name = "oneDNN packed" if packing_supported("cpu", torch.bfloat16) else "torch eager"
    print(f"C kernel level {bf16_matmul.LEVELS[level]}, torch bf16: {bf16_name}, {args.threads} threads")
    names = ("C", "torch bf16", "float32")
    with torch.inference_mode():
        if not args.skip_single:
            print("\n| shape | rows x cols | tokens | C µs | torch bf16 µs | float32 µs | bf16 / C | float32 / C |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for name, (rows, cols) in {**SHAPES, "lm_head": LM_HEAD}.items():
                each = paths(rows, cols, level, seed=rows + cols)
                for count in tokens:
                    if name == "lm_head" and count > 64:
                        continue  # a step's lm_head takes each sequence's last row alone
                    x = torch.randn(count, cols).to(torch.bfloat16)
                    best = best_in_turns({path: (lambda f=each[path]: f(x)) for path in names}, args.rounds,
                                         args.seconds)
                    print(f"| {name} | {rows} x {cols} | {count} | {best['C']:.1f} | {best['torch bf16']:.1f} "
                          f"| {best['float32']:.1f} | {best['torch bf16'] / best['C']:.2f} "
                          f"| {best['float32'] / best['C']:.2f} |")
        layers = [paths(rows, cols, level, seed=index) for index in range(LAYERS) for rows, cols in SHAPES.values()]
        weight_bytes = sum(2 * rows * cols for rows, cols in SHAPES.values()) * LAYERS
        print(f"\n{LAYERS} layers' linears, {weight_bytes / 1e6:.0f} MB in bfloat16 (twice that in float32), "
              "one after another as a step runs them")
        print("| tokens | C ms | C GB/s | torch bf16 ms | float32 ms | bf16 / C | float32 / C |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for count in tokens:
            inputs = {cols: torch.randn(count, cols).to(torch.bfloat16) for _, cols in SHAPES.values()}
            shapes = list(SHAPES.values()) * LAYERS
            steps = {path: (lambda path=path: [layer[path](inputs[cols]) for layer, (_, cols) in zip(layers, shapes)])
                     for path in names}
            best = {path: us / 1e3 for path, us in best_in_turns(steps, args.rounds, args.seconds).items()}
            print(f"| {count} | {best['C']:.2f} | {weight_bytes / best['C'] / 1e6:.1f} | {best['torch bf16']:.2f} "
                  f"| {best['float32']:.2f} | {best['torch bf16'] / best['C']:.2f} "
                  f"| {best['float32'] / best['C']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
