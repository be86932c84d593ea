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

import ctypes

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import load

LEVELS = ("portable", "avx2", "avx512_bf16")  # bf16_matmul.c's BLEVEL_*
ENV = "PAGEDKV_BF16_KERNELS"
PANEL_ROWS = 16  # bf16_matmul.c's BF16_PANEL_ROWS

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


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [rows, cols] (bfloat16, cols even) as the kernel reads it: panels of 16 rows,
    [ceil(rows / 16), cols / 2, 16, 2], the last panel's missing rows zeros."""
    rows, cols = weight.shape
    if weight.dtype != torch.bfloat16 or cols % 2 or weight.stride(1) != 1:
        raise ValueError(f"panels take bfloat16 [rows, even cols] with unit column stride, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    panels = torch.empty(((rows + PANEL_ROWS - 1) // PANEL_ROWS, cols // 2, PANEL_ROWS, 2), dtype=torch.bfloat16)
    status = _library().bf16_pack_panels(weight.data_ptr(), weight.stride(0), rows, cols, panels.data_ptr())
    if status != 0:
        raise RuntimeError(f"bf16_pack_panels failed ({status}) for {tuple(weight.shape)}")
    return panels


def unpack_panels(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """The plain [rows, cols] weight that pack_panels rearranged (a new tensor)."""
    count, pairs = panels.shape[:2]
    return panels.permute(0, 2, 1, 3).reshape(count * PANEL_ROWS, 2 * pairs)[:rows].clone()


def linear(x: torch.Tensor, panels: torch.Tensor, rows: int, level: int) -> torch.Tensor:
    """x [T, cols] bfloat16 (rows any distance apart) times the panels' weight -> [T, rows]."""
    tokens, cols = x.shape
    if x.dtype != torch.bfloat16 or cols != 2 * panels.shape[1]:
        raise ValueError(f"panels of {2 * panels.shape[1]} bfloat16 columns take x of that width in bfloat16, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, rows), dtype=torch.bfloat16)
    status = _library().bf16_linear(x.data_ptr(), x.stride(0), tokens, cols, rows, panels.data_ptr(),
                                    out.data_ptr(), out.stride(0), level, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"bf16_linear failed ({status}) for {cols} columns at level {LEVELS[level]}")
    return out


def _library() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise RuntimeError("the bfloat16 kernels need the CPU kernel library, which did not build")
    return library


__all__ = ["CHOICES", "ENV", "FAMILY", "LEVELS", "PANEL_ROWS", "chosen_level", "cpu_level", "linear", "pack_panels", "unpack_panels"]
