"""Linears on CPU multiplied by a C panel kernel, their weights held in its panels of 16
rows: bfloat16 ones by cpu_kernels/bf16_matmul.py, float32 ones by cpu_kernels/f32_matmul.py.

At a decode step's few tokens a linear's time is its weights' bytes over the memory's
bandwidth, and the bfloat16 kernel reads its panels, laid out in the order it multiplies,
closer to that bound than oneDNN's packed product at 1-32 tokens on SmolLM2-135M's layer
linears (docs/benchmark-log.md, "A bfloat16 decode stack"). Being C, the kernels also run inside
the decode stack's one call a step (cpu_decode_stack.py), which oneDNN's product cannot. A
token's result does not depend on the batch it is in.

As with a PackedLinear, the panels are the only copy held, but for a weight another module
shares (a tied lm_head's: the embedding looks rows up in it). The panels are a plain
attribute, not a parameter: `.to(dtype)` must not convert them (weights_held.py counts them).
"""

from __future__ import annotations

import torch
from torch import nn

from model_service.cpu_kernels import bf16_matmul, f32_matmul

# the kernel module of each weight dtype that panels hold
KERNELS = {torch.bfloat16: bf16_matmul, torch.float32: f32_matmul}


class PanelLinear(nn.Linear):
    """An nn.Linear whose weight is held as a panel kernel's panels: `weight` is None, or the
    plain weight when another module shares it (keep_weight), which must not change
    afterwards. The bias stays a plain parameter. dense_weight() gives the plain weight back."""

    panels: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear, level: int, keep_weight: bool = False) -> PanelLinear:
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        kernel = KERNELS[linear.weight.dtype]
        with torch.no_grad():
            module.panels = kernel.pack_panels(linear.weight.detach())
        module.level = level
        module.register_parameter("weight", linear.weight if keep_weight else None)
        module.bias = linear.bias
        return module

    @property
    def kernel(self):
        return KERNELS[self.panels.dtype]

    def dense_weight(self) -> torch.Tensor:
        """The plain [out, in] weight: the shared one, or a new copy from the panels."""
        return self.weight if self.weight is not None else self.kernel.unpack_panels(self.panels, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.panels.dtype:
            raise TypeError(f"PanelLinear holds {self.panels.dtype} weights; got {x.dtype} input")
        out = self.kernel.linear(x.reshape(-1, self.in_features), self.panels, self.out_features, self.level)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.panels.dtype}, level={self.kernel.LEVELS[self.level]}")
