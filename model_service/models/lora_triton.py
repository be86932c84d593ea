"""LoRA's segmented product on CUDA in Triton: the shrink (x · Aᵀ) and the expand (· Bᵀ,
scaled, added into the base projection's output) for every run of rows of one adapter in
one launch each (models/lora_delta.py calls it for CUDA tensors; the tests run it
interpreted on CPU; attention/aot.py compiles it ahead of time).

Imported only lazily (lora_delta.load_triton), for backend.py's reasons: a CPU server never
pays triton's import, and importing must not fix TRITON_INTERPRET for the process.

A segment is a run of consecutive rows of one adapter (rows of the base belong to none). As
in Punica's SGMV, the grid's first axis is the segment and the second the segment's blocks
of rows, sized for the longest segment: a program past its own segment's end returns at
once, so one launch serves segments of any lengths with no device-side sort. Adapters'
factors stay the separate tensors they were loaded as: each segment's A and B are read
through a table of their addresses (lora_tables.py), with each factor's rank beside them (a
rank of 0: that adapter leaves this projection out, and its programs return).

The shrink writes scaling-free float32 rows of the rank into a scratch buffer (atomically
added, so several programs may split a long in_features between them when there are too few
segments and rows to fill the GPU); the expand reads them back in blocks of the rank,
applies the segment's scaling and adds into the output in float32 before rounding once to
the output's dtype. Every tile is widened to float32 as it is loaded (the interpreter holds
bfloat16 as raw integers until converted). The shrink's products take float32 inputs as IEEE
float32 (never TF32) and 16-bit ones as TF32 on the tensor cores, which holds a 16-bit value
exactly, so nothing is lost against a 16-bit product; the expand's are IEEE float32. What
changes from step to step (rows, runs, ranks) is never a tl.constexpr: it only picks among a
few tile sizes (shrink_config, expand_config), each compiled once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_service.attention.triton_kernels import sm_count
from model_service.models.lora_tables import StepTables

# tl.dot takes tiles of at least 16 a side. The shrink's ranks over RANK_BLOCK_MAX take
# several programs (its third grid axis); the expand steps through the rank EXPAND_RANK_STEP
# at a time. Tiles and warps are sized to compile without spilled registers for sm_80 and
# sm_90 in every dtype (attention/aot.py; scripts/compile_kernels.py); larger ones spill.
MIN_TILE = 16
RANK_BLOCK_MAX = 64
EXPAND_RANK_STEP = 16
BLOCK_K = 32  # the shrink's step along in_features
BLOCK_N = 64  # the expand's output columns a program
# Runs of at most this many rows (decode) take 16-row blocks, longer ones (prefill) 64-row
# blocks on 8 warps.
SHORT_SEGMENT = 16
LONG_BLOCK_M = 64
# in_features a split of the shrink at least covers.
MIN_SPLIT_K = 512


@triton.jit
def _shrink_kernel(
    x_ptr, bounds_ptr, factors_ptr, shrunk_ptr,
    in_features, k_per_split, num_rank_blocks, stride_x, stride_shrunk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, RANK_BLOCK: tl.constexpr,
):
    # One program per (segment, block of its rows, block of the rank x split of in_features).
    segment = tl.program_id(0)
    rank_block = tl.program_id(2) % num_rank_blocks
    split = tl.program_id(2) // num_rank_blocks
    start = tl.load(bounds_ptr + 2 * segment)
    end = tl.load(bounds_ptr + 2 * segment + 1)
    rank = tl.load(factors_ptr + 3 * segment + 2).to(tl.int32)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end or rank_block * RANK_BLOCK >= rank:
        return  # past this segment's rows or rank, or an adapter without this projection
    a_ptr = tl.load(factors_ptr + 3 * segment).to(tl.pointer_type(x_ptr.dtype.element_ty))
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < end
    ranks = rank_block * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    rank_mask = ranks < rank
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    acc = tl.zeros([BLOCK_M, RANK_BLOCK], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_mask = cols < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        # [BLOCK_K, RANK_BLOCK] of Aᵀ
        a = tl.load(a_ptr + ranks[None, :].to(tl.int64) * in_features + cols[:, None],
                    mask=col_mask[:, None] & rank_mask[None, :], other=0.0).to(tl.float32)
        if x_ptr.dtype.element_ty == tl.float32:
            acc += tl.dot(x, a, input_precision="ieee")
        else:  # a 16-bit value is exact in TF32: the tensor cores' products lose nothing
            acc += tl.dot(x, a, input_precision="tf32")
    tl.atomic_add(shrunk_ptr + rows[:, None] * stride_shrunk + ranks[None, :], acc,
                  mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _expand_kernel(
    shrunk_ptr, bounds_ptr, factors_ptr, scaling_ptr, out_ptr,
    out_features, stride_shrunk, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr,
):
    # One program per (segment, block of its rows, block of the output's columns).
    segment = tl.program_id(0)
    start = tl.load(bounds_ptr + 2 * segment)
    end = tl.load(bounds_ptr + 2 * segment + 1)
    rank = tl.load(factors_ptr + 3 * segment + 2).to(tl.int32)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end or rank == 0:
        return
    b_ptr = tl.load(factors_ptr + 3 * segment + 1).to(tl.pointer_type(out_ptr.dtype.element_ty))
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, rank, RANK_BLOCK):
        ranks = r + tl.arange(0, RANK_BLOCK)
        rank_mask = ranks < rank
        shrunk = tl.load(shrunk_ptr + rows[:, None] * stride_shrunk + ranks[None, :],
                         mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
        # [RANK_BLOCK, BLOCK_N] of Bᵀ
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * rank + ranks[:, None],
                    mask=rank_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(shrunk, b, input_precision="ieee")
    scaling = tl.load(scaling_ptr + segment)
    mask = row_mask[:, None] & col_mask[None, :]
    targets = out_ptr + rows[:, None] * stride_out + cols[None, :]
    total = tl.load(targets, mask=mask, other=0.0).to(tl.float32) + acc * scaling
    tl.store(targets, total.to(out_ptr.dtype.element_ty), mask=mask)


def rank_block(max_rank: int) -> int:
    return min(RANK_BLOCK_MAX, max(MIN_TILE, triton.next_power_of_2(max_rank)))


def _rows(longest: int) -> dict:
    return dict(BLOCK_M=MIN_TILE, num_warps=4) if longest <= SHORT_SEGMENT else dict(BLOCK_M=LONG_BLOCK_M, num_warps=8)


def shrink_config(max_rank: int, longest: int) -> dict:
    """The shrink's compile-time constants and num_warps (one place for the launcher and
    attention/aot.py): max_rank, the largest of a projection's ranks in the step; longest,
    its longest run of rows."""
    return dict(BLOCK_K=BLOCK_K, RANK_BLOCK=rank_block(max_rank), **_rows(longest))


def expand_config(longest: int) -> dict:
    return dict(BLOCK_N=BLOCK_N, RANK_BLOCK=EXPAND_RANK_STEP, **_rows(longest))


def add(tables: StepTables, out: torch.Tensor, x: torch.Tensor, layer: int, target: str, column: int = 0,
        num_splits: int | None = None) -> None:
    """out[run rows, column:column + out_features] += scaling · (x[run rows] · Aᵀ) · Bᵀ for
    every run of `tables` whose adapter trains `target` on `layer` (a fused projection's
    output takes each target's columns). Checked by tables.supports first. num_splits: how
    many programs share each row block's in_features (None: enough to fill the device)."""
    projection = tables.projection(layer, target)
    if projection is None or tables.longest == 0:
        return
    out = out[:, column:column + projection.out_features]
    runs = tables.bounds.shape[0]
    shrink = shrink_config(projection.max_rank, tables.longest)
    expand = expand_config(tables.longest)
    rank_blocks = triton.cdiv(projection.max_rank, shrink["RANK_BLOCK"])
    row_blocks = triton.cdiv(tables.longest, shrink["BLOCK_M"])
    if num_splits is None:
        programs = runs * row_blocks * rank_blocks
        num_splits = max(1, min(projection.in_features // MIN_SPLIT_K, sm_count(out.device) // programs))
    k_per_split = triton.cdiv(triton.cdiv(projection.in_features, num_splits), BLOCK_K) * BLOCK_K
    num_splits = triton.cdiv(projection.in_features, k_per_split)
    shrunk = torch.zeros(x.shape[0], rank_blocks * shrink["RANK_BLOCK"], dtype=torch.float32, device=x.device)
    _shrink_kernel[(runs, row_blocks, rank_blocks * num_splits)](
        x, tables.bounds, projection.factors, shrunk,
        projection.in_features, k_per_split, rank_blocks, x.stride(0), shrunk.stride(0), **shrink)
    _expand_kernel[(runs, triton.cdiv(tables.longest, expand["BLOCK_M"]), triton.cdiv(projection.out_features, BLOCK_N))](
        shrunk, tables.bounds, projection.factors, tables.scaling, out,
        projection.out_features, shrunk.stride(0), out.stride(0), **expand)
