"""A float32 lm_head's product three ways, in turns: torch's plain linear (the BLAS torch was
built with, MKL), oneDNN on the weight packed once (PackedLinear, what pack_linears gives a
float32 lm_head) and the C panel kernel (PanelLinear, what the decoder layers get).

    .venv/bin/python -m bench.kernels.f32_lm_head [--shapes 32000x256,49152x576]
        [--tokens 1,8,32,128] [--threads 2] [--rounds 3] [--seconds 0.3] [--clock wall]

Each cell is the best round's milliseconds a product (rounds alternate the three paths);
the last columns are torch's time over each packed path's. The decoder layers' shapes at
prefill sizes go through it too (--shapes 1376x256,256x688,576x1536,3072x576). With
--threads 1 --clock thread it times the calling thread's CPU time, which holds steadier than
the wall clock on a machine other work shares.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from bench.kernels.quant_product import add_turn_arguments, best_in_turns
from model_service.cpu_kernels import f32_matmul
from model_service.models.packed_linear import PackedLinear
from model_service.models.panel_linear import PanelLinear


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32000x256,49152x576", help="ROWSxCOLS of the lm_head, comma-separated")
    parser.add_argument("--tokens", default="1,8,32,128")
    add_turn_arguments(parser, seconds=0.3)
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="thread: the calling thread's CPU time (only with --threads 1)")
    args = parser.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread times the calling thread alone: use it with --threads 1")
    torch.set_num_threads(args.threads)
    level = f32_matmul.chosen_level()
    print("| shape | tokens | torch ms | oneDNN packed ms | panels ms | torch / oneDNN | torch / panels |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        rows, cols = map(int, shape.split("x"))
        linear = nn.Linear(cols, rows, bias=False).requires_grad_(False)
        paths = {"torch": linear, "onednn": PackedLinear.from_linear(linear, keep_weight=True)}
        if level is not None:
            paths["panels"] = PanelLinear.from_linear(linear, level, keep_weight=True)
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, cols)
            with torch.inference_mode():
                best_us = best_in_turns({name: lambda path=path: path(x) for name, path in paths.items()},
                                        args.rounds, args.seconds, CLOCKS[args.clock])
            best = {name: us / 1e3 for name, us in best_us.items()}
            panels = best.get("panels", float("nan"))
            print(f"| {shape} | {tokens} | {best['torch']:.2f} | {best['onednn']:.2f} | {panels:.2f} | "
                  f"{best['torch'] / best['onednn']:.2f} | {best['torch'] / panels:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
