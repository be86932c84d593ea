"""Causal attention of prompt chunks by csrc/prefill_attention.c (cpu_kernels/prefill_attention.py)
at every level this CPU runs (portable, AVX2, AVX-512F, AVX-512 BF16), over float32 and
bfloat16 pools, against a float64 reference over the same paged pool: cached prefixes,
grouped query heads, windows, tails of queries and keys that fill no whole tile or block;
a query's bits the same whatever chunk it is computed in; and what it does not take,
refused."""

from __future__ import annotations

import pytest
import torch

from model_service.cpu_kernels import load, prefill_attention

from kernel_levels import level_fixture

library = load()
pytestmark = pytest.mark.skipif(library is None, reason="needs the CPU kernel library")
level = level_fixture(prefill_attention)
DTYPES = [torch.float32, torch.bfloat16]
# float32: only the order of float32 sums differs from float64; bfloat16: the output's rounding
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2e-3)}


def paged_pool(context: int, kv_heads: int, head_dim: int, block_size: int, seed: int, dtype=torch.bfloat16):
    """A layer [2, blocks, block_size, kv_heads, head_dim] whose blocks hold one sequence's
    K/V in shuffled order, and that sequence's block table."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-context // block_size) + 3
    layer = torch.randn((2, blocks, block_size, kv_heads, head_dim), generator=generator).to(dtype)
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


def attend(q, layer, table, query_len, context, scale, window=None, level=None):
    out = torch.empty(q.shape, dtype=layer.dtype)
    sequences = prefill_attention.prefill_sequences(table[None], [query_len], [context])
    prefill_attention.prefill_attention(library, q, layer, sequences, scale, window, out, level=level)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("query_len,context,q_heads,kv_heads,head_dim,block_size,window", [
    (1, 1, 3, 1, 64, 16, None),     # one token alone
    (16, 16, 9, 3, 64, 16, None),   # whole tiles, SmolLM2's heads
    (37, 37, 4, 2, 32, 4, None),    # tiles and key blocks with tails, small pool blocks
    (20, 300, 6, 2, 128, 16, None), # a chunk after a cached prefix
    (40, 100, 4, 4, 64, 8, 24),     # a sliding window
    (9, 30, 2, 1, 48, 16, 5),       # the generic head_dim, a window narrower than a tile
    (33, 61, 6, 2, 64, 16, 13),     # a window between the eight- and sixteen-lane tiles' widths
])
def test_matches_float64_attention(level, dtype, query_len, context, q_heads, kv_heads, head_dim, block_size, window):
    layer, table = paged_pool(context, kv_heads, head_dim, block_size, seed=query_len + context, dtype=dtype)
    q = torch.randn((query_len, q_heads, head_dim), generator=torch.Generator().manual_seed(7)).to(dtype)
    scale = head_dim ** -0.5
    out = attend(q, layer, table, query_len, context, scale, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, layer, table, context, scale, window), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 20])
def test_a_querys_bits_do_not_depend_on_its_chunk(level, dtype, window):
    """The same 50 queries in one chunk, and in chunks of 17, 1 and 32 (each over the
    context up to its end): equal bits."""
    layer, table = paged_pool(80, 2, 64, 16, seed=3, dtype=dtype)
    q = torch.randn((50, 6, 64), generator=torch.Generator().manual_seed(4)).to(dtype)
    whole = attend(q, layer, table, 50, 80, 0.125, window)
    start = 0
    for length in (17, 1, 32):
        part = attend(q[start:start + length].contiguous(), layer, table, length, 30 + start + length, 0.125, window)
        assert torch.equal(part, whole[start:start + length]), f"queries {start}..{start + length} differ"
        start += length


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_sequences_in_one_call_and_rows_apart(level, dtype):
    """Queries as the model has them: a view of the fused q/k/v rows (rows apart), two
    prefill sequences one after another, each with its own table and context."""
    layer, table = paged_pool(64, 1, 32, 8, seed=5, dtype=dtype)
    fused = torch.randn((24, 3 * 32 + 64), generator=torch.Generator().manual_seed(6)).to(dtype)
    q = fused[:, :96].view(24, 3, 32)
    tables = torch.stack([table, table.flip(0)])
    out = torch.empty((24, 3, 32), dtype=dtype)
    sequences = prefill_attention.prefill_sequences(tables, [10, 14], [40, 14])
    prefill_attention.prefill_attention(library, q, layer, sequences, 0.2, None, out)
    assert torch.equal(out[:10], attend(q[:10].contiguous(), layer, table, 10, 40, 0.2))
    assert torch.equal(out[10:], attend(q[10:].contiguous(), layer, table.flip(0).contiguous(), 14, 14, 0.2))


def test_the_best_level_is_the_cpus():
    flags = set(next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    expected = (3 if avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags
                else 2 if avx2 and "avx512f" in flags else 1 if avx2 else 0)
    assert prefill_attention.best_level(library) == expected


@pytest.mark.skipif(library is None or prefill_attention.best_level(library) < prefill_attention.LEVELS.index("avx512_bf16"),
                    reason="this CPU lacks AVX-512 BF16 (prefill attention: avx512_bf16)")
@pytest.mark.parametrize("window", [None, 20])
def test_a_float32_pool_at_avx512_bf16_takes_the_avx512_tile(window):
    """The dpbf16ps tile takes bfloat16 pools only: float32 at AVX-512 BF16 is the AVX-512F
    level's sixteen-lane tile, bit for bit (and sixteen lanes, not eight: not the AVX2 bits)."""
    layer, table = paged_pool(80, 3, 64, 16, seed=11, dtype=torch.float32)
    q = torch.randn((50, 9, 64), generator=torch.Generator().manual_seed(12))
    at = {name: attend(q, layer, table, 50, 80, 0.125, window, level=prefill_attention.LEVELS.index(name))
          for name in ("avx2", "avx512", "avx512_bf16")}
    assert torch.equal(at["avx512_bf16"], at["avx512"])
    assert not torch.equal(at["avx512"], at["avx2"])


def test_what_it_does_not_take_is_refused(monkeypatch):
    layer, table = paged_pool(8, 1, 24, 8, seed=1)  # head_dim 24: not a multiple of 16
    q = torch.zeros((4, 2, 24), dtype=torch.bfloat16)
    assert not prefill_attention.supports(library, q, layer)
    assert not prefill_attention.supports(library, q.half(), layer.half())
    assert not prefill_attention.supports(library, q.float(), layer)  # q not in the pool's dtype
    with pytest.raises(ValueError, match=r"prefill_attention refused queries \[4\] over contexts \[8\]"):
        attend(q, layer, table, 4, 8, 1.0)
    layer, table = paged_pool(8, 1, 32, 8, seed=1)
    with pytest.raises(ValueError, match=r"refused queries \[9\] over contexts \[8\]"):  # more queries than context
        attend(torch.zeros((9, 2, 32), dtype=torch.bfloat16), layer, table, 9, 8, 1.0)
    best = prefill_attention.best_level(library)
    q = torch.zeros((4, 2, 32), dtype=torch.bfloat16)
    if best + 1 < len(prefill_attention.LEVELS):  # the C side refuses a level above the CPU's
        with pytest.raises(ValueError, match="refused"):
            attend(q, layer, table, 4, 8, 1.0, level=best + 1)
        monkeypatch.setenv(prefill_attention.ENV, prefill_attention.LEVELS[best + 1])
        with pytest.raises(ValueError, match="this CPU runs"):
            prefill_attention.chosen_level()
    monkeypatch.setenv(prefill_attention.ENV, "avx9")
    with pytest.raises(ValueError, match="expected one of auto, portable, avx2, avx512, avx512_bf16"):
        attend(q, layer, table, 4, 8, 1.0)
