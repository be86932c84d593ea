"""Paged attention in plain PyTorch: runs on any device; the CPU hot path.

Layout (docs/architecture.md, "Pool layout"): kv_layer is [2, num_blocks, block_size, kv_heads, head_dim],
K at index 0 and V at index 1; slot s of block b is flat slot b * block_size + s.

Decode gathers a sequence's blocks and runs one SDPA call with the group's q heads laid out
as query rows of their shared kv head ([B, kv_heads, group, D]): one SDPA call that reads
each kv head once, where repeat_interleave copies K/V per q head and einsum, bmm and SDPA's
enable_gqa all measured slower at a batched decode shape. The gather uses index_select on
the block dimension, which measured faster than advanced indexing (kv[0][block_tables]).

An 8-bit pool (attention/kv_quant.py) holds K / k_scale and V / v_scale: the gathered blocks
are converted to q's dtype (exact: every e4m3 and e5m2 value is a bfloat16 and a float16
value), k_scale joins SDPA's scale and v_scale multiplies the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_service.attention.kv_quant import quantize

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv_torch(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    kv_scales: tuple[float, float] = (1.0, 1.0),  # an 8-bit pool's (k_scale, v_scale)
) -> None:
    """Store this step's K/V into their slots, in place in the shared pool (an 8-bit pool:
    divided by their scales, saturated)."""
    _, _, _, kv_heads, head_dim = kv_layer.shape
    # view (never reshape): a copy would take the write and silently drop it.
    k_slots = kv_layer[0].view(-1, kv_heads, head_dim)
    v_slots = kv_layer[1].view(-1, kv_heads, head_dim)
    slots = slot_mapping.to(device=kv_layer.device, dtype=torch.long)
    if kv_layer.dtype in _FP8:
        # index_copy_ has no 8-bit float kernel: the bytes go in as uint8.
        k_slots.view(torch.uint8).index_copy_(0, slots, quantize(k, kv_scales[0], kv_layer.dtype).view(torch.uint8))
        v_slots.view(torch.uint8).index_copy_(0, slots, quantize(v, kv_scales[1], kv_layer.dtype).view(torch.uint8))
        return
    k_slots.index_copy_(0, slots, k.to(kv_layer.dtype))
    v_slots.index_copy_(0, slots, v.to(kv_layer.dtype))


def attention_dtype(q: torch.Tensor, kv_layer: torch.Tensor) -> torch.dtype:
    """What attention computes in: the pool's dtype, or q's where the pool is 8-bit."""
    return q.dtype if kv_layer.dtype in _FP8 else kv_layer.dtype


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """What every layer's decode attention of one step shares: which pool blocks to gather
    and which gathered slots each query sees. Built once a step (per sliding window), not
    once a layer: at one stream of a 30-layer model the per-layer rebuild was a dozen small
    ops a layer."""

    block_ids: torch.Tensor  # [num_seqs * used_blocks], the trimmed tables flattened
    span: int  # used_blocks * block_size: gathered slots a sequence
    # [num_seqs, 1, 1, span] bool: the slots each query sees. Built from the device-side
    # lengths: captured graphs hold only an upper bound on the host-side ones.
    visible: torch.Tensor


def decode_plan(
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    block_size: int,
    device: torch.device,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
) -> DecodePlan:
    """max_context_len (host int), when given, trims the padded block table to the blocks
    that any sequence uses: tables are padded to the longest allowed sequence, and gathering
    the padding would dominate the cost. Leave it None where shapes must stay fixed."""
    if max_context_len is not None:
        used_blocks = max(1, -(-max_context_len // block_size))
        block_tables = block_tables[:, :used_blocks]
    span = block_tables.shape[1] * block_size
    block_ids = block_tables.reshape(-1).to(device)
    # clamp(min=1): a padded batch entry with no context still attends to one (ignored) slot,
    # so its row stays finite instead of 0/0.
    lens = context_lens.to(device=device, dtype=torch.long).clamp(min=1)
    key_pos = torch.arange(span, device=device)[None, :]
    visible = key_pos < lens[:, None]  # [B, span]
    if sliding_window is not None:
        visible &= key_pos >= lens[:, None] - sliding_window
    return DecodePlan(block_ids, span, visible[:, None, None, :])


def decode_attention_torch(
    q: torch.Tensor,  # [num_seqs, q_heads, head_dim], one query per sequence
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
    plan: DecodePlan | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Attend each sequence's single query over its context; returns [num_seqs, q_heads, head_dim].

    sliding_window (None: the whole context): the query sees only the last sliding_window
    positions, its own included, as transformers' sliding-window mask does.
    max_context_len: see decode_plan. plan: this step's decode_plan, when the caller shares
    one across layers (it then stands for block_tables, context_lens and both options).
    kv_scales: an 8-bit pool's (k_scale, v_scale).
    """
    num_seqs, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = q_heads // kv_heads
    if plan is None:
        plan = decode_plan(block_tables, context_lens, block_size, kv_layer.device, max_context_len, sliding_window)
    span = plan.span
    # [num_seqs * max_blocks, block_size, kv_heads, D] -> [B, span, kv_heads, D] -> [B, kv_heads, span, D]
    dtype = attention_dtype(q, kv_layer)
    k = kv_layer[0].index_select(0, plan.block_ids).view(num_seqs, span, kv_heads, head_dim).transpose(1, 2)
    v = kv_layer[1].index_select(0, plan.block_ids).view(num_seqs, span, kv_heads, head_dim).transpose(1, 2)
    k_scale, v_scale = kv_scales if kv_layer.dtype in _FP8 else (1.0, 1.0)
    k, v = k.to(dtype), v.to(dtype)

    # The group's q heads become `group` query rows of their kv head: one SDPA call, no
    # repeated K/V. SDPA's CPU and CUDA kernels accumulate fp16/bf16 softmax in float32.
    q_grouped = q.reshape(num_seqs, kv_heads, group, head_dim).to(dtype)
    out = F.scaled_dot_product_attention(q_grouped, k, v, attn_mask=plan.visible,
                                         scale=scale * k_scale)  # [B, kv_heads, group, D]
    if v_scale != 1.0:
        out = out * v_scale
    return out.reshape(num_seqs, q_heads, head_dim).to(q.dtype)


def prefill_attention_torch(
    q: torch.Tensor,  # [num_prefill_tokens, q_heads, head_dim], sequences back to back
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_prefill_seqs, max_blocks]
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],  # host ints; include the tokens just written
    scale: float,
    k_new: torch.Tensor | None = None,  # [num_prefill_tokens, kv_heads, head_dim], this step's K
    v_new: torch.Tensor | None = None,
    sliding_window: int | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Causal attention for prefill chunks over pool K/V (cached prefix included).

    Sequence i's query_lens[i] new tokens are the last ones of its context_lens[i] tokens, so
    new token j sits at position prefix + j and sees positions 0..prefix + j, or with a
    sliding_window only the last sliding_window of them (prefix + j - window + 1 on).
    Returns [num_prefill_tokens, q_heads, head_dim].

    With k_new/v_new (this step's K/V, already written to the pool), a sequence with no
    cached prefix attends over them directly instead of gathering them back from its blocks
    (unquantized, where the pool is 8-bit: as vLLM's prefill attends over this step's K/V).
    kv_scales: an 8-bit pool's (k_scale, v_scale).
    """
    _, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    dtype = attention_dtype(q, kv_layer)
    fp8 = kv_layer.dtype in _FP8
    out = torch.empty_like(q)
    start = 0
    for seq, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        if query_len == 0:
            continue
        prefix_len = context_len - query_len
        if prefix_len < 0:
            raise ValueError(f"sequence {seq}: query_len {query_len} > context_len {context_len}")
        # Keys before the first new token's window are seen by no query of this chunk: the
        # gather starts at the block holding the first visible one.
        first_key = 0 if sliding_window is None else max(prefix_len + 1 - sliding_window, 0)
        k_scale = v_scale = 1.0
        if prefix_len == 0 and k_new is not None:
            k = k_new[start : start + query_len].transpose(0, 1).to(dtype)
            v = v_new[start : start + query_len].transpose(0, 1).to(dtype)
        else:
            first_key -= first_key % block_size
            used_blocks = -(-context_len // block_size)
            block_ids = block_tables[seq, first_key // block_size : used_blocks].to(kv_layer.device)
            # [context_len - first_key, kv_heads, D] -> [kv_heads, context_len - first_key, D]
            k = kv_layer[0].index_select(0, block_ids).flatten(0, 1)[: context_len - first_key].transpose(0, 1)
            v = kv_layer[1].index_select(0, block_ids).flatten(0, 1)[: context_len - first_key].transpose(0, 1)
            if fp8:
                k, v = k.to(dtype), v.to(dtype)
                k_scale, v_scale = kv_scales
        q_seq = q[start : start + query_len].transpose(0, 1).to(dtype)  # [q_heads, query_len, D]
        num_keys = k.shape[1]  # keys first_key .. context_len - 1
        if prefix_len == 0 and (sliding_window is None or sliding_window >= query_len):
            mask, causal = None, True  # plain causal: lets SDPA pick its fastest kernel
        else:
            # SDPA's is_causal aligns the diagonal top-left; ours is offset by the prefix.
            offset = prefix_len - first_key  # key index of new token 0's own position
            mask = torch.ones(query_len, num_keys, dtype=torch.bool, device=q.device).tril(offset)
            if sliding_window is not None:
                mask = mask.triu(offset - sliding_window + 1)
            causal = False
        # 4-D (a batch of one): SDPA's fused CPU kernel takes only 4-D inputs; 3-D ones went
        # down its unfused math path (a quarter of a 2,048-token prefill step).
        attended = F.scaled_dot_product_attention(
            q_seq[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale * k_scale,
            enable_gqa=q_heads != kv_heads,
        )[0]  # [q_heads, query_len, D]
        if v_scale != 1.0:
            attended = attended * v_scale
        out[start : start + query_len] = attended.transpose(0, 1)
        start += query_len
    return out
