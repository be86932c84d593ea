"""LoRA's segmented product on CPU by csrc/lora_sgmv.c: a run of rows' shrink and expand
in one call (models/lora_delta.py calls it, and keeps torch's matmuls as the reference and
the fallback).

bfloat16 rows (a bfloat16 model's, its adapters' factors in bfloat16 too) go to
csrc/lora_sgmv_bf16.c, the same three paths and levels, products in float32 and the delta
rounded once where it is added.

PAGEDKV_LORA_KERNELS picks who computes float32 and bfloat16 adapters' deltas on CPU (levels.py chooses
once per process and logs why): unset or "auto", the C kernel at the CPU's best level,
AVX-512F or AVX2, and torch's matmuls where the CPU has neither; "portable", "avx2" or
"avx512", that level (one above the CPU's is refused); "torch", torch's matmuls. Other
dtypes (float16) and devices always run torch's."""

from __future__ import annotations

import torch

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import load

LEVELS = ("portable", "avx2", "avx512")  # lora_sgmv.c's LORA_*
ENV = "PAGEDKV_LORA_KERNELS"

FAMILY = levels.register(levels.Family(
    name="LoRA products", env=ENV, levels=LEVELS, best="lora_best_level",
    requires={"avx2": "AVX2 and FMA", "avx512": "AVX-512F"},
    others=("torch",), auto=lambda best: best if best != "portable" else "torch"))
CHOICES = FAMILY.choices


def chosen_level() -> int | None:
    """The C kernel's level, or None where torch's matmuls serve (the switch, the CPU, a
    library that did not build)."""
    return levels.chosen_index(FAMILY.name)


DTYPES = (torch.float32, torch.bfloat16)


def supports(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """CPU tensors all float32 or all bfloat16, rows of x and out contiguous, factors contiguous."""
    return (out.device.type == "cpu" and out.dtype in DTYPES and out.dtype == x.dtype == a.dtype == b.dtype
            and x.stride(-1) == 1 and out.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous())


def shrink_expand(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float,
                  level: int) -> None:
    """out[r, :b.shape[0]] += scaling · (x[r] · aᵀ) · bᵀ for every row r; out and x are the
    run's rows (out a column slice of the projection's output). Checked by `supports` first."""
    library = load()
    rows, in_features = x.shape
    rank = a.shape[0]
    kernel = library.lora_shrink_expand if x.dtype == torch.float32 else library.lora_shrink_expand_bf16
    status = kernel(x.data_ptr(), x.stride(0), rows, in_features, a.data_ptr(), rank, b.data_ptr(), b.shape[0],
                    scaling, out.data_ptr(), out.stride(0), level, torch.get_num_threads())
    if status == 3:
        raise MemoryError(f"lora_shrink_expand could not allocate its scratch ({rows} rows, rank {rank}, "
                          f"{b.shape[0]} outputs)")
    if status != 0:
        raise ValueError(f"lora_shrink_expand refused rank {rank} at level {LEVELS[level]}")
