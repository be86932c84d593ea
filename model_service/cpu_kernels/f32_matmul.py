"""float32 products on CPU by csrc/f32_matmul.c: which level runs, weights rearranged into
its panels and back, and the linear.

PAGEDKV_F32_KERNELS picks who multiplies a float32 model's linears on CPU (levels.py
chooses once per process and logs why):
- unset or "auto": the C kernel at the CPU's best level, AVX-512F or AVX2 (what lets a
  decode step's layers run in decode_stack.c's one call); torch's own product where the
  CPU has neither (the portable C level is the slower there);
- "portable", "avx2" or "avx512": that level of the C kernel (a level above the CPU's is
  refused rather than crashing on an illegal instruction): what a test, or a person
  comparing, runs;
- "torch": torch's product (oneDNN / MKL) on the plain weights.
Every level rounds alike (one fused multiply-add a product, the columns in order), so the
levels give the same bits, and a token's bits do not depend on its batch.
"""

from __future__ import annotations

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.panel_kernels import PANEL_ROWS, PanelKernel

LEVELS = ("portable", "avx2", "avx512")  # f32_matmul.c's FLEVEL_*
ENV = "PAGEDKV_F32_KERNELS"

FAMILY = levels.register(levels.Family(
    name="f32 linears", env=ENV, levels=LEVELS, best="f32_cpu_level",
    requires={"avx2": "AVX2 and FMA", "avx512": "AVX-512F"},
    others=("torch",), auto=lambda best: best if best != "portable" else "torch"))
CHOICES = FAMILY.choices


def chosen_level() -> int | None:
    """The C kernel's level for a float32 model's linears, or None where torch's product
    serves them (PAGEDKV_F32_KERNELS, the CPU, a library that did not build)."""
    return levels.chosen_index(FAMILY.name)


KERNEL = PanelKernel("f32", torch.float32, LEVELS, "the float32 panel kernels")
pack_panels = KERNEL.pack
unpack_panels = KERNEL.unpack
linear = KERNEL.linear


__all__ = ["CHOICES", "ENV", "FAMILY", "LEVELS", "PANEL_ROWS", "chosen_level", "linear", "pack_panels", "unpack_panels"]
