"""The CPU paged-attention paths (PyTorch, and the C decode kernel, prefill included) against a
naive dense reference.

The reference never sees the pool: it keeps each sequence's K/V contiguous and computes an
explicit causal softmax in float64, with K/V repeated per q head. Block tables are shuffled
(non-contiguous) pool blocks; batches mix decode with prefill, with and without a cached prefix.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_marks import needs_c_kernels

from model_service.attention import AttentionMetadata, PagedAttention
from model_service.attention.torch_paged import decode_attention_torch, prefill_attention_torch, write_kv_torch

HEAD_DIM = 16
KV_HEADS = 2
# Compared in float32 after the run; fp16/bf16 tolerances are a few units of their rounding.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def build_step(
    seqs: list[tuple[int, int]],  # (context_len after this step, new tokens this step); decode first
    num_decode: int,
    *,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    extra_table_columns: int = 2,
):
    """A pool whose earlier tokens are already in place, this step's q/k/v, metadata, and
    each sequence's full contiguous K/V (as the pool's dtype rounds them)."""
    generator = torch.Generator().manual_seed(seed)
    q_heads = KV_HEADS * group
    blocks_needed = [math.ceil(context_len / block_size) for context_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 5  # spare blocks hold garbage that must never be read
    # Garbage everywhere first: anything read outside a sequence's context shows up as error.
    kv_layer = (torch.randn(2, num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=generator) * 100).to(dtype)
    shuffled = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_needed) + extra_table_columns
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)

    full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], []
    for seq, (context_len, query_len) in enumerate(seqs):
        blocks = [shuffled.pop() for _ in range(blocks_needed[seq])]
        block_tables[seq, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k_seq = torch.randn(context_len, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        v_seq = torch.randn(context_len, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        seq_slots = [blocks[pos // block_size] * block_size + pos % block_size for pos in range(context_len)]
        prefix_len = context_len - query_len
        for pos in range(prefix_len):  # earlier steps' tokens are already in the pool
            kv_layer[0].view(-1, KV_HEADS, HEAD_DIM)[seq_slots[pos]] = k_seq[pos]
            kv_layer[1].view(-1, KV_HEADS, HEAD_DIM)[seq_slots[pos]] = v_seq[pos]
        full_k.append(k_seq)
        full_v.append(v_seq)
        ks.append(k_seq[prefix_len:])
        vs.append(v_seq[prefix_len:])
        slots.extend(seq_slots[prefix_len:])
        qs.append(torch.randn(query_len, q_heads, HEAD_DIM, generator=generator).to(dtype))

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_lens=tuple(n for _, n in seqs),
        context_lens_host=tuple(c for c, _ in seqs),
        num_decode_seqs=num_decode,
        block_size=block_size,
    )
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_layer, meta, full_k, full_v


def dense_reference(q, meta, full_k, full_v, scale, sliding_window=None):
    """Explicit causal softmax in float64 over contiguous K/V repeated per q head; with a
    sliding window, a query at position p sees keys p - window + 1 .. p."""
    outs, start = [], 0
    for seq, query_len in enumerate(meta.query_lens):
        context_len = meta.context_lens_host[seq]
        prefix_len = context_len - query_len
        q_seq = q[start : start + query_len].double()  # [query_len, q_heads, D]
        group = q.shape[1] // KV_HEADS
        k = full_k[seq].double().repeat_interleave(group, dim=1)  # [context_len, q_heads, D]
        v = full_v[seq].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_seq, k) * scale
        query_pos = torch.arange(query_len)[:, None] + prefix_len
        key_pos = torch.arange(context_len)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        if sliding_window is not None:
            scores = scores.masked_fill(key_pos <= query_pos - sliding_window, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += query_len
    return torch.cat(outs)


# name: ([(context_len, query_len), ...], num_decode_seqs)
MIXED_BATCHES = {
    "decode_only": ([(1, 1), (16, 1), (17, 1), (40, 1), (33, 1)], 5),
    "prefill_no_prefix": ([(5, 5), (16, 16), (37, 37)], 0),
    "prefill_with_prefix": ([(20, 4), (48, 16), (33, 3)], 0),
    # The last prefill is a single new token after a cached prefix: still a prefill, not decode.
    "mixed": ([(9, 1), (31, 1), (64, 1), (12, 12), (50, 19), (18, 18), (25, 1)], 3),
}


# "cpu" is the C decode kernel (model_service/cpu_kernels), for decode and, each prompt token
# a query of its own, prefill; "torch" is gather + SDPA for both.
CPU_BACKENDS = ["torch", pytest.param("cpu", marks=needs_c_kernels)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("batch", list(MIXED_BATCHES), ids=list(MIXED_BATCHES))
def test_paged_attention_matches_dense_reference(batch, block_size, group, dtype, backend):
    seqs, num_decode = MIXED_BATCHES[batch]
    q, k, v, kv_layer, meta, full_k, full_v = build_step(seqs, num_decode, group=group, block_size=block_size, dtype=dtype)
    scale = HEAD_DIM**-0.5

    out = PagedAttention(backend)(q, k, v, kv_layer, meta, scale)

    assert out.shape == q.shape and out.dtype == dtype
    expected = dense_reference(q, meta, full_k, full_v, scale)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 5, 8, 21])
@pytest.mark.parametrize("batch", list(MIXED_BATCHES), ids=list(MIXED_BATCHES))
def test_sliding_window_matches_dense_reference(batch, window, dtype, backend):
    # Windows shorter than most contexts, one equal to the block size, and 1 (itself only);
    # prefixes of 44 and 32 start the gather several blocks in.
    seqs, num_decode = MIXED_BATCHES[batch]
    q, k, v, kv_layer, meta, full_k, full_v = build_step(seqs, num_decode, group=2, block_size=8, dtype=dtype)

    out = PagedAttention(backend)(q, k, v, kv_layer, meta, 0.25, sliding_window=window)

    expected = dense_reference(q, meta, full_k, full_v, 0.25, sliding_window=window)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # The window changes the answer wherever a context is longer than it.
    if window < max(meta.context_lens_host):
        assert not torch.allclose(out.double(), dense_reference(q, meta, full_k, full_v, 0.25), atol=1e-3)


def test_write_kv_lands_in_slots_and_nowhere_else():
    q, k, v, kv_layer, meta, _, _ = build_step([(20, 4), (7, 7)], 0, group=1, block_size=8, dtype=torch.float32)
    before = kv_layer.clone()
    write_kv_torch(k, v, kv_layer, meta.slot_mapping)
    flat_after = kv_layer.view(2, -1, KV_HEADS, HEAD_DIM)
    flat_before = before.view(2, -1, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_after[0, meta.slot_mapping], k, rtol=0, atol=0)
    torch.testing.assert_close(flat_after[1, meta.slot_mapping], v, rtol=0, atol=0)
    untouched = torch.ones(flat_after.shape[1], dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert torch.equal(flat_after[:, untouched], flat_before[:, untouched])


def test_write_kv_into_a_layer_view_of_the_whole_pool():
    # The model passes kv_pool[layer]; the write must land in the shared allocation.
    pool = torch.zeros(3, 2, 4, 8, KV_HEADS, HEAD_DIM)
    k = torch.randn(2, KV_HEADS, HEAD_DIM)
    v = torch.randn(2, KV_HEADS, HEAD_DIM)
    write_kv_torch(k, v, pool[1], torch.tensor([5, 30]))
    assert torch.equal(pool[1, 0, 0, 5], k[0]) and torch.equal(pool[1, 1, 3, 6], v[1])
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


def test_decode_trimming_padded_table_changes_nothing():
    q, k, v, kv_layer, meta, _, _ = build_step(
        [(3, 1), (29, 1), (11, 1)], 3, group=2, block_size=8, dtype=torch.float32, extra_table_columns=6
    )
    write_kv_torch(k, v, kv_layer, meta.slot_mapping)
    full = decode_attention_torch(q, kv_layer, meta.block_tables, meta.context_lens, 0.25)
    trimmed = decode_attention_torch(q, kv_layer, meta.block_tables, meta.context_lens, 0.25, max_context_len=29)
    torch.testing.assert_close(full, trimmed)


def test_decode_with_empty_context_stays_finite():
    # Bucketed batches pad with context_len 0 entries; their rows are discarded but must not be NaN.
    kv_layer = torch.randn(2, 4, 8, KV_HEADS, HEAD_DIM)
    out = decode_attention_torch(
        torch.randn(2, KV_HEADS, HEAD_DIM), kv_layer, torch.zeros(2, 3, dtype=torch.int32),
        torch.tensor([0, 5], dtype=torch.int32), 0.25,
    )
    assert torch.isfinite(out).all()


def test_prefill_rejects_query_longer_than_context():
    with pytest.raises(ValueError, match="query_len"):
        prefill_attention_torch(
            torch.randn(4, KV_HEADS, HEAD_DIM), torch.randn(2, 4, 8, KV_HEADS, HEAD_DIM),
            torch.zeros(1, 1, dtype=torch.int32), (4,), (3,), 0.25,
        )


def test_unknown_backend_and_bad_head_counts_are_errors():
    with pytest.raises(ValueError, match="unknown attention backend"):
        PagedAttention("cuda-magic")
    q, k, v, kv_layer, meta, _, _ = build_step([(4, 1)], 1, group=1, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        PagedAttention("torch")(torch.randn(1, 3, HEAD_DIM), k, v, kv_layer, meta, 0.25)


@needs_c_kernels
def test_auto_uses_the_c_kernel_for_a_cpu_pool():
    kv_layer = torch.zeros(2, 1, 8, 1, 4)
    attention = PagedAttention("auto")
    assert attention.select(torch.zeros(1, 1, 4), kv_layer).name == "cpu"
    assert PagedAttention("torch").select(torch.zeros(1, 1, 4), kv_layer).name == "torch"


@pytest.mark.parametrize("requested", ["auto", "torch"])
def test_the_backend_is_chosen_once_for_a_pool_not_at_every_layer(monkeypatch, requested):
    """Every layer of every step over one pool reuses the first call's choice; a pool of
    another dtype is chosen for again, and the outputs do not depend on the memo."""
    attention = PagedAttention(requested)
    choices = []
    choose = attention._choose
    monkeypatch.setattr(attention, "_choose", lambda q, kv_layer: choices.append(kv_layer.dtype) or choose(q, kv_layer))
    steps = [build_step([(9, 1), (20, 6)], 1, group=2, block_size=8, dtype=dtype, seed=seed)
             for dtype in (torch.float32, torch.bfloat16) for seed in (0, 1)]
    outputs = [attention(q, k, v, kv_layer, meta, 0.25) for q, k, v, kv_layer, meta, _, _ in steps for _layer in range(3)]
    assert choices == [torch.float32, torch.bfloat16]
    for index, (q, k, v, kv_layer, meta, _, _) in enumerate(steps):
        fresh = PagedAttention(requested)(q, k, v, kv_layer.clone(), meta, 0.25)
        torch.testing.assert_close(outputs[index * 3 + 2], fresh, atol=0, rtol=0)
