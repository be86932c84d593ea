"""Greedy sampling's argmax on CPU three ways, in turns: numpy's (what model_service/sample/
sampler.py's argmax_rows serves, over a float32 copy for 16-bit logits), torch's, and the C
kernel of cpu_kernels/argmax.py (in the logits' own dtype).

    .venv/bin/python -m bench.kernels.argmax_paths [--rows 1,8,32,48] [--vocab 32000,49152]
        [--dtypes float32,bfloat16] [--threads 2] [--rounds 3] [--seconds 0.2]

Each cell is the best round's milliseconds a call.
"""

from __future__ import annotations

import argparse

import torch

from bench.kernels.quant_product import add_turn_arguments, best_in_turns
from model_service import cpu_kernels
from model_service.cpu_kernels import argmax as cpu_argmax


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,48")
    parser.add_argument("--vocab", default="32000,49152")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    add_turn_arguments(parser, seconds=0.2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    library = cpu_kernels.load()
    print("| dtype | rows x vocab | numpy ms | torch ms | C kernel ms |")
    print("| --- | --- | --- | --- | --- |")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for vocab in map(int, args.vocab.split(",")):
            for rows in map(int, args.rows.split(",")):
                logits = torch.randn(rows, vocab).to(dtype)
                paths = {"numpy": lambda: logits.float().numpy().argmax(axis=-1),
                         "torch": lambda: logits.argmax(dim=-1)}
                if library is not None:
                    paths["C"] = lambda: cpu_argmax.argmax_rows(library, logits)
                best = {name: us / 1e3 for name, us in best_in_turns(paths, args.rounds, args.seconds).items()}
                print(f"| {str(dtype).removeprefix('torch.')} | {rows} x {vocab} | {best['numpy']:.3f} | "
                      f"{best['torch']:.3f} | {best.get('C', float('nan')):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
