"""float32 linears: torch's (oneDNN / MKL) against the float32 panel kernel
(model_service/cpu_kernels/csrc/f32_matmul.c, at the level PAGEDKV_F32_KERNELS or the CPU
picks), in turns in one process, at SmolLM2-135M's shapes and the random 19M Llama's
(hidden 256, intermediate 688, vocabulary 32000): where float32 models gain by the panels.

    .venv/bin/python -m bench.kernels.f32_panel_product [--tokens 1,8,32,48,256] [--threads 2]
        [--rounds 3] [--seconds 0.2]

Each row: the best round's µs a call of each path and torch / panels (above 1: the panels
win). The panel product is checked against torch's first (float32 sums in another order:
close, not equal).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from bench.kernels.quant_product import add_turn_arguments, best_in_turns

from model_service.cpu_kernels import f32_matmul

SHAPES = {
    "smollm2 qkv": (1728, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
    "llama19m qkv": (768, 256), "llama19m gate_up": (1376, 256), "llama19m down": (256, 688),
    "llama19m lm_head": (32000, 256),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32,48,256")
    add_turn_arguments(parser, seconds=0.2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(count) for count in args.tokens.split(",")]
    level = f32_matmul.chosen_level()
    if level is None:
        print(f"{f32_matmul.ENV} or this CPU chose torch's product: nothing to compare")
        return 1
    with torch.inference_mode():
        print(f"{args.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
              f"panels at {f32_matmul.LEVELS[level]}")
        print("| shape | rows x cols | tokens | torch µs | panels µs | torch / panels |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (rows, cols) in SHAPES.items():
            weight = torch.randn(rows, cols) / cols ** 0.5
            panels = f32_matmul.pack_panels(weight)
            for count in tokens:
                if name.endswith("lm_head") and count > 64:
                    continue  # a step's lm_head takes each sequence's last row alone
                x = torch.randn(count, cols)

                def ours(x=x, panels=panels, rows=rows):
                    return f32_matmul.linear(x, panels, rows, level)

                torch.testing.assert_close(ours(), F.linear(x, weight), rtol=1e-4, atol=1e-4)
                best = best_in_turns({"torch": lambda x=x: F.linear(x, weight), "panels": ours}, args.rounds,
                                     args.seconds)
                print(f"| {name} | {rows} x {cols} | {count} | {best['torch']:.1f} | {best['panels']:.1f} "
                      f"| {best['torch'] / best['panels']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
