"""Causal attention of prompt chunks by csrc/prefill_attention.c, for bfloat16 and float32
pools: a query head's queries a vector, a lane each (eight at the portable and AVX2
levels, sixteen at AVX-512F, and at AVX-512 BF16, whose dpbf16ps tile takes bfloat16 pools;
a float32 pool takes the AVX-512F tile there, and a bfloat16 pool at the AVX-512F level
takes that tile too, widened to float32). Other pools attend each prompt token as a decode
query (paged_decode.py).

PAGEDKV_PREFILL_KERNELS picks the level: unset or "auto", the highest this CPU runs;
"portable", "avx2", "avx512" or "avx512_bf16", that level (one above the CPU's is refused
with a ValueError). At one level a query's result is the same bits whatever chunk computes it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import DTYPE_CODES, load

LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")  # prefill_attention.c's PREFILL_*
ENV = "PAGEDKV_PREFILL_KERNELS"
CHOICES = ("auto", *LEVELS)
MAX_HEAD_DIM = 256  # prefill_attention.c's PREFILL_MAX_HEAD_DIM
DTYPES = (torch.float32, torch.bfloat16)


FAMILY = levels.register(levels.Family(
    name="prefill attention", env=ENV, levels=LEVELS, best="prefill_best_level",
    requires={"avx2": "AVX2, FMA and F16C", "avx512": "AVX-512F (with AVX2, FMA and F16C)",
              "avx512_bf16": "AVX-512 BF16, BW and VL"}))


def best_level(library: ctypes.CDLL | None = None) -> int:
    """The highest level this CPU runs (asked of the library once)."""
    return levels.best(FAMILY.name)


def chosen_level() -> int | None:
    """The level this kernel runs at, or None where the library did not build."""
    return None if load() is None else LEVELS.index(levels.choose(FAMILY.name))


def supports(library: ctypes.CDLL, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether prefill_attention takes this layer's call."""
    _, _, _, kv_heads, head_dim = kv_layer.shape
    return (kv_layer.device.type == "cpu" and kv_layer.dtype in DTYPES and q.dtype == kv_layer.dtype
            and kv_layer.is_contiguous() and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and q.shape[1] % kv_heads == 0)


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
                      scale: float, sliding_window: int | None, out: torch.Tensor, level: int | None = None) -> None:
    """q [tokens, q_heads, head_dim]: the prefill sequences' queries one after another, in
    the order of `sequences`. Writes out (like q) in place. level None: chosen_level()."""
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    q_heads = q.shape[1]
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError("out must hold each token's heads contiguously")
    if level is None:
        level = LEVELS.index(levels.choose(FAMILY.name))
    tables, lens, contexts = sequences
    status = library.prefill_attention(
        q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), contexts.data_ptr(), lens.numel(), q_heads, kv_heads, head_dim, block_size, scale,
        sliding_window or 0, out.data_ptr(), out.stride(0), DTYPE_CODES.get(kv_layer.dtype, -1), level,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"prefill_attention refused queries {lens.tolist()} over contexts {contexts.tolist()}, "
                         f"q={tuple(q.shape)} kv={tuple(kv_layer.shape)} {kv_layer.dtype} at level {LEVELS[level]}")
