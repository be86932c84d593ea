"""bfloat16 linears on CPU with their weights pre-packed for oneDNN (AMX / AVX512-BF16),
where the C kernel of panel_linear.py does not serve them, and float32 ones in that
kernel's panels (pack_linears chooses).

An eager `F.linear` in bfloat16 on CPU hands oneDNN a plain row-major weight, which it
reorders into its blocked layout on every call, a cost paid again each step that packing
the weights once at load removes (measured over SmolLM2-135M's 121 linears, at batch 1 and
at batch 48, in turns). The packed call gives bit-identical results:
the same oneDNN kernel, minus the reorder. This is what inductor's freezing pass does to
bfloat16 linears; doing it at load time gets it without compiling.

The packed copy is the only one held: keeping the plain weight beside it held a bfloat16
model's linears twice (SmolLM2: 538 MB, float32's size, instead of 326 MB). The exception
is a weight that another module shares, a tied lm_head's: the embedding looks rows up in
it, so it stays at no cost, and the lm_head's packed copy is the one weight held twice
(SmolLM2: 57 MB). Unpacked, that lm_head would save it but reorder its 28 M weights every
step, which measured slower than the packed copy at batch 1 and at batch 48 alike.

float32 linears go to the float32 panel kernel (panel_linear.py) where
f32_matmul.chosen_level says so, which lets a decode step's layers run in one C call
(cpu_decode_stack.py), and stay plain torch linears otherwise. The lm_head too: torch's
plain product goes to the BLAS that torch was built with (MKL), which on CPUs it does not
tune for (AMD's) multiplies a step's rows at a fraction of the panels' rate
(bench/kernels/f32_panel_product.py compares torch, oneDNN's packed weight and the panels), and
in panels a token's logits are the same bits at any batch. As in bfloat16, a tied
lm_head's panels are the one weight held twice.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from model_service.cpu_kernels import bf16_matmul, f32_matmul
from model_service.models.panel_linear import PanelLinear

# oneDNN picks a blocked layout for a typical batch; any batch size runs on it.
PACKING_BATCH_HINT = 64


def packing_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_nbytes(packed_weight: torch.Tensor) -> int:
    """The bytes oneDNN holds for a packed weight, its blocked layout's padding included."""
    return torch.ops.mkldnn._nbytes(packed_weight)


class PackedLinear(nn.Linear):
    """An nn.Linear that multiplies by a packed copy of its weight and holds no other:
    `weight` is None, or the plain weight when another module shares it (keep_weight),
    which must not change afterwards: the packed copy would not follow. The bias stays a
    plain parameter. dense_weight() gives the plain weight back."""

    packed_weight: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_weight: bool = False) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)
        packed.register_parameter("weight", linear.weight if keep_weight else None)
        packed.bias = linear.bias
        return packed

    def dense_weight(self) -> torch.Tensor:
        """The plain [out, in] weight: the shared one, or a new copy unpacked from oneDNN's."""
        return self.weight if self.weight is not None else self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.packed_weight.dtype:
            # F.linear refuses mixed dtypes as well; say which ones.
            raise TypeError(f"PackedLinear holds {self.packed_weight.dtype} weights; got {x.dtype} input")
        if x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        rows = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed_weight, self.bias,
                                                  "none", [], "")
        return rows.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Swaps every nn.Linear of a CPU bfloat16 or float32 model for one that multiplies by a
    packed copy of its weight; returns how many. bfloat16: the C kernel's panels
    (panel_linear.py) where bf16_matmul.chosen_level says so, oneDNN's PackedLinear
    otherwise; float32: the C kernel's panels where f32_matmul.chosen_level says so, else none. A no-op (0) on other devices and dtypes. Each plain weight is freed as its
    linear is swapped (unless shared): packing needs one linear's copy more than the model,
    not two models' worth."""
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    if not names:
        return 0
    weight = model.get_submodule(names[0]).weight
    dtype = weight.dtype
    if weight.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return 0
    del weight
    if dtype == torch.float32:
        level, onednn = f32_matmul.chosen_level(), False
    else:
        level, onednn = bf16_matmul.chosen_level(), packing_supported("cpu", torch.bfloat16)
    holders = Counter(parameter.data_ptr() for module in model.modules()
                      for parameter in module._parameters.values() if parameter is not None)
    swapped = 0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if linear.weight.dtype != dtype:
            continue
        shared = holders[linear.weight.data_ptr()] > 1
        # bfloat16 panels hold pairs of columns
        if level is not None and (dtype == torch.float32 or linear.in_features % 2 == 0):
            setattr(parent, child, PanelLinear.from_linear(linear, level, keep_weight=shared))
        elif onednn:
            setattr(parent, child, PackedLinear.from_linear(linear, keep_weight=shared))
        else:
            continue
        swapped += 1
    return swapped
