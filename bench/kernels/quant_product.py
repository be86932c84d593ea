"""One quantized linear at SmolLM2's shapes, by the integer kernel (activations to 8 bits,
integer dot products) and by the float product (weights dequantized a tile at a time,
F.linear in bfloat16), in turns in one process: what quant_matmul.linear should pick at
each token count.

    .venv/bin/python -m bench.kernels.quant_product [--types q4_1,q8_0] [--tokens 1,4,16,48,128,512]
        [--threads 2] [--rounds 3] [--seconds 0.3] [--dtype float32|bfloat16]

Random blocks (finite scales), rows held as the model service holds them (interleaved
where the type has that layout). Each round runs every path for --seconds; the table
has the best round's µs a call (the machine is shared: the best is the least disturbed).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from model_service import cpu_kernels
from model_service.cpu_kernels import quant_matmul
from harness.random_quant_blocks import random_blocks

TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q6_k": 14}
# SmolLM2-135M: fused q/k/v, o, fused gate/up, down (rows x cols)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def per_call_us(fn, seconds: float, clock=time.perf_counter) -> float:
    """µs a call by `clock` (time.thread_time: the calling thread's CPU time, steadier than
    the wall clock on a shared machine for a path that runs on that thread alone)."""
    fn()
    calls, start = 0, clock()
    while clock() - start < seconds:
        fn()
        calls += 1
    return (clock() - start) / calls * 1e6


def best_in_turns(paths: dict, rounds: int, seconds: float, clock=time.perf_counter) -> dict[str, float]:
    """Each path's best µs a call over `rounds` rounds, the paths taking turns in each (the
    machine is shared: the best is the least disturbed)."""
    best = {name: float("inf") for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            best[name] = min(best[name], per_call_us(fn, seconds, clock))
    return best


def add_turn_arguments(parser: argparse.ArgumentParser, seconds: float) -> None:
    """--threads, --rounds, --seconds: how the kernel benchmarks here run their paths in turns."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=seconds)


def kernel_library(args: argparse.Namespace):
    """The CPU kernel library at args.threads threads, or None (said why on stdout)."""
    torch.set_num_threads(args.threads)
    library = cpu_kernels.load()
    if library is None:
        print(f"no CPU kernels: {cpu_kernels.load_error()}")
    return library


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default="q4_1,q8_0")
    parser.add_argument("--tokens", default="1,4,16,48,128,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    add_turn_arguments(parser, seconds=0.3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    library = kernel_library(args)
    if library is None:
        return 1
    level = quant_matmul.chosen_level(library)
    dtype = getattr(torch, args.dtype)
    print(f"level {quant_matmul.LEVELS[level]}, {args.threads} threads, activations {args.dtype}")
    print("| type | shape | rows x cols | tokens | integer µs | float µs | float / integer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for type_name in args.types.split(","):
        type_code = TYPES[type_name]
        for shape in args.shapes.split(","):
            rows, cols = SHAPES[shape]
            blocks = torch.from_numpy(random_blocks(type_code, rows, cols, seed=rows + cols))
            code = quant_matmul.repack(library, type_code, blocks)
            segments = quant_matmul.Segments([(code, blocks)], cols)
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)).to(dtype)
                paths = {
                    "integer": lambda: quant_matmul.linear(library, x, segments, level, float_from=None),
                    "float": lambda: quant_matmul.float_product(library, x, segments, level),
                }
                best = best_in_turns(paths, args.rounds, args.seconds)
                print(f"| {type_name.upper()} | {shape} | {rows} x {cols} | {tokens} | {best['integer']:,.0f} | "
                      f"{best['float']:,.0f} | {best['float'] / best['integer']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
