"""Paged decode attention by the C kernel (csrc/paged_decode.c): the torch path's contract
(attention/torch_paged.py decode_attention_torch), reading K/V in place from the pool.

PAGEDKV_ATTENTION_KERNELS picks its level (prefill_attention.py and kv_write.py have
switches of their own):
- unset or "auto": the highest this CPU runs;
- "portable", "avx2" or "avx512": that level (one above the CPU's is refused with a
  ValueError rather than crashing on an illegal instruction): what a test, or a person
  comparing, runs. A shape a level's case does not take falls to the level below it.
"""

from __future__ import annotations

import ctypes

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import DTYPE_CODES, KV_DTYPE_CODES, load

LEVELS = ("portable", "avx2", "avx512")
ENV = "PAGEDKV_ATTENTION_KERNELS"
CHOICES = ("auto", *LEVELS)

# The C side's fixed buffer limits (paged_decode.c); wider shapes take the torch path.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE = 256, 64, 256
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


FAMILY = levels.register(levels.Family(
    name="decode attention", env=ENV, levels=LEVELS, best="paged_decode_best_level",
    requires={"avx2": "AVX2, FMA and F16C", "avx512": "AVX-512F"}))


def best_level(library: ctypes.CDLL | None = None) -> int:
    """The highest level this CPU runs (asked of the library once)."""
    return levels.best(FAMILY.name)


def chosen_level() -> int | None:
    """The level decode attention runs at, or None where the library did not build (the
    torch path serves)."""
    return None if load() is None else LEVELS.index(levels.choose(FAMILY.name))


def supports(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes this call (else the caller uses the torch path)."""
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    return (kv_layer.device.type == "cpu" and kv_layer.dtype in KV_DTYPE_CODES and kv_layer.is_contiguous()
            and (kv_layer.dtype in _FP8 or q.dtype in DTYPE_CODES)
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE
            and q.shape[1] % kv_heads == 0 and q.shape[1] // kv_heads <= MAX_GROUP)


def paged_decode_attention(
    library: ctypes.CDLL,
    q: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim], contiguous, CPU
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an 8-bit pool holds K / k_scale, V / v_scale
    level: int | None = None,  # None: chosen_level()
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim]: kv_layer's dtype, q's for an 8-bit pool
    num_seqs, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    fp8 = kv_layer.dtype in _FP8
    # An 8-bit pool is read with float32 q and out: one compiled case per K/V type instead
    # of one per (q, K/V) pair; converting q and out costs a row a head, K/V a row a key.
    compute_dtype = torch.float32 if fp8 else kv_layer.dtype
    result_dtype = q.dtype if fp8 else kv_layer.dtype
    q = q.to(compute_dtype)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()  # rows may stay apart (q is a view of the fused q/k/v output)
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, q_heads, head_dim), dtype=compute_dtype)
    k_scale, v_scale = kv_scales
    if level is None:
        level = LEVELS.index(levels.choose(FAMILY.name))
    status = library.paged_decode_attention_at(
        q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        num_seqs, q_heads, kv_heads, head_dim, block_size,
        scale, sliding_window or 0, DTYPE_CODES[compute_dtype], out.data_ptr(), torch.get_num_threads(),
        KV_DTYPE_CODES[kv_layer.dtype], k_scale, v_scale, level,
    )
    if status != 0:
        raise ValueError(f"paged_decode_attention refused shape q={tuple(q.shape)} kv={tuple(kv_layer.shape)} "
                         f"at level {level}")
    return out.to(result_dtype)
