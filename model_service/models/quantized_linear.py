"""Linears and an embedding whose weights stay in a GGUF file's quantized blocks on CPU.

A QuantizedLinear holds the raw blocks (uint8, [rows, bytes a row], no float copy) of one
or more row segments, each of its own type (a fused QKV of Q4_K and Q6_K rows), and
multiplies by them with the integer kernels of cpu_kernels/quant_matmul.py: decode reads
the file's bytes a step instead of float32's 4 (for Q4_1, about 7x fewer), which is what
bounds a CPU decode. A QuantizedEmbedding dequantizes only the rows looked up; a tied
lm_head shares its blocks.

The blocks are plain attributes, not parameters or buffers: `.to(dtype)` and `to_empty`
must not touch them (the kernel holds their pointers); weights_held.py counts them. They
are handed over: Q4_0, Q4_1 and Q8_0 rows are rearranged in place, eight rows interleaved
(quant_matmul.repack), which their kernels read fastest; the bytes stay the file's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model_service.cpu_kernels import quant_matmul
from model_service.cpu_kernels.quant_matmul import Segments


def _library():
    library = quant_matmul.load()
    if library is None:
        raise RuntimeError("the quantized-weight kernels need the CPU kernel library, which did not build")
    return library


class QuantizedLinear(nn.Module):
    """y = x W^T (+ bias) with W as (ggml type code, blocks [rows, row bytes]) segments."""

    def __init__(self, in_features: int, parts: Sequence[tuple[int, torch.Tensor]],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self._library = _library()
        parts = [(quant_matmul.repack(self._library, type_code, blocks), blocks) for type_code, blocks in parts]
        self.segments = Segments(parts, in_features)
        self.in_features, self.out_features = in_features, self.segments.rows
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._level = quant_matmul.chosen_level(self._library)
        # From this many tokens on, the product of rows not interleaved is in bfloat16 on
        # dequantized tiles (quant_matmul.linear); None keeps the integer kernel for every batch.
        self.float_from: int | None = quant_matmul.FLOAT_PRODUCT_TOKENS

    @property
    def types(self) -> list[str]:
        return [quant_matmul.type_name(type_code) for type_code, _ in self.segments.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = quant_matmul.linear(self._library, x.reshape(-1, self.in_features), self.segments, self._level,
                                  self.float_from)
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, types={self.types}"


class QuantizedEmbedding(nn.Module):
    """nn.Embedding's lookup over a quantized table: rows dequantized as they are looked up,
    to `dtype` (the model's)."""

    def __init__(self, type_code: int, blocks: torch.Tensor, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self._library = _library()
        # Rearranged as a tied lm_head's linear holds them: the two share the blocks.
        blocks = blocks.contiguous()
        type_code = quant_matmul.repack(self._library, type_code, blocks)
        self.type_code, self.embedding_dim, self.dtype = type_code, embedding_dim, dtype
        self.segments = Segments([(type_code, blocks)], embedding_dim)  # checks the shape
        self.blocks = self.segments.parts[0][1]
        self.num_embeddings = self.blocks.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = quant_matmul.dequantize_rows(self._library, self.blocks, self.type_code, self.embedding_dim,
                                            ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def tied_linear(self) -> QuantizedLinear:
        """An lm_head over the same blocks (no copy)."""
        return QuantizedLinear(self.embedding_dim, [(self.type_code, self.blocks)])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={quant_matmul.type_name(self.type_code)}"

