"""Building a model on the meta device, and giving it memory, without torch's Python meta
kernels.

A loader builds LlamaForCausalLM on the meta device, then gives it uninitialized memory and
overwrites every weight. Two of the calls that takes by default have no C++ meta kernel:
nn.Embedding's init (normal_) and Module.to_empty (empty_like of a meta tensor); the first
of them imports torch's Python ones (torch._refs, and through them sympy, torch._dynamo,
torch._inductor and triton: hundreds of modules), which stay resident for the process's life:
more of SmolLM2's load than its tokenizer (tests/test_quantized_model.py bounds the growth). Neither is needed: the random init is overwritten, and a plain torch.empty
of each tensor's shape is what to_empty makes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class SkipMetaInit(TorchFunctionMode):
    """torch.nn.init's functions, and a tensor's own normal_/uniform_, leave a meta tensor
    as it is (it holds no values to draw); everything else runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
        if (isinstance(tensor, torch.Tensor) and tensor.is_meta
                and (getattr(func, "__module__", None) == "torch.nn.init" or func in _TENSOR_INITS)):
            return tensor
        return func(*args, **kwargs)


_TENSOR_INITS = (torch.Tensor.normal_, torch.Tensor.uniform_)


def to_empty(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Module.to_empty: every parameter and buffer as uninitialized memory on `device`, of
    its shape and dtype (contiguous, as a meta-built module's are), shared ones untied."""
    return model._apply(lambda tensor: torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
