"""The C attention backend (model_service/cpu_kernels): K/V writes, decode and prefill read
and write the pool's blocks in place, each at the level cpu_kernels/levels.py chose.

Prefill by pool: float32 and bfloat16 take the prefill kernel (a query head's queries a
vector, a lane each); float16, or a head_dim the prefill kernel does not take, attends each
prompt token as a decode query over its own context (the keys up to its position, this
step's already in the pool), faster than SDPA a sequence at a time (docs/benchmark-log.md, "Token
tiles"), a cached prefix and a window alike; an 8-bit pool takes torch's prefill, to attend
over this step's K/V unquantized.
"""

from __future__ import annotations

import ctypes

import torch

from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_backend import TorchBackend
from model_service.cpu_kernels import kv_write, paged_decode, prefill_attention
from pagedkv.kv_geometry import is_fp8


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, library: ctypes.CDLL, q: torch.Tensor, kv_layer: torch.Tensor) -> None:
        """q, kv_layer: a call's, for the shapes and dtypes that decide the prefill path."""
        self.library = library
        if prefill_attention.supports(library, q, kv_layer):
            self.prefill_path = "prefill kernel"
        elif not is_fp8(kv_layer.dtype):
            self.prefill_path = "decode kernel per token"
        else:
            self.prefill_path = "torch"

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
              kv_scales: tuple[float, float]) -> None:
        if kv_write.supports(k, v, kv_layer):  # heads contiguous within a row: the projections' layout
            kv_write.write_kv(self.library, k, v, kv_layer, meta.slot_mapping, kv_scales)
        else:
            super().write(k, v, kv_layer, meta, kv_scales)

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, kv_scales: tuple[float, float]) -> torch.Tensor:
        num_decode = meta.num_decode_seqs
        return paged_decode.paged_decode_attention(self.library, q, kv_layer, meta.block_tables[:num_decode],
                                                   meta.context_lens[:num_decode], scale, sliding_window, kv_scales)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float], out: torch.Tensor) -> None:
        num_decode = meta.num_decode_seqs
        if self.prefill_path == "prefill kernel":
            sequences = meta.shared("prefill_sequences", lambda: prefill_attention.prefill_sequences(
                meta.block_tables[num_decode:], meta.query_lens[num_decode:], meta.context_lens_host[num_decode:]))
            prefill_attention.prefill_attention(self.library, q, kv_layer, sequences, scale, sliding_window, out)
        elif self.prefill_path == "decode kernel per token":
            tables, lens = _prefill_queries(meta)
            out.copy_(paged_decode.paged_decode_attention(self.library, q, kv_layer, tables, lens, scale,
                                                          sliding_window, kv_scales))
        else:
            super().prefill(q, k, v, kv_layer, meta, scale, sliding_window, kv_scales, out)


def _prefill_queries(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prefill token as a decode query: its sequence's block table row and its
    context length (position + 1), int32 [prefill tokens, ...]; built by the first layer
    and shared by the rest (meta.shared)."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        num_decode = meta.num_decode_seqs
        query_lens = meta.query_lens[num_decode:]
        lens = torch.cat([torch.arange(context - length + 1, context + 1, dtype=torch.int32)
                          for length, context in zip(query_lens, meta.context_lens_host[num_decode:], strict=True)])
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        tables = meta.block_tables[num_decode:].index_select(0, rows.to(meta.block_tables.device))
        return tables.to(torch.int32), lens

    return meta.shared("prefill_queries", build)
