"""Triton kernels for the paged pool: write new K/V into slots, and decode attention.

Imported only by backend.load_triton_kernels (lazily; see backend.py for why). Prefill on CUDA
uses the torch path (SDPA's fused kernels), so there is no prefill kernel here.

No value that grows with a sequence is a tl.constexpr or a launch-shape input: context
lengths and block counts are read from device tensors inside the kernels, so a new prompt
length never compiles a new kernel. The constexprs (block size, head dim, group size) are
fixed for a model. Every loaded K/V/q value is converted to float32 at once: accumulation
wants it anyway, and Triton's interpreter (TRITON_INTERPRET=1, used by the tests on CPU)
holds bfloat16 as raw integers until converted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kv_ptr, slot_ptr,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_kv, stride_block, stride_slot, stride_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per (token, block of heads).
    token = tl.program_id(0)
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, DIM_PAD)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (bucketed batch sizes): nothing to store.
    # (Broadcast the slot to the tile first: the interpreter rejects a scalar-and-tile mask.)
    slot_tile = slot + tl.zeros([HEADS_PER_PROGRAM, DIM_PAD], tl.int64)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM) & (slot_tile >= 0)
    block = slot // BLOCK_SIZE
    dst = kv_ptr + block * stride_block + (slot % BLOCK_SIZE) * stride_slot + heads[:, None] * stride_head + dims[None, :]
    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative entries are skipped
) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    _, _, block_size, _, _ = kv_layer.shape
    _check_last_dim_contiguous(k=k, v=v, kv_layer=kv_layer)
    if num_tokens == 0:
        return
    dim_pad = triton.next_power_of_2(head_dim)
    # Up to ~1K elements a program: all heads of a token for common head dims.
    heads_per_program = min(triton.next_power_of_2(kv_heads), max(1, 1024 // dim_pad))
    grid = (num_tokens, triton.cdiv(kv_heads, heads_per_program))
    _write_kv_kernel[grid](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        HEADS_PER_PROGRAM=heads_per_program, DIM_PAD=dim_pad,
    )


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in exp2
    window,  # sliding window in positions; 0: the whole context (runtime, never a recompile)
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
    stride_kv, stride_block, stride_slot, stride_head, stride_table_seq,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    # One program per (sequence, kv head), serving all GROUP q heads that share that kv head,
    # so each K/V block is loaded once for the group. Online softmax over the blocks.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group_rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    slots = tl.arange(0, BLOCK_SIZE)
    row_mask = group_rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + group_rows

    q = tl.load(
        q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(tl.float32) * scale_log2  # [GROUP_PAD, DIM_PAD]

    context_len = tl.load(lens_ptr + seq)  # runtime: lengths never recompile
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    # First visible position: blocks wholly before the window are never loaded.
    first_pos = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    head_base = kv_ptr + kv_head * stride_head
    for i in range(first_pos // BLOCK_SIZE, num_blocks):
        block_id = tl.load(tables_ptr + seq * stride_table_seq + i).to(tl.int64)
        positions = i * BLOCK_SIZE + slots
        slot_mask = (positions < context_len) & (positions >= first_pos)
        offsets = block_id * stride_block + slots[:, None] * stride_slot + dims[None, :]
        kv_mask = slot_mask[:, None] & dim_mask[None, :]
        k = tl.load(head_base + offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, DIM_PAD]
        # Groups are small (1-8): multiply-and-sum beats padding them to tl.dot's 16 rows.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(slot_mask[None, :], scores, float("-inf"))
        # Every visited block holds at least one visible slot, so new_max is finite.
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v = tl.load(head_base + stride_kv + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    # A padded batch entry (context_len 0) visits no block: output zeros, not 0/0.
    running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,  # attend to the last sliding_window positions only
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim]
    num_seqs, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, pool_head_dim = kv_layer.shape
    if q_heads % kv_heads != 0 or head_dim != pool_head_dim:
        raise ValueError(f"q [{q_heads} heads, dim {head_dim}] does not fit the pool [{kv_heads} heads, dim {pool_head_dim}]")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two for the Triton kernel")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    _check_last_dim_contiguous(q=q, kv_layer=kv_layer, block_tables=block_tables)
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    _decode_kernel[(num_seqs, kv_heads)](
        q, kv_layer, block_tables, context_lens, out,
        scale * LOG2_E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
    )
    return out


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels index the innermost dimension with unit stride.
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)})")
