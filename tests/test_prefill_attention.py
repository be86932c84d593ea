"""Causal attention of prompt chunks by csrc/prefill_attention.c (cpu_kernels/prefill_attention.py)
against a float64 reference over the same paged pool: cached prefixes, grouped query
heads, windows, tails of queries and keys that fill no whole tile or block; a query's
bits the same whatever chunk it is computed in; and what it does not take, refused."""

from __future__ import annotations

import pytest
import torch

from model_service.cpu_kernels import load, prefill_attention

library = load()
pytestmark = pytest.mark.skipif(library is None or int(library.bf16_best_level()) < 1,
                                reason="needs the CPU kernel library on a CPU with AVX-512 BF16")


def paged_pool(context: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    """A bfloat16 layer [2, blocks, block_size, kv_heads, head_dim] whose blocks hold one
    sequence's K/V in shuffled order, and that sequence's block table."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size) + 3
    layer = torch.randn((2, blocks, block_size, kv_heads, head_dim), generator=generator).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=generator)[:-(-context // block_size)].to(torch.int32)
    return layer, table


def reference(q: torch.Tensor, layer: torch.Tensor, table: torch.Tensor, context: int, scale: float,
              window: int | None) -> torch.Tensor:
    """float64 softmax(q k^T scale) v of each query over the keys it sees."""
    block_size, kv_heads = layer.shape[2], layer.shape[3]
    slots = (table.long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context]
    keys = layer[0].reshape(-1, kv_heads, layer.shape[4])[slots].double()
    values = layer[1].reshape(-1, kv_heads, layer.shape[4])[slots].double()
    queries, q_heads = q.shape[0], q.shape[1]
    group = q_heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(queries):
        position = context - queries + i
        first = max(0, position - window + 1) if window else 0
        for h in range(q_heads):
            k, v = keys[first:position + 1, h // group], values[first:position + 1, h // group]
            weights = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v
    return out


def attend(q, layer, table, query_len, context, scale, window=None):
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    sequences = prefill_attention.prefill_sequences(table[None], [query_len], [context])
    prefill_attention.prefill_attention(library, q, layer, sequences, scale, window, out)
    return out


@pytest.mark.parametrize("query_len,context,q_heads,kv_heads,head_dim,block_size,window", [
    (1, 1, 3, 1, 64, 16, None),     # one token alone
    (16, 16, 9, 3, 64, 16, None),   # one whole tile, SmolLM2's heads
    (37, 37, 4, 2, 32, 4, None),    # tiles and key blocks with tails, small pool blocks
    (20, 300, 6, 2, 128, 16, None), # a chunk after a cached prefix
    (40, 100, 4, 4, 64, 8, 24),     # a sliding window
])
def test_matches_float64_attention(query_len, context, q_heads, kv_heads, head_dim, block_size, window):
    layer, table = paged_pool(context, kv_heads, head_dim, block_size, seed=query_len + context)
    q = torch.randn((query_len, q_heads, head_dim), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    scale = head_dim ** -0.5
    out = attend(q, layer, table, query_len, context, scale, window)
    torch.testing.assert_close(out.double(), reference(q, layer, table, context, scale, window),
                               rtol=2 ** -7, atol=2e-3)


@pytest.mark.parametrize("window", [None, 20])
def test_a_querys_bits_do_not_depend_on_its_chunk(window):
    """The same 50 queries in one chunk, and in chunks of 17, 1 and 32 (each over the
    context up to its end): equal bits."""
    layer, table = paged_pool(80, 2, 64, 16, seed=3)
    q = torch.randn((50, 6, 64), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    whole = attend(q, layer, table, 50, 80, 0.125, window)
    start = 0
    for length in (17, 1, 32):
        part = attend(q[start:start + length].contiguous(), layer, table, length, 30 + start + length, 0.125, window)
        assert torch.equal(part, whole[start:start + length]), f"queries {start}..{start + length} differ"
        start += length


def test_two_sequences_in_one_call_and_rows_apart():
    """Queries as the model has them: a view of the fused q/k/v rows (rows apart), two
    prefill sequences one after another, each with its own table and context."""
    layer, table = paged_pool(64, 1, 32, 8, seed=5)
    fused = torch.randn((24, 3 * 32 + 64), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    q = fused[:, :96].view(24, 3, 32)
    tables = torch.stack([table, table.flip(0)])
    out = torch.empty((24, 3, 32), dtype=torch.bfloat16)
    sequences = prefill_attention.prefill_sequences(tables, [10, 14], [40, 14])
    prefill_attention.prefill_attention(library, q, layer, sequences, 0.2, None, out)
    assert torch.equal(out[:10], attend(q[:10].contiguous(), layer, table, 10, 40, 0.2))
    assert torch.equal(out[10:], attend(q[10:].contiguous(), layer, table.flip(0).contiguous(), 14, 14, 0.2))


def test_what_it_does_not_take_is_refused():
    layer, table = paged_pool(8, 1, 24, 8, seed=1)  # head_dim 24: not a multiple of 16
    q = torch.zeros((4, 2, 24), dtype=torch.bfloat16)
    assert not prefill_attention.supports(library, q, layer)
    assert not prefill_attention.supports(library, q.float(), layer.float())
    with pytest.raises(ValueError, match=r"prefill_attention_bf16 refused queries \[4\] over contexts \[8\]"):
        attend(q, layer, table, 4, 8, 1.0)
    layer, table = paged_pool(8, 1, 32, 8, seed=1)
    with pytest.raises(ValueError, match=r"refused queries \[9\] over contexts \[8\]"):  # more queries than context
        attend(torch.zeros((9, 2, 32), dtype=torch.bfloat16), layer, table, 9, 8, 1.0)
