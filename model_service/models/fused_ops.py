"""A decoder layer's elementwise steps, one call each: the C kernels on CPU where they
load (cpu_kernels/layer_ops.py), else the torch code here, which is also their reference
(tests/test_layer_ops.py holds one to the other). CUDA always takes the torch code.

Measured on SmolLM2-135M, bfloat16, 2 threads: docs/benchmark-log.md, "C kernels on CPU".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_service.cpu_kernels import layer_ops
from model_service.models.rope import apply_rotary


# The C library for these tensors, or None: the torch code then serves (a name of its own
# here, so that tests and bench/kernels/bench_cpu_kernels.py can turn the C path off).
_library = layer_ops.library_for


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused kernel; same arithmetic as below
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalized in float32 whatever the dtype, then rounded and scaled in the input dtype,
    # as transformers' LlamaRMSNorm does (x * rsqrt(mean(x^2) + eps), then weight * x).
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    library = _library(x, weight) if x.dim() == 2 else None
    if library is not None:
        return layer_ops.rms_norm(library, x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden + delta, rms_norm of that). The C path adds into `hidden` in place, so pass
    a residual stream nothing else holds."""
    library = _library(hidden, delta, weight) if hidden.dim() == 2 and hidden.is_contiguous() else None
    if library is not None:
        return hidden, layer_ops.add_rms_norm(library, hidden, delta, weight, eps)
    hidden = hidden + delta
    return hidden, rms_norm_torch(hidden, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the fused gate/up projection's output [T, 2 I] -> [T, I]."""
    library = _library(gate_up) if gate_up.dim() == 2 and gate_up.is_contiguous() else None
    if library is not None:
        return layer_ops.silu_mul(library, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryStep:
    """One step's rotary embedding for every layer: rotate(qk) returns qk's heads rotated at
    the step's positions, in place by the C kernel, or by apply_rotary on cos/sin rows
    gathered once for the step (on first use)."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor) -> None:
        self.cos_table, self.sin_table, self.positions = cos_table, sin_table, positions  # tables [P, D/2]
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        # qk: [T, heads, D], each row's heads contiguous -> [T, heads, D]
        library = _library(qk, self.cos_table) if qk.stride(1) == qk.shape[2] else None
        if library is not None and self.positions.dtype == torch.int64 and self.positions.is_contiguous():
            layer_ops.rotary_in_place(library, qk, self.cos_table, self.sin_table, self.positions)
            return qk
        if self._gathered is None:  # [T, 1, D/2] each, broadcast over heads
            self._gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        return apply_rotary(qk, *self._gathered)
