"""Causal attention of prompt chunks by csrc/prefill_attention.c: sixteen queries of one
head a vector, for bfloat16 pools on CPUs with AVX-512 BF16. Other pools and CPUs attend
each prompt token as a decode query (paged_decode.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from model_service.cpu_kernels import bf16_matmul

MAX_HEAD_DIM = 256  # prefill_attention.c's PREFILL_MAX_HEAD_DIM


def supports(library: ctypes.CDLL, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether prefill_attention_bf16 takes this layer's call."""
    _, _, _, kv_heads, head_dim = kv_layer.shape
    return (kv_layer.device.type == "cpu" and kv_layer.dtype == torch.bfloat16 and q.dtype == torch.bfloat16
            and kv_layer.is_contiguous() and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and q.shape[1] % kv_heads == 0 and bf16_matmul.best_level(library) >= 1)


class PrefillSequences(NamedTuple):
    """A step's prefill sequences as the kernel takes them: the same for every layer, so
    built once a step (attention/backend.py keeps them in the step's memo)."""
    tables: torch.Tensor  # int32 [sequences, blocks], unit column stride
    query_lens: torch.Tensor  # int32 [sequences]
    context_lens: torch.Tensor  # int32 [sequences], after this step


def prefill_sequences(block_tables: torch.Tensor, query_lens: Sequence[int],
                      context_lens: Sequence[int]) -> PrefillSequences:
    """Sequence i: query_lens[i] queries, block table block_tables[i], context_lens[i] keys
    after this step (its K/V already in the pool)."""
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    return PrefillSequences(tables, torch.tensor(query_lens, dtype=torch.int32),
                            torch.tensor(context_lens, dtype=torch.int32))


def prefill_attention(library: ctypes.CDLL, q: torch.Tensor, kv_layer: torch.Tensor, sequences: PrefillSequences,
                      scale: float, sliding_window: int | None, out: torch.Tensor) -> None:
    """q [tokens, q_heads, head_dim]: the prefill sequences' queries one after another, in
    the order of `sequences`. Writes out (like q) in place."""
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    q_heads = q.shape[1]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError("out must hold each token's heads contiguously")
    tables, lens, contexts = sequences
    status = library.prefill_attention_bf16(
        q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), contexts.data_ptr(), lens.numel(), q_heads, kv_heads, head_dim, block_size, scale,
        sliding_window or 0, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"prefill_attention_bf16 refused queries {lens.tolist()} over contexts "
                         f"{contexts.tolist()}, q={tuple(q.shape)} kv={tuple(kv_layer.shape)}")
