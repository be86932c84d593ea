"""The Python side of a panel linear (csrc/bf16_matmul.c, csrc/f32_matmul.c): weights
rearranged into panels of 16 rows and back, and the product, for one element type.

A panel holds 16 rows' values column by column, `pair` adjacent columns of a row side by
side (2 for bfloat16, which the kernel reads as pairs; 1 for float32), so one SIMD line
carries every row of the panel: [ceil(rows / 16), cols / pair, 16, pair] (float32's
trailing 1 is dropped). The C functions are `<prefix>_pack_panels` and `<prefix>_linear`."""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from model_service.cpu_kernels.build import load

PANEL_ROWS = 16  # csrc/panel_driver.h's PANEL_ROWS


@dataclasses.dataclass(frozen=True)
class PanelKernel:
    prefix: str  # the C functions' prefix: "bf16" or "f32"
    dtype: torch.dtype
    levels: tuple[str, ...]
    what: str  # for messages: "the bfloat16 kernels"

    @property
    def pair(self) -> int:
        return 2 if self.dtype == torch.bfloat16 else 1

    @property
    def _name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _shape(self, panels: int, cols: int) -> tuple[int, ...]:
        return (panels, cols // self.pair, PANEL_ROWS, self.pair) if self.pair > 1 else (panels, cols, PANEL_ROWS)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [rows, cols] as the kernel reads it, the last panel's missing rows zeros."""
        rows, cols = weight.shape
        if weight.dtype != self.dtype or cols % self.pair or weight.stride(1) != 1 or not rows or not cols:
            width = "even cols" if self.pair > 1 else "cols"
            raise ValueError(f"{self._name} panels take {self._name} [rows, {width}] with unit column stride, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        panels = torch.empty(self._shape((rows + PANEL_ROWS - 1) // PANEL_ROWS, cols), dtype=self.dtype)
        status = getattr(self._library(), f"{self.prefix}_pack_panels")(
            weight.data_ptr(), weight.stride(0), rows, cols, panels.data_ptr())
        if status != 0:
            raise RuntimeError(f"{self.prefix}_pack_panels failed ({status}) for {tuple(weight.shape)}")
        return panels

    def cols(self, panels: torch.Tensor) -> int:
        return panels.shape[1] * self.pair

    def unpack(self, panels: torch.Tensor, rows: int) -> torch.Tensor:
        """The plain [rows, cols] weight that pack rearranged (a new tensor)."""
        count = panels.shape[0]
        by_row = panels.permute(0, 2, 1, 3) if self.pair > 1 else panels.permute(0, 2, 1)
        return by_row.reshape(count * PANEL_ROWS, self.cols(panels))[:rows].clone()

    def linear(self, x: torch.Tensor, panels: torch.Tensor, rows: int, level: int) -> torch.Tensor:
        """x [T, cols] (rows any distance apart) times the panels' weight -> [T, rows]."""
        tokens, cols = x.shape
        if x.dtype != self.dtype or cols != self.cols(panels):
            raise ValueError(f"panels of {self.cols(panels)} {self._name} columns take x of that width in "
                             f"{self._name}, got {x.dtype} {tuple(x.shape)}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty((tokens, rows), dtype=self.dtype)
        status = getattr(self._library(), f"{self.prefix}_linear")(
            x.data_ptr(), x.stride(0), tokens, cols, rows, panels.data_ptr(), out.data_ptr(), out.stride(0), level,
            torch.get_num_threads())
        if status != 0:
            name = self.levels[level] if 0 <= level < len(self.levels) else level
            raise RuntimeError(f"{self.prefix}_linear failed ({status}) for {cols} columns at level {name}")
        return out

    def _library(self) -> ctypes.CDLL:
        library = load()
        if library is None:
            raise RuntimeError(f"{self.what} need the CPU kernel library, which did not build")
        return library


__all__ = ["PANEL_ROWS", "PanelKernel"]
