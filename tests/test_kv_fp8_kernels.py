"""8-bit K/V pools (attention/kv_quant.py) on every CPU attention path: the C decode kernel
and the PyTorch decode and prefill against a float32 reference run on the dequantized pool,
at every head_dim and GQA group the 16-bit tests cover, e4m3 and e5m2, with values at the
saturation edge; and writes that saturate instead of storing inf or NaN."""

from __future__ import annotations

import pytest
import torch

from model_service import cpu_kernels
from model_service.attention import AttentionMetadata, PagedAttention
from model_service.attention.kv_quant import KvScales, dequantize, namespace_tag, pool_absmax, quantize
from model_service.attention.torch_paged import decode_attention_torch, write_kv_torch
from model_service.cpu_kernels import kv_write, paged_decode

from kernel_levels import level_fixture

level = level_fixture(paged_decode)
write_level = level_fixture(kv_write)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = (0.05, 0.02)  # (k_scale, v_scale): not 1, so a scale applied twice or never shows
# Against the float32 reference on the same 8-bit values: only the arithmetic's rounding
# differs (float32 in both; q and out in bfloat16 where the model computes in it).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def fp8_pool(shape, dtype, scales, generator, edge: bool = False) -> torch.Tensor:
    """A [2, ...] pool of `dtype` holding random K and V (stored divided by their scales);
    edge: magnitudes spread up to 1.5x the type's largest value, so many saturate."""
    pool = torch.empty(shape, dtype=dtype)
    limit = torch.finfo(dtype).max
    for index, scale in enumerate(scales):
        values = torch.randn(shape[1:], generator=generator) * scale
        if edge:
            values = (torch.rand(shape[1:], generator=generator) * 1.5 * limit * scale
                      * torch.sign(torch.randn(shape[1:], generator=generator)))
        pool[index] = quantize(values, scale, dtype)
    return pool


def dequantized(pool: torch.Tensor, scales) -> torch.Tensor:
    return torch.stack([dequantize(pool[index], scales[index], torch.float32) for index in range(2)])


def decode_step(num_seqs, q_heads, kv_heads, head_dim, block_size, max_context, dtype, q_dtype, *, seed=0,
                edge=False):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max_context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 4
    kv_layer = fp8_pool((2, num_blocks, block_size, kv_heads, head_dim), dtype, SCALES, generator, edge)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq].view(num_seqs, -1)
    lens = torch.randint(1, max_context + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    lens[0] = max_context
    qkv = torch.randn(num_seqs, q_heads + 2 * kv_heads, head_dim, generator=generator)
    if edge:  # scores of saturated keys stay in a range the softmax can tell apart
        qkv /= torch.finfo(dtype).max * SCALES[0] * head_dim**0.5
    return qkv[:, :q_heads].to(q_dtype), kv_layer, tables.to(torch.int32), lens


def reference(q, kv_layer, tables, lens, scale, window=None):
    return decode_attention_torch(q.float(), dequantized(kv_layer, SCALES), tables, lens, scale,
                                  sliding_window=window)


def library():
    loaded = cpu_kernels.load()
    assert loaded is not None, cpu_kernels.load_error()
    return loaded


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256, 48])  # 48: the generic path
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(9, 3), (4, 4), (14, 2)])
def test_c_kernel_reads_fp8_as_the_float32_reference(level, dtype, head_dim, q_heads, kv_heads):
    q, kv_layer, tables, lens = decode_step(5, q_heads, kv_heads, head_dim, 16, 70, dtype, torch.bfloat16)
    out = paged_decode.paged_decode_attention(library(), q, kv_layer, tables, lens, head_dim**-0.5,
                                              kv_scales=SCALES)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), reference(q, kv_layer, tables, lens, head_dim**-0.5),
                               atol=TOLERANCE[torch.bfloat16], rtol=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("group", [1, 4, 5, 8, 16])  # the AVX-512 case goes in passes of up to 4 heads
@pytest.mark.parametrize(("block_size", "window"), [(16, None), (32, 77)])
def test_c_kernel_fp8_over_several_spans_float32_q(level, dtype, head_dim, group, block_size, window):
    q, kv_layer, tables, lens = decode_step(4, 2 * group, 2, head_dim, block_size, 700, dtype, torch.float32,
                                            seed=group)
    lens[1], lens[2] = 256, 17
    out = paged_decode.paged_decode_attention(library(), q, kv_layer, tables, lens, head_dim**-0.5, window,
                                              kv_scales=SCALES)
    torch.testing.assert_close(out, reference(q, kv_layer, tables, lens, head_dim**-0.5, window),
                               atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_c_kernel_and_torch_path_at_the_saturation_edge(level, dtype, head_dim):
    q, kv_layer, tables, lens = decode_step(4, 6, 2, head_dim, 16, 90, dtype, torch.float32, seed=3, edge=True)
    limit = torch.finfo(dtype).max
    assert (kv_layer.float().abs() == limit).any(), "the case must hold saturated values"
    expected = reference(q, kv_layer, tables, lens, head_dim**-0.5)
    by_kernel = paged_decode.paged_decode_attention(library(), q, kv_layer, tables, lens, head_dim**-0.5,
                                                    kv_scales=SCALES)
    by_torch = decode_attention_torch(q, kv_layer, tables, lens, head_dim**-0.5, kv_scales=SCALES)
    # Outputs are of the order of limit × v_scale: relative tolerance.
    for out in (by_kernel, by_torch):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, atol=1e-3, rtol=2e-5)


@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("head_dim", [32, 40])  # 40: the last 8 of a row by the integer method (cpu_math.h)
def test_every_fp8_byte_reads_as_torch_converts_it(level, dtype, head_dim):
    """All 256 bit patterns but NaN through the kernel's conversion: one key and one value
    position, so the output is exactly that V row times v_scale."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    finite = values[torch.isfinite(values.float())]
    finite = torch.cat([finite, finite[:head_dim]])  # every value in the tail columns too
    rows = finite[: finite.numel() // head_dim * head_dim].view(-1, head_dim)
    kv_layer = torch.zeros(2, rows.shape[0], 1, 1, head_dim, dtype=dtype)
    kv_layer[1].view(torch.uint8)[:, 0, 0] = rows.view(torch.uint8)
    tables = torch.arange(rows.shape[0], dtype=torch.int32)[:, None]
    lens = torch.ones(rows.shape[0], dtype=torch.int32)
    q = torch.randn(rows.shape[0], 1, head_dim)
    out = paged_decode.paged_decode_attention(library(), q, kv_layer, tables, lens, 1.0, kv_scales=(1.0, 0.5))
    torch.testing.assert_close(out[:, 0], rows.float() * 0.5, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_writes_saturate_never_inf_or_nan(dtype):
    kv_layer = torch.zeros(2, 3, 4, 2, 8, dtype=dtype)
    limit = torch.finfo(dtype).max
    k = torch.tensor([1e9, -1e9, float("inf"), -float("inf")]).repeat_interleave(4).view(4, 2, 2).repeat(1, 1, 4)
    v = torch.full((4, 2, 8), 3.0)
    write_kv_torch(k.to(torch.bfloat16), v.to(torch.bfloat16), kv_layer, torch.tensor([0, 5, 6, 11]),
                   kv_scales=(2.0, 0.25))
    stored = kv_layer.float()
    assert torch.isfinite(stored).all()
    assert stored[0].view(-1, 2, 8)[[0, 5, 6, 11]].abs().eq(limit).all()
    torch.testing.assert_close(stored[1].view(-1, 2, 8)[[0, 5, 6, 11]], torch.full((4, 2, 8), 12.0))
    assert stored.view(2, -1, 2, 8)[:, [1, 2, 3, 4, 7, 8, 9, 10]].eq(0).all()  # nowhere else


def every_kind_of_value(dtype, scale: float, generator) -> torch.Tensor:
    """[4096] values that, divided by `scale`, cover `dtype`'s subnormals, its normals (with
    ties between two codes), both signs, zeros of both signs, the saturation edge and past
    it, and inf."""
    finfo = torch.finfo(dtype)
    every_code = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every_code = every_code[torch.isfinite(every_code)]
    ties = (every_code[:-1] + every_code[1:]) / 2  # halfway between neighbouring codes (same sign)
    spread = torch.randn(1024, generator=generator) * torch.logspace(-10, 5, 1024, base=2)
    edge = torch.linspace(0.9, 1.6, 256) * finfo.max
    values = torch.cat([every_code, ties, spread, edge, -edge, torch.tensor([0.0, -0.0, float("inf"), -float("inf")])])
    values = torch.cat([values, torch.randn(4096 - len(values), generator=generator)])
    return values * scale


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels did not build")
@pytest.mark.parametrize("pool_dtype", [*FP8, None], ids=[*map(str, FP8), "the model's dtype"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), SCALES], ids=["unit scales", "scales"])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 64), (1, 20)])  # 20: rows that end past the last 8
def test_c_write_stores_the_bytes_the_torch_write_does(write_level, pool_dtype, model_dtype, scales, kv_heads,
                                                       head_dim):
    """csrc/kv_write.c, at each level, against write_kv_torch: the same bytes in the same
    slots (rounding to nearest even, saturation) and nothing elsewhere; rows of k and v
    further apart than a row, as views of the fused q/k/v output are; a negative slot
    (padding) skipped."""
    pool_dtype = pool_dtype or model_dtype
    generator = torch.Generator().manual_seed(7)
    tokens = 32
    reference_dtype = pool_dtype if pool_dtype in FP8 else torch.float8_e4m3fn
    size = tokens * kv_heads * head_dim
    k = every_kind_of_value(reference_dtype, scales[0], generator)[:size].view(tokens, kv_heads, head_dim)
    v = every_kind_of_value(torch.float8_e5m2, scales[1], generator).flip(0)[:size].view(tokens, kv_heads, head_dim)
    fused = torch.cat([torch.zeros(tokens, 3, head_dim), k, v], dim=1).to(model_dtype)  # [T, 3 + 2 Hkv, D]
    k, v = fused[:, 3:3 + kv_heads], fused[:, 3 + kv_heads:]
    slots = torch.randperm(48, generator=generator)[:tokens]
    slots[5] = -1
    pools = [torch.zeros(2, 12, 4, kv_heads, head_dim, dtype=pool_dtype) for _ in range(2)]
    kept = slots >= 0
    write_kv_torch(k[kept], v[kept], pools[0], slots[kept], kv_scales=scales)
    layer = pools[1]
    assert kv_write.supports(k, v, layer)
    kv_write.write_kv(cpu_kernels.load(), k, v, layer, slots, scales)
    as_bytes = [pool.view(torch.uint8) if pool.dtype in FP8 else pool.view(torch.int16 if pool.element_size() == 2
                                                                           else torch.int32) for pool in pools]
    differing = (as_bytes[0] != as_bytes[1]).nonzero()
    assert len(differing) == 0, f"{len(differing)} values differ, first at {differing[0].tolist()}"


def mixed_step(dtype, q_dtype, group, block_size, seed):
    """Decode sequences then prefill chunks that all have a cached prefix: every query
    reads 8-bit K/V from the pool. Returns the fp8 pool, the step's q/k/v and metadata."""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = 2, 16
    seqs = [(37, 1), (5, 1), (40, 9), (19, 16)]  # (context after the step, new tokens)
    blocks = [-(-context // block_size) for context, _ in seqs]
    num_blocks = sum(blocks) + 3
    kv_layer = fp8_pool((2, num_blocks, block_size, kv_heads, head_dim), dtype, SCALES, generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(seqs), max(blocks) + 1, dtype=torch.int32)
    slots = []
    for row, (context, new) in enumerate(seqs):
        ids = [order.pop() for _ in range(blocks[row])]
        tables[row, : len(ids)] = torch.tensor(ids)
        slots += [ids[pos // block_size] * block_size + pos % block_size for pos in range(context - new, context)]
    tokens = sum(new for _, new in seqs)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=generator).to(q_dtype)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * SCALES[0]).to(q_dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=generator) * SCALES[1]).to(q_dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=tables,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_lens=tuple(n for _, n in seqs), context_lens_host=tuple(c for c, _ in seqs),
        num_decode_seqs=2, block_size=block_size,
    )
    return kv_layer, q, k, v, meta


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", FP8, ids=str)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [16, 8])
def test_paged_attention_on_an_fp8_pool_matches_float32_on_its_values(backend, dtype, q_dtype, group, block_size):
    kv_layer, q, k, v, meta = mixed_step(dtype, q_dtype, group, block_size, seed=group * block_size)
    out = PagedAttention(backend)(q, k, v, kv_layer, meta, 0.25, kv_scales=SCALES)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    # The reference: the same step over the float32 values the pool now holds (this step's
    # K/V included, as written); writing them again changes nothing.
    pool32 = dequantized(kv_layer, SCALES)
    k32 = dequantize(quantize(k, SCALES[0], dtype), SCALES[0], torch.float32)
    v32 = dequantize(quantize(v, SCALES[1], dtype), SCALES[1], torch.float32)
    expected = PagedAttention("torch")(q.float(), k32, v32, pool32, meta, 0.25)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[q_dtype], rtol=TOLERANCE[q_dtype])


def test_scales_from_absmax_and_their_namespace():
    pool = torch.zeros(3, 2, 4, 16, 2, 8)
    pool[0, 0, 1, 2, 1, 3] = -40.0
    pool[0, 1, 0, 0, 0, 0] = 5.0
    pool[1, 0, 3, 15, 0, 7] = 2.0  # layer 1's V is all zeros: its scale stays 1
    k_absmax, v_absmax = pool_absmax(pool.to(torch.bfloat16))
    assert k_absmax == [40.0, 2.0, 0.0] and v_absmax == [5.0, 0.0, 0.0]
    scales = KvScales.from_absmax(k_absmax, v_absmax)
    assert scales.layers == (
        (float(torch.tensor(0.2)), float(torch.tensor(0.05))), (float(torch.tensor(0.01)), 1.0), (1.0, 1.0))
    ones = KvScales.ones(3)
    assert namespace_tag(torch.bfloat16, ones) == ""
    tags = {namespace_tag(dtype, which) for dtype in FP8 for which in (ones, scales)}
    assert len(tags) == 4 and all(tag.startswith("kv=fp8_e") for tag in tags)
    assert namespace_tag(torch.float8_e4m3fn, KvScales.ones(3)) == namespace_tag(torch.float8_e4m3fn, ones)
    with pytest.raises(ValueError, match="finite and positive"):
        KvScales(((1.0, float("nan")),))
