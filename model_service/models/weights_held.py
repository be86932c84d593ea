"""The bytes a model's weights take as held in memory, by how each tensor is held.

What GetModelInfo and the Attach's sizing report (weights_bytes, weights_bytes_by_type):
- parameters at their dtype ("float32", "bfloat16", ...);
- quantized blocks (QuantizedLinear, QuantizedEmbedding: --weights native, --quantization
  int8) at their size, under their GGUF type ("Q4_1", "Q8_0", ...): they are plain
  attributes, not parameters, so model.parameters() alone would miss them;
- a PanelLinear's panels (bf16_matmul.c's or f32_matmul.c's layout, the last panel's rows padded to 16) at
  their size;
- a PackedLinear's oneDNN copy of its weight at the bytes oneDNN allocated for it (its
  blocked layout may pad); its plain weight is gone, except a tied lm_head's, which is
  the embedding's parameter (counted once, with the parameters).
Each tensor once: a tied lm_head shares the embedding's parameter or blocks. Buffers
(RoPE tables, computed at load) are not weights.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from model_service.cpu_kernels.quant_matmul import type_name
from model_service.models.packed_linear import PackedLinear, packed_nbytes
from model_service.models.panel_linear import PanelLinear
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_bytes_by_type(model: nn.Module) -> dict[str, int]:
    """{dtype or GGUF block type: bytes}, largest first; the values add up to weights_bytes."""
    held: dict[int, tuple[str, int]] = {}  # tensor identity -> (type, bytes)

    def hold(key: int, kind: str, tensor: torch.Tensor) -> None:
        held.setdefault(key, (kind, tensor.numel() * tensor.element_size()))

    for parameter in model.parameters():  # named_parameters dedups tied ones; data_ptr keys the rest
        hold(parameter.data_ptr(), _dtype_name(parameter.dtype), parameter)
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            for type_code, blocks in module.segments.parts:
                hold(blocks.data_ptr(), type_name(type_code), blocks)
        elif isinstance(module, PanelLinear):
            hold(module.panels.data_ptr(), _dtype_name(module.panels.dtype), module.panels)
        elif isinstance(module, PackedLinear):
            # An opaque oneDNN tensor (no data pointer), keyed by identity.
            packed = module.packed_weight
            held.setdefault(id(packed), (_dtype_name(packed.dtype), packed_nbytes(packed)))
    totals = Counter()
    for kind, size in held.values():
        totals[kind] += size
    return dict(totals.most_common())


def weights_bytes(model: nn.Module) -> int:
    return sum(weights_bytes_by_type(model).values())
