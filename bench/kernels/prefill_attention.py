"""Prefill attention on CPU, in turns in one process: SDPA a sequence at a time
(attention/torch_paged.py's prefill_attention_torch, over this step's K/V), the C decode
kernel with each prompt token a query over its own context (what attention/backend.py
did for float32 pools, and for bfloat16 ones without AVX-512 BF16, before the prefill
kernel had other levels) at each of its levels this CPU runs, and the prefill kernel
(cpu_kernels/prefill_attention.py: eight queries a vector at the portable and AVX2
levels, sixteen at AVX-512F and AVX-512 BF16, where a float32 pool takes the AVX-512F
tile) at each of its levels.

    .venv/bin/python -m bench.kernels.prefill_attention [--threads 2] [--rounds 3] [--seconds 0.4]
        [--dtype float32|bfloat16]

SmolLM2's geometry (9 query heads, 3 K/V heads, head_dim 64, blocks of 16), no cached
prefix; batches of prompts as a prefill step carries them. Best of the rounds, ms a
call (one layer); the last column is the decode kernel at its portable level (what
served before) over the best prefill level.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from model_service.attention.torch_paged import prefill_attention_torch
from model_service.cpu_kernels import paged_decode, prefill_attention
from bench.kernels.quant_product import add_turn_arguments, best_in_turns, kernel_library

BLOCK, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 9, 3, 64
random.seed(0)
BATCHES = {
    "7 prompts of 8-200 (W48's)": [random.randint(8, 200) for _ in range(7)],
    "20 x 30": [30] * 20,
    "16 x 128": [128] * 16,
    "4 x 512": [512] * 4,
    "1 x 2048": [2048],
}


def paths(lens: list[int], library, dtype: torch.dtype) -> dict:
    blocks = [-(-length // BLOCK) for length in lens]
    pool = torch.randn(2, sum(blocks) + 1, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    first = 1
    for seq, count in enumerate(blocks):
        tables[seq, :count] = torch.arange(first, first + count)
        first += count
    q = torch.randn(sum(lens), Q_HEADS, HEAD_DIM).to(dtype)

    def gathered(side: int) -> torch.Tensor:
        return torch.cat([pool[side][tables[seq, :blocks[seq]].long()].flatten(0, 1)[:length]
                          for seq, length in enumerate(lens)])

    k_new, v_new = gathered(0), gathered(1)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    context = torch.cat([torch.arange(1, length + 1, dtype=torch.int32) for length in lens])

    def sdpa():
        return prefill_attention_torch(q, pool, tables, tuple(lens), tuple(lens), HEAD_DIM ** -0.5, k_new, v_new)

    def decode_kernel(level: int):
        return lambda: paged_decode.paged_decode_attention(library, q, pool, tables.index_select(0, rows), context,
                                                           HEAD_DIM ** -0.5, level=level)

    def prefill_kernel(level: int):
        def run():
            out = torch.empty_like(q)
            prefill_attention.prefill_attention(library, q, pool, prefill_attention.prefill_sequences(tables, lens, lens),
                                                HEAD_DIM ** -0.5, None, out, level=level)
            return out
        return run

    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    found = {"sdpa": sdpa}
    for level in range(paged_decode.best_level(library) + 1):
        found[f"decode {paged_decode.LEVELS[level]}"] = decode_kernel(level)
    if prefill_attention.supports(library, q, pool):
        for level in range(prefill_attention.best_level(library) + 1):
            found[f"prefill {prefill_attention.LEVELS[level]}"] = prefill_kernel(level)
    for path in found.values():
        torch.testing.assert_close(path().float(), sdpa().float(), atol=tolerance, rtol=tolerance)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_turn_arguments(parser, seconds=0.4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    library = kernel_library(args)
    if library is None:
        return 1
    print(f"{args.dtype}, {args.threads} threads; ms a call (one layer)")
    header = False
    for name, lens in BATCHES.items():
        best = {key: us / 1e3 for key, us in best_in_turns(paths(lens, library, getattr(torch, args.dtype)),
                                                           args.rounds, args.seconds).items()}
        if not header:
            print(f"| prompts | tokens | {' | '.join(best)} | decode portable / best prefill |")
            print("| --- " * (len(best) + 3) + "|")
            header = True
        prefills = [ms for key, ms in best.items() if key.startswith("prefill")]
        ratio = f"{best['decode portable'] / min(prefills):.2f}" if prefills else "-"
        print(f"| {name} | {sum(lens)} | {' | '.join(f'{ms:.2f}' for ms in best.values())} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
