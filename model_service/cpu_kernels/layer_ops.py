"""A decoder layer's fused elementwise ops by the C kernels (csrc/layer_ops.c). Callers
(models/fused_ops.py) check `takes` first; the torch code there is the reference."""

from __future__ import annotations

import ctypes

import torch

from model_service.cpu_kernels.build import DTYPE_CODES, load


def takes(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one supported dtype, each row contiguous (the kernels' layouts)."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES:
        return False
    for tensor in tensors:  # a loop, not all(genexpr): this runs for every op of every layer
        if tensor.dtype != dtype or tensor.stride(-1) != 1 or tensor.device.type != "cpu":
            return False
    return True


def library_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel library when the kernels take these tensors (see takes), else None."""
    if tensors[0].device.type != "cpu" or not takes(*tensors):
        return None
    return load()


def rms_norm(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [rows, cols], rows any distance apart -> [rows, cols] contiguous
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype)
    library.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, cols, eps,
                     DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def add_rms_norm(library: ctypes.CDLL, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """hidden += delta, in place (hidden must be contiguous); returns rms_norm(hidden)."""
    rows, cols = hidden.shape
    out = torch.empty((rows, cols), dtype=hidden.dtype)
    library.add_rms_norm(hidden.data_ptr(), delta.data_ptr(), delta.stride(0), weight.data_ptr(), out.data_ptr(),
                         rows, cols, eps, DTYPE_CODES[hidden.dtype], torch.get_num_threads())
    return out


def silu_mul(library: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [rows, 2 * inter] contiguous -> [rows, inter]
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, DTYPE_CODES[gate_up.dtype],
                     torch.get_num_threads())
    return out


def rotary_in_place(library: ctypes.CDLL, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                    positions: torch.Tensor) -> None:
    # x: [rows, heads, head_dim], heads contiguous within a row; tables [P, head_dim / 2]
    rows, heads, head_dim = x.shape
    library.rotary_in_place(x.data_ptr(), x.stride(0), rows, heads, head_dim, cos_table.data_ptr(),
                            sin_table.data_ptr(), positions.data_ptr(), DTYPE_CODES[x.dtype],
                            torch.get_num_threads())
