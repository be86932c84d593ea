"""bfloat16 products on CPU by csrc/bf16_matmul.c: which level runs, weights rearranged
into its panels and back, and the linear.

PAGEDKV_BF16_KERNELS picks who multiplies a bfloat16 model's linears on CPU (levels.py
chooses once per process and logs why):
- unset or "auto": the C kernel at the CPU's best level, AVX-512 BF16 or AVX2 (bfloat16
  weights widened to float32 in registers); oneDNN's packed product
  (models/packed_linear.py) only where the CPU has neither (the portable C level is the
  slower there);
- "portable", "avx2" or "avx512_bf16": that level of the C kernel (a level above the CPU's
  is refused rather than crashing on an illegal instruction): what a test, or a person
  comparing, runs;
- "onednn": oneDNN's packed product.
"""

from __future__ import annotations

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.panel_kernels import PANEL_ROWS, PanelKernel

LEVELS = ("portable", "avx2", "avx512_bf16")  # bf16_matmul.c's BLEVEL_*
ENV = "PAGEDKV_BF16_KERNELS"

FAMILY = levels.register(levels.Family(
    name="bf16 linears", env=ENV, levels=LEVELS, best="bf16_cpu_level",
    requires={"avx2": "AVX2 and FMA", "avx512_bf16": "AVX-512 BF16, BW and VL"},
    others=("onednn",), auto=lambda best: best if best != "portable" else "onednn"))
CHOICES = FAMILY.choices


def cpu_level() -> int:
    """The index in LEVELS of the highest level this CPU runs (asked of the library once)."""
    return levels.best(FAMILY.name)


def chosen_level() -> int | None:
    """The C kernel's level for a bfloat16 model's linears, or None where oneDNN's packed
    product serves them (PAGEDKV_BF16_KERNELS, the CPU, a library that did not build)."""
    return levels.chosen_index(FAMILY.name)


KERNEL = PanelKernel("bf16", torch.bfloat16, LEVELS, "the bfloat16 kernels")
pack_panels = KERNEL.pack
unpack_panels = KERNEL.unpack
linear = KERNEL.linear


__all__ = ["CHOICES", "ENV", "FAMILY", "LEVELS", "PANEL_ROWS", "chosen_level", "cpu_level", "linear", "pack_panels", "unpack_panels"]
