"""bfloat16 linears at SmolLM2's shapes by the C kernel (bf16_matmul.c's panels) and by
oneDNN's packed product (PackedLinear), in turns in one process: one product at a time
(weights that stay in cache when the call repeats), and a decode step's 120 layer linears
of 30 distinct layers (212 MB, read from memory as a real step reads them).

    .venv/bin/python bench/bf16_product.py [--tokens 1,4,8,16,32,64,256,2048]
        [--threads 2] [--rounds 3] [--seconds 0.3] [--skip-single]

Each round runs every path for --seconds; the tables have the best round's time (the
machine is shared: the best is the least disturbed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from model_service.cpu_kernels import bf16_matmul  # noqa: E402
from model_service.models.packed_linear import PackedLinear, packing_supported  # noqa: E402
from model_service.models.panel_linear import PanelLinear  # noqa: E402
from quant_product import SHAPES, add_turn_arguments, best_in_turns, kernel_library  # noqa: E402

LM_HEAD = (49152, 576)
LAYERS = 30


def both(rows: int, cols: int, level: int, seed: int) -> tuple[PanelLinear, PackedLinear]:
    torch.manual_seed(seed)
    linear = nn.Linear(cols, rows, bias=False).to(torch.bfloat16)
    return PanelLinear.from_linear(linear, level), PackedLinear.from_linear(linear)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4,8,16,32,64,256,2048")
    add_turn_arguments(parser, seconds=0.3)
    parser.add_argument("--skip-single", action="store_true", help="only the 120 linears of a step")
    args = parser.parse_args()
    library = kernel_library(args)
    if library is None:
        return 1
    if not packing_supported("cpu", torch.bfloat16):
        print("oneDNN has no bfloat16 on this CPU: nothing to compare against")
        return 1
    level = bf16_matmul.best_level(library)
    tokens = [int(count) for count in args.tokens.split(",")]
    print(f"C kernel level {bf16_matmul.LEVELS[level]}, {args.threads} threads")
    with torch.inference_mode():
        if not args.skip_single:
            print("\n| shape | rows x cols | tokens | C µs | oneDNN µs | oneDNN / C |")
            print("| --- | --- | --- | --- | --- | --- |")
            for name, (rows, cols) in {**SHAPES, "lm_head": LM_HEAD}.items():
                panels, packed = both(rows, cols, level, seed=rows + cols)
                for count in tokens:
                    if name == "lm_head" and count > 64:
                        continue  # a step's lm_head takes each sequence's last row alone
                    x = torch.randn(count, cols).to(torch.bfloat16)
                    best = best_in_turns({"C": lambda: panels(x), "oneDNN": lambda: packed(x)}, args.rounds,
                                         args.seconds)
                    print(f"| {name} | {rows} x {cols} | {count} | {best['C']:.1f} | {best['oneDNN']:.1f} "
                          f"| {best['oneDNN'] / best['C']:.2f} |")
        layers = [both(rows, cols, level, seed=index) for index in range(LAYERS) for rows, cols in SHAPES.values()]
        weight_bytes = sum(2 * rows * cols for rows, cols in SHAPES.values()) * LAYERS
        print(f"\n{LAYERS} layers' linears, {weight_bytes / 1e6:.0f} MB, one after another as a step runs them")
        print("| tokens | C ms | C GB/s | oneDNN ms | oneDNN GB/s | oneDNN / C |")
        print("| --- | --- | --- | --- | --- | --- |")
        for count in tokens:
            inputs = {cols: torch.randn(count, cols).to(torch.bfloat16) for _, cols in SHAPES.values()}
            steps = {path: (lambda path=path: [pair[path](inputs[pair[path].in_features]) for pair in layers])
                     for path in (0, 1)}
            best = best_in_turns({"C": steps[0], "oneDNN": steps[1]}, args.rounds, args.seconds)
            c_ms, onednn_ms = best["C"] / 1e3, best["oneDNN"] / 1e3
            print(f"| {count} | {c_ms:.2f} | {weight_bytes / c_ms / 1e6:.1f} | {onednn_ms:.2f} "
                  f"| {weight_bytes / onednn_ms / 1e6:.1f} | {onednn_ms / c_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
