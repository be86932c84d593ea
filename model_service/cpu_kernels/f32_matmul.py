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

import ctypes

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import load

LEVELS = ("portable", "avx2", "avx512")  # f32_matmul.c's FLEVEL_*
ENV = "PAGEDKV_F32_KERNELS"
PANEL_ROWS = 16  # panel_driver.h's PANEL_ROWS

FAMILY = levels.register(levels.Family(
    name="f32 linears", env=ENV, levels=LEVELS, best="f32_cpu_level",
    requires={"avx2": "AVX2 and FMA", "avx512": "AVX-512F"},
    others=("torch",), auto=lambda best: best if best != "portable" else "torch"))
CHOICES = FAMILY.choices


def chosen_level() -> int | None:
    """The C kernel's level for a float32 model's linears, or None where torch's product
    serves them (PAGEDKV_F32_KERNELS, the CPU, a library that did not build)."""
    return levels.chosen_index(FAMILY.name)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [rows, cols] (float32) as the kernel reads it: panels of 16 rows,
    [ceil(rows / 16), cols, 16], the last panel's missing rows zeros."""
    rows, cols = weight.shape
    if weight.dtype != torch.float32 or weight.stride(1) != 1 or not rows or not cols:
        raise ValueError(f"float32 panels take float32 [rows, cols] with unit column stride, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    panels = torch.empty(((rows + PANEL_ROWS - 1) // PANEL_ROWS, cols, PANEL_ROWS), dtype=torch.float32)
    status = _library().f32_pack_panels(weight.data_ptr(), weight.stride(0), rows, cols, panels.data_ptr())
    if status != 0:
        raise RuntimeError(f"f32_pack_panels failed ({status}) for {tuple(weight.shape)}")
    return panels


def unpack_panels(panels: torch.Tensor, rows: int) -> torch.Tensor:
    """The plain [rows, cols] weight that pack_panels rearranged (a new tensor)."""
    count, cols = panels.shape[:2]
    return panels.permute(0, 2, 1).reshape(count * PANEL_ROWS, cols)[:rows].clone()


def linear(x: torch.Tensor, panels: torch.Tensor, rows: int, level: int) -> torch.Tensor:
    """x [T, cols] float32 (rows any distance apart) times the panels' weight -> [T, rows]."""
    tokens, cols = x.shape
    if x.dtype != torch.float32 or cols != panels.shape[1]:
        raise ValueError(f"panels of {panels.shape[1]} float32 columns take x of that width in float32, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, rows), dtype=torch.float32)
    status = _library().f32_linear(x.data_ptr(), x.stride(0), tokens, cols, rows, panels.data_ptr(),
                                   out.data_ptr(), out.stride(0), level, torch.get_num_threads())
    if status != 0:
        name = LEVELS[level] if 0 <= level < len(LEVELS) else level
        raise RuntimeError(f"f32_linear failed ({status}) for {cols} columns at level {name}")
    return out


def _library() -> ctypes.CDLL:
    library = load()
    if library is None:
        raise RuntimeError("the float32 panel kernels need the CPU kernel library, which did not build")
    return library


__all__ = ["CHOICES", "ENV", "FAMILY", "LEVELS", "PANEL_ROWS", "chosen_level", "linear", "pack_panels", "unpack_panels"]
