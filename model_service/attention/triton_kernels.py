"""Triton kernels for the paged pool: write new K/V into slots, and decode attention.

Imported only by backend.load_triton_kernels (lazily; see backend.py for why). Prefill on CUDA
uses the torch path (SDPA's fused kernels), so there is no prefill kernel here.

No value that grows with a sequence is a tl.constexpr or a launch-shape input: context
lengths and block counts are read from device tensors inside the kernels, so a new prompt
length never compiles a new kernel. The constexprs (block size, head dim, group size) are
fixed for a model. Every loaded K/V/q value is converted to float32 at once: accumulation
wants it anyway, and Triton's interpreter (TRITON_INTERPRET=1, used by the tests on CPU)
holds bfloat16 as raw integers until converted.

An 8-bit pool (attention/kv_quant.py) is handed to the kernels as its bytes (uint8): writes
store bytes quantized by kv_quant.quantize (saturating, in torch, before the kernel), and
decode widens each byte to float16 bits by shifts (FP8_KIND; the C kernel's conversion,
cpu_kernels/csrc/cpu_math.h), so neither needs the GPU's or the interpreter's fp8 support.
The scales fold into the score scale and the output's normalization.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from model_service.attention.kv_quant import quantize

LOG2_E = 1.4426950408889634
# FP8_KIND of the decode kernel, and what a widened byte is short of its value by (e4m3's
# exponent bias is 7, float16's 15: 2^8).
FP8_KINDS = {torch.float8_e4m3fn: (1, 256.0), torch.float8_e5m2: (2, 1.0)}
# Elements of the decode kernel's per-tile [group, slots, head_dim] products, and most slots a
# tile (decode_config): compiled for sm_90, 8192 elements spill at a group of 4 and head_dim
# 128, and a group of 1 with 64-slot tiles takes 231 registers (scripts/compile_kernels.py).
PRODUCT_ELEMENTS = 4096
MAX_TILE = 32
# Most parts a sequence's context is split into (choose_num_splits).
MAX_SPLITS = 32


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
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an 8-bit pool's (k_scale, v_scale)
) -> None:
    num_tokens, kv_heads, head_dim = k.shape
    _, _, block_size, _, _ = kv_layer.shape
    _check_last_dim_contiguous(k=k, v=v, kv_layer=kv_layer)
    if num_tokens == 0:
        return
    if kv_layer.dtype in FP8_KINDS:
        k = quantize(k, kv_scales[0], kv_layer.dtype).view(torch.uint8)
        v = quantize(v, kv_scales[1], kv_layer.dtype).view(torch.uint8)
        kv_layer = kv_layer.view(torch.uint8)
    config = write_kv_config(kv_heads, head_dim, block_size)
    grid = (num_tokens, triton.cdiv(kv_heads, config["HEADS_PER_PROGRAM"]))
    _write_kv_kernel[grid](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        **config,
    )


@triton.jit
def _load_kv(pointers, mask, FP8_KIND: tl.constexpr):
    """K or V values as float32; 8-bit ones in units of FP8_KINDS' unit."""
    if FP8_KIND == 0:
        return tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
    bits = tl.load(pointers, mask=mask, other=0).to(tl.uint16)
    shift: tl.constexpr = 7 if FP8_KIND == 1 else 8
    half = ((bits & 0x7F) << shift) | ((bits & 0x80) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,  # split partials, fp32 (unused when not SPLIT)
    scale_log2,  # softmax scale * log2(e) (* k_scale of an 8-bit pool): the kernel works in exp2
    window,  # sliding window in positions; 0: the whole context (runtime, never a recompile)
    out_scale,  # 1, or an 8-bit pool's v_scale
    stride_q_seq, stride_q_head, stride_out_seq, stride_out_head,
    stride_kv, stride_block, stride_slot, stride_head, stride_table_seq,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8_KIND: tl.constexpr,  # 0: K/V as stored; 1: e4m3 bytes; 2: e5m2 bytes
):
    # One program per (sequence, kv head, split of the context), serving all GROUP q heads
    # that share that kv head, so each K/V tile is loaded once for the group. Online softmax
    # over tiles of TILE slots: a block is visited in BLOCK_SIZE // TILE tiles, so the
    # [GROUP_PAD, TILE, DIM_PAD] products stay within registers whatever the block size
    # (decode_config sizes TILE; tests/test_kernels_compile.py checks for spills).
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    group_rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    tile_slots = tl.arange(0, TILE)
    row_mask = group_rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + group_rows

    q = tl.load(
        q_ptr + seq * stride_q_seq + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(tl.float32) * scale_log2  # [GROUP_PAD, DIM_PAD]

    context_len = tl.load(lens_ptr + seq)  # runtime: lengths never recompile
    # First visible position: blocks wholly before the window are never loaded.
    first_pos = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    first_block = first_pos // BLOCK_SIZE
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    # This split's share of the visible blocks (flash-decoding); some splits of a short
    # sequence get none and report an empty partial.
    per_split = tl.cdiv(num_blocks - first_block, num_splits)
    start_block = first_block + split * per_split
    end_block = tl.minimum(start_block + per_split, num_blocks)
    tiles_per_block: tl.constexpr = BLOCK_SIZE // TILE

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    head_base = kv_ptr + kv_head * stride_head
    for tile in range(start_block * tiles_per_block, end_block * tiles_per_block):
        block_index = tile // tiles_per_block
        slots = (tile % tiles_per_block) * TILE + tile_slots
        block_id = tl.load(tables_ptr + seq * stride_table_seq + block_index).to(tl.int64)
        positions = block_index * BLOCK_SIZE + slots
        slot_mask = (positions < context_len) & (positions >= first_pos)
        offsets = block_id * stride_block + slots[:, None] * stride_slot + dims[None, :]
        kv_mask = slot_mask[:, None] & dim_mask[None, :]
        k = _load_kv(head_base + offsets, kv_mask, FP8_KIND)  # [TILE, DIM_PAD] float32
        # Groups are small (1-8): multiply-and-sum beats padding them to tl.dot's 16 rows.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
        scores = tl.where(slot_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A tile with no visible slot (past the end, or before the window, in a visited
        # block) leaves new_max at -inf; subtract 0 then so no -inf - -inf makes a NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(running_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        v = _load_kv(head_base + stride_kv + offsets, kv_mask, FP8_KIND)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        # Unnormalised partials, [num_seqs, q_heads, num_splits(, DIM_PAD)]; _reduce_kernel
        # weighs them by their maxima.
        part_row = (seq * GROUP * tl.num_programs(1) + q_heads) * num_splits + split
        tl.store(part_acc_ptr + part_row[:, None] * DIM_PAD + dims[None, :], acc * out_scale, mask=out_mask)
        tl.store(part_max_ptr + part_row, running_max, mask=row_mask)
        tl.store(part_sum_ptr + part_row, running_sum, mask=row_mask)
    else:
        # A padded batch entry (context_len 0) visits no block: output zeros, not 0/0.
        running_sum = tl.where(running_sum == 0.0, 1.0, running_sum)
        out = acc * (out_scale / running_sum)[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + q_heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=out_mask,
        )


@triton.jit
def _reduce_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    num_splits, stride_out_seq, stride_out_head,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    # One program per (sequence, q head): the splits' partial softmaxes, each rescaled from
    # its own maximum to the overall one, summed and normalised once.
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_mask = splits < num_splits
    row = (seq * tl.num_programs(1) + q_head) * num_splits + splits
    maxima = tl.load(part_max_ptr + row, mask=split_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + row, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * DIM_PAD + dims[None, :], mask=split_mask[:, None], other=0.0)
    overall = tl.max(maxima, axis=0)
    overall = tl.where(overall == float("-inf"), 0.0, overall)  # every split empty: a padded entry
    weights = tl.exp2(maxima - overall)  # an empty split's -inf weighs 0
    total = tl.sum(weights * sums, axis=0)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.sum(weights[:, None] * acc, axis=0) / total
    tl.store(out_ptr + seq * stride_out_seq + q_head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def decode_config(group: int, head_dim: int, block_size: int, fp8_kind: int = 0) -> dict:
    """The decode kernel's compile-time constants for a model and pool (and num_warps):
    one place for the launcher and the ahead-of-time compile check (attention/aot.py).
    fp8_kind: FP8_KINDS' kind of an 8-bit pool, else 0."""
    group_pad = triton.next_power_of_2(group)
    dim_pad = triton.next_power_of_2(head_dim)
    # The widest tile whose [GROUP_PAD, TILE, DIM_PAD] product fits PRODUCT_ELEMENTS, i.e.
    # 32 float32 registers a thread at 4 warps: a group of 8 at head_dim 128 reads 4 slots a
    # tile, a group of 1 reads 32 (capped by the block). All powers of two, so the tile is
    # one too and divides the block.
    tile = max(1, min(block_size, MAX_TILE, PRODUCT_ELEMENTS // (group_pad * dim_pad)))
    return dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size, TILE=tile,
                HEAD_DIM=head_dim, DIM_PAD=dim_pad, FP8_KIND=fp8_kind, num_warps=4)


def choose_num_splits(num_seqs: int, kv_heads: int, max_blocks: int, sm_count: int) -> int:
    """How many parts to split each sequence's context into (flash-decoding): 1 when
    sequences x kv heads already fill the SMs, else enough for about one program an SM, a
    power of two (few reduce-kernel variants) of at most MAX_SPLITS and never more than the
    block table has columns. Depends only on shapes, never on lengths: a captured decode
    graph keeps its split."""
    programs = num_seqs * kv_heads
    if programs == 0 or programs * 2 > sm_count:
        return 1
    splits = 1
    while splits * 2 * programs <= sm_count and splits * 2 <= min(MAX_SPLITS, max_blocks):
        splits *= 2
    return splits


def decode_attention_triton(
    q: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,  # attend to the last sliding_window positions only
    num_splits: int | None = None,  # context splits; None: choose_num_splits for this device
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an 8-bit pool's (k_scale, v_scale)
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim]
    num_seqs, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, pool_head_dim = kv_layer.shape
    if q_heads % kv_heads != 0 or head_dim != pool_head_dim:
        raise ValueError(f"q [{q_heads} heads, dim {head_dim}] does not fit the pool [{kv_heads} heads, dim {pool_head_dim}]")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two for the Triton kernel")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    _check_last_dim_contiguous(q=q, kv_layer=kv_layer, block_tables=block_tables)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, kv_heads, block_tables.shape[1], sm_count(q.device))
    fp8_kind, unit = FP8_KINDS.get(kv_layer.dtype, (0, 1.0))
    k_scale, v_scale = (kv_scales[0] * unit, kv_scales[1] * unit) if fp8_kind else (1.0, 1.0)
    if fp8_kind:
        kv_layer = kv_layer.view(torch.uint8)
    config = decode_config(q_heads // kv_heads, head_dim, block_size, fp8_kind)
    dim_pad = config["DIM_PAD"]
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_seqs, q_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, q_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched: SPLIT is off
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, kv_layer, block_tables, context_lens, out,
        part_acc, part_max, part_sum,
        scale * k_scale * LOG2_E, sliding_window or 0, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3), block_tables.stride(0),
        SPLIT=split, **config,
    )
    if split:
        _reduce_kernel[(num_seqs, q_heads)](
            part_acc, part_max, part_sum, out,
            num_splits, out.stride(0), out.stride(1),
            **reduce_config(head_dim, num_splits),
        )
    return out


def reduce_config(head_dim: int, num_splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
                SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=4)


def write_kv_config(kv_heads: int, head_dim: int, block_size: int) -> dict:
    dim_pad = triton.next_power_of_2(head_dim)
    # Up to ~1K elements a program: all heads of a token for common head dims.
    heads_per_program = min(triton.next_power_of_2(kv_heads), max(1, 1024 // dim_pad))
    return dict(NUM_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                HEADS_PER_PROGRAM=heads_per_program, DIM_PAD=dim_pad)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter on CPU), so
    nothing splits unless asked to."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels index the innermost dimension with unit stride.
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)})")
