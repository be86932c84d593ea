"""float32 linears: torch's (oneDNN / MKL) against a float32 panel kernel at the AVX2 level
(bench/f32_panel_product.c: bf16_matmul.c's panels with float32 weights), in turns in one
process, at SmolLM2-135M's shapes and the random 19M Llama's (hidden 256, intermediate 688,
vocabulary 32000): whether float32 models should take a panel kernel too.

    .venv/bin/python bench/f32_panel_product.py [--tokens 1,8,32,256] [--threads 2]
        [--rounds 3] [--seconds 0.2]

Each row: the best round's µs a call of each path and torch / panels (above 1: the panels
win). The panel product is checked against torch's first (float32 sums in another order:
close, not equal).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from quant_product import add_turn_arguments, best_in_turns  # noqa: E402

SHAPES = {
    "smollm2 qkv": (1728, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
    "smollm2 lm_head": (49152, 576),
    "llama19m qkv": (768, 256), "llama19m gate_up": (1376, 256), "llama19m down": (256, 688),
    "llama19m lm_head": (32000, 256),
}


def build(directory: Path) -> ctypes.CDLL:
    library = directory / "f32_panel.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-o", str(library),
                    str(Path(__file__).with_suffix(".c"))], check=True)
    loaded = ctypes.CDLL(str(library))
    loaded.f32_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    loaded.f32_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return loaded


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,32,256")
    add_turn_arguments(parser, seconds=0.2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = [int(count) for count in args.tokens.split(",")]
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        library = build(Path(scratch))
        print(f"{args.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")
        print("| shape | rows x cols | tokens | torch µs | panels µs | torch / panels |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (rows, cols) in SHAPES.items():
            weight = torch.randn(rows, cols) / cols ** 0.5
            panels = torch.empty(((rows + 15) // 16) * 16 * cols)
            library.f32_pack(weight.data_ptr(), rows, cols, panels.data_ptr())
            for count in tokens:
                if name.endswith("lm_head") and count > 32:
                    continue  # a step's lm_head takes each sequence's last row alone
                x = torch.randn(count, cols)
                out = torch.empty(count, rows)

                def ours(x=x, out=out):
                    library.f32_linear(x.data_ptr(), cols, count, cols, rows, panels.data_ptr(), out.data_ptr(),
                                       rows, args.threads)
                    return out

                torch.testing.assert_close(ours(), F.linear(x, weight), rtol=1e-4, atol=1e-4)
                best = best_in_turns({"torch": lambda x=x: F.linear(x, weight), "panels": ours}, args.rounds,
                                     args.seconds)
                print(f"| {name} | {rows} x {cols} | {count} | {best['torch']:.1f} | {best['panels']:.1f} "
                      f"| {best['torch'] / best['panels']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
