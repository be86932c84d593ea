"""This step's K/V into the pool by the C kernel (csrc/kv_write.c): the contract of
attention/torch_paged.py's write_kv_torch, which stays the reference and the fallback.

An 8-bit pool's conversion has two levels, the same bytes at both: "portable" (a value at
a time) and "avx2" (eight at a time). PAGEDKV_KV_WRITE_KERNELS picks one: unset or "auto",
the highest this CPU runs; a level above it is refused with a ValueError."""

from __future__ import annotations

import ctypes

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import DTYPE_CODES, KV_DTYPE_CODES, load
from pagedkv.kv_geometry import is_fp8

LEVELS = ("portable", "avx2")
ENV = "PAGEDKV_KV_WRITE_KERNELS"
CHOICES = ("auto", *LEVELS)


FAMILY = levels.register(levels.Family(name="K/V writes", env=ENV, levels=LEVELS, best="kv_write_best_level", requires={"avx2": "AVX2, FMA and F16C"}))


def best_level(library: ctypes.CDLL | None = None) -> int:
    """The highest level this CPU runs (asked of the library once)."""
    return levels.best(FAMILY.name)


def chosen_level() -> int | None:
    """The level this kernel runs at, or None where the library did not build."""
    return None if load() is None else LEVELS.index(levels.choose(FAMILY.name))


def supports(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """CPU tensors whose heads are contiguous within a row, a contiguous pool of k's dtype
    or an 8-bit one."""
    _, _, _, kv_heads, head_dim = kv_layer.shape
    return (kv_layer.device.type == "cpu" and k.device.type == "cpu" and kv_layer.is_contiguous()
            and k.dtype in DTYPE_CODES and v.dtype == k.dtype and (kv_layer.dtype == k.dtype or is_fp8(kv_layer.dtype))
            and k.stride(2) == 1 and k.stride(1) == head_dim and v.stride(2) == 1 and v.stride(1) == head_dim
            and k.shape[1:] == (kv_heads, head_dim) and v.shape == k.shape)


def write_kv(library: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[float, float] = (1.0, 1.0), level: int | None = None) -> None:
    """k, v: [tokens, kv_heads, head_dim] (rows any distance apart); kv_layer: [2, blocks,
    block_size, kv_heads, head_dim]; slot_mapping: [tokens]. Checked by `supports` first.
    level None: chosen_level()."""
    tokens, kv_heads, head_dim = k.shape
    slots = slot_mapping.to(torch.int64)
    if not slots.is_contiguous():
        slots = slots.contiguous()
    if level is None:
        level = LEVELS.index(levels.choose(FAMILY.name))
    status = library.write_kv_at(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), tokens, kv_heads * head_dim,
                              DTYPE_CODES[k.dtype], slots.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
                              KV_DTYPE_CODES[kv_layer.dtype], kv_scales[0], kv_scales[1], torch.get_num_threads(),
                              level)
    if status != 0:
        raise ValueError(f"write_kv refused K/V of {k.dtype} into a pool of {kv_layer.dtype} at level {level}")
