"""The quantized-weight C kernels (cpu_kernels/quant_matmul.py) against float references
on the same blocks dequantized by gguf's numpy code, for every type and every dispatch
level this CPU runs (levels it lacks are skipped, and say so).

Tolerances, from the activation quantization: each activation x is replaced by d * q with
d = amax / 127 over its block of 32 and q = round(x / d), so |x - d q| <= amax / 254, and
an output y = sum w x moves by at most sum over blocks of (amax_b / 254) * sum_b |w|.
The kernel must be within that bound (plus 1e-4 of sum |w x| for float32 summation) of the
float product, and within 1e-4 of sum |w x| of the product by the activations quantized
the same way in numpy (the integer arithmetic is exact; only float summation differs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from kernel_levels import force, level_params
from harness.random_quant_blocks import random_blocks

from model_service import cpu_kernels
from model_service.cpu_kernels import quant_matmul
from model_service.cpu_kernels.quant_matmul import KERNEL_TYPES, LEVELS, Segments

TYPES = list(KERNEL_TYPES)

@pytest.fixture(scope="module")
def library():
    loaded = cpu_kernels.load()
    assert loaded is not None, cpu_kernels.load_error()
    return loaded


def reference_weights(blocks: np.ndarray, type_code: int) -> np.ndarray:
    return dequantize(blocks, GGMLQuantizationType(type_code)).astype(np.float64)


def quantized_activations(x: np.ndarray) -> np.ndarray:
    """x as the kernels see it: blocks of 32 at 8 bits, scale amax / 127 (in float32)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    return (q * (amax / np.float32(127))).reshape(x.shape).astype(np.float64)


def levels_here(library) -> list[int]:
    return list(range(quant_matmul.best_level(library) + 1))


@pytest.fixture
def level(request, monkeypatch) -> int:
    """The level of the test's parameter, forced by PAGEDKV_QUANT_KERNELS as users force it."""
    return force(monkeypatch, quant_matmul.FAMILY, request.param)


@pytest.mark.parametrize("level", level_params(quant_matmul.FAMILY), indirect=True)
@pytest.mark.parametrize("type_code", TYPES, ids=[KERNEL_TYPES[t] for t in TYPES])
@pytest.mark.parametrize(("tokens", "rows", "blocks_per_row"), [(1, 37, 1), (3, 16, 3), (9, 53, 2)])
def test_linear_matches_float_reference(library, level, type_code, tokens, rows, blocks_per_row):
    cols = quant_matmul.BLOCK_SIZES[type_code][0] * blocks_per_row
    blocks = random_blocks(type_code, rows, cols, seed=type_code * 100 + rows)
    weights = reference_weights(blocks, type_code)
    generator = torch.Generator().manual_seed(tokens)
    # Rows further apart than cols: a linear's input may be a view.
    x = torch.randn(tokens, cols + 8, generator=generator)[:, :cols]

    y = quant_matmul.linear(library, x, Segments([(type_code, torch.from_numpy(blocks))], cols), level)
    assert_within_the_activations_rounding(y, x, weights)


def assert_within_the_activations_rounding(y: torch.Tensor, x: torch.Tensor, weights: np.ndarray) -> None:
    """The module docstring's two bounds."""
    y, x64 = y.double().numpy(), x.double().numpy()
    tokens, rows = y.shape
    magnitude = np.abs(x64) @ np.abs(weights).T
    amax = np.abs(x64.reshape(tokens, -1, 32)).max(axis=-1)  # [T, blocks]
    weight_mass = np.abs(weights.reshape(rows, -1, 32)).sum(axis=-1)  # [rows, blocks]
    bound = (amax / 254) @ weight_mass.T
    assert np.all(np.abs(y - x64 @ weights.T) <= bound * 1.001 + 1e-4 * magnitude + 1e-6)
    emulated = quantized_activations(x64) @ weights.T
    np.testing.assert_allclose(y, emulated, rtol=0, atol=1e-4 * magnitude.max() + 1e-6)


def interleaved(library, type_code: int, blocks: np.ndarray) -> tuple[int, torch.Tensor]:
    """A copy of the blocks held as QuantizedLinear holds them: eight rows interleaved."""
    held = torch.from_numpy(blocks.copy())
    code = quant_matmul.repack(library, type_code, held)
    assert code == type_code | quant_matmul.X8
    return code, held


X8_TYPES = list(quant_matmul.X8_TYPES)


@pytest.mark.parametrize("level", level_params(quant_matmul.FAMILY), indirect=True)
@pytest.mark.parametrize("type_code", X8_TYPES, ids=[KERNEL_TYPES[t] for t in X8_TYPES])
@pytest.mark.parametrize(("tokens", "rows", "blocks_per_row"),
                         [(1, 8, 1), (2, 24, 3), (5, 56, 2), (19, 40, 2), (17, 48, 3)])
def test_interleaved_linear_matches_float_reference(library, level, type_code, tokens, rows, blocks_per_row):
    """The interleaved layout's kernels within the same bounds as the file's layout, at every
    token count (they never hand a batch to the float product): 40 rows are two groups a
    512-bit vector twice and one group alone at the AVX-512 level, 19 tokens two full
    tiles and a tail. From FLOAT_PRODUCT_TOKENS tokens the float product, which a linear
    mixing layouts still takes, is checked on the same rows too (dequantized eight rows
    at a time), within bfloat16's rounding."""
    cols = 32 * blocks_per_row
    blocks = random_blocks(type_code, rows, cols, seed=type_code * 100 + rows)
    weights = reference_weights(blocks, type_code)
    x = torch.randn(tokens, cols + 8, generator=torch.Generator().manual_seed(tokens))[:, :cols]
    segments = Segments([interleaved(library, type_code, blocks)], cols)
    assert_within_the_activations_rounding(quant_matmul.linear(library, x, segments, level), x, weights)
    if tokens >= quant_matmul.FLOAT_PRODUCT_TOKENS and level > 0:
        y = quant_matmul.float_product(library, x.contiguous(), segments, level)
        reference = x.double().numpy() @ weights.T
        magnitude = np.abs(x.double().numpy()) @ np.abs(weights).T
        assert np.all(np.abs(y.double().numpy() - reference) <= 2 ** -7 * magnitude + 1e-6)


@pytest.mark.parametrize("type_code", X8_TYPES, ids=[KERNEL_TYPES[t] for t in X8_TYPES])
def test_interleaving_keeps_every_row(library, type_code):
    """Rows looked up in the interleaved layout (an embedding tied to an lm_head) dequantize
    to the file's values, all of them and any few, and a layout that cannot be had is
    refused rather than half made."""
    cols, rows = 96, 32
    blocks = random_blocks(type_code, rows, cols, seed=type_code)
    code, held = interleaved(library, type_code, blocks)
    assert not np.array_equal(held.numpy(), blocks)  # rearranged, in place
    expected = torch.from_numpy(reference_weights(blocks, type_code)).float()
    everything = quant_matmul.dequantize_rows(library, held, code, cols, None, torch.float32)
    torch.testing.assert_close(everything, expected, rtol=0, atol=0)
    picked = torch.tensor([31, 0, 9, 9, 17])
    torch.testing.assert_close(quant_matmul.dequantize_rows(library, held, code, cols, picked, torch.float32),
                               expected[picked], rtol=0, atol=0)
    odd = torch.from_numpy(random_blocks(type_code, 12, cols, seed=1))
    assert quant_matmul.repack(library, type_code, odd) == type_code  # 12 rows: held as the file has them
    with pytest.raises(ValueError, match="groups of 8"):
        Segments([(code, held[:12])], cols)


@pytest.mark.parametrize("type_code", TYPES, ids=[KERNEL_TYPES[t] for t in TYPES])
def test_levels_agree_on_a_model_sized_product(library, type_code):
    """Every level this CPU runs against the portable one, at SmolLM2's widths, in both
    float32 and bfloat16 inputs; row tiles and token tiles both have tails (49, 101)."""
    cols, rows, tokens = 1536 if quant_matmul.BLOCK_SIZES[type_code][0] == 256 else 576, 101, 49
    blocks = torch.from_numpy(random_blocks(type_code, rows, cols, seed=type_code))
    segments = Segments([(type_code, blocks)], cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(type_code))
    portable = quant_matmul.linear(library, x, segments, 0)
    scale = portable.abs().max().item()  # the levels differ only in float summation order
    for level in levels_here(library)[1:]:
        torch.testing.assert_close(quant_matmul.linear(library, x, segments, level, float_from=None), portable,
                                   rtol=0, atol=1e-5 * scale)
    if type_code in X8_TYPES:  # the first 96 rows interleaved, at every level
        x8 = Segments([interleaved(library, type_code, blocks[:96].numpy())], cols)
        for level in levels_here(library):
            torch.testing.assert_close(quant_matmul.linear(library, x, x8, level, float_from=None),
                                       portable[:, :96], rtol=0, atol=1e-5 * scale)
    bf16 = quant_matmul.linear(library, x.bfloat16(), segments, levels_here(library)[-1], float_from=None)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), portable, rtol=3e-2, atol=3e-2 * portable.abs().max().item())


@pytest.mark.parametrize("type_code", TYPES, ids=[KERNEL_TYPES[t] for t in TYPES])
def test_a_tokens_result_does_not_depend_on_its_step(library, type_code):
    """One token alone (a decode step of one stream: rows two at a time) and the same token
    among others (token tiles: 19 tokens are full tiles and a tail, for every tile size)
    give the same bits at every level, for an odd row count whose last row is left alone,
    and for 40 interleaved rows (groups two a vector, and one alone), so a sequence's
    greedy tokens do not depend on what it is batched with."""
    cols, rows = 2 * quant_matmul.BLOCK_SIZES[type_code][0], 37
    blocks = random_blocks(type_code, rows, cols, seed=type_code)
    layouts = {"file": Segments([(type_code, torch.from_numpy(blocks))], cols)}
    if type_code in X8_TYPES:  # and 40 rows interleaved
        layouts["x8"] = Segments([interleaved(library, type_code, random_blocks(type_code, 40, cols, seed=2))], cols)
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(type_code))
    for layout, segments in layouts.items():
        for level in levels_here(library):
            batched = quant_matmul.linear(library, x, segments, level, float_from=None)
            for token in range(len(x)):
                alone = quant_matmul.linear(library, x[token:token + 1], segments, level)
                assert torch.equal(alone[0], batched[token]), f"{layout}, {LEVELS[level]}, token {token}"


@pytest.mark.parametrize("type_code", TYPES, ids=[KERNEL_TYPES[t] for t in TYPES])
def test_float_product_matches_float_reference(library, monkeypatch, type_code):
    """A batch from FLOAT_PRODUCT_TOKENS tokens on multiplies in bfloat16 by weights
    dequantized a tile at a time: against float64 on the dequantized blocks, within
    bfloat16's rounding of x and of each weight (2^-9 of each, relative: a bound of
    2^-8 of sum |x| |w| per output, doubled for float32 summation) and of the product
    (2^-8 of |x w|, with room), at every SIMD level,
    over several tiles and a short last one (61 rows, tiles of 16), behind a segment of
    another type, for float32 and bfloat16 inputs."""
    if quant_matmul.best_level(library) == 0:
        pytest.skip("the float product needs a SIMD level")
    monkeypatch.setattr(quant_matmul, "FLOAT_TILE_BYTES", 16 * 2 * 512)
    cols = 512
    other = 8 if type_code != 8 else 3
    parts = [(other, random_blocks(other, 13, cols, seed=1)), (type_code, random_blocks(type_code, 48, cols, seed=2))]
    weights = np.concatenate([reference_weights(blocks, code) for code, blocks in parts])
    segments = Segments([(code, torch.from_numpy(blocks)) for code, blocks in parts], cols)
    tokens = quant_matmul.FLOAT_PRODUCT_TOKENS + 3
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(type_code))
    x64 = x.double().numpy()
    bound = 2 * 2.0**-8 * (np.abs(x64) @ np.abs(weights).T) + 1e-6
    for level in levels_here(library)[1:]:
        for dtype in (torch.float32, torch.bfloat16):
            y = quant_matmul.linear(library, x.to(dtype), segments, level)
            assert y.dtype == dtype and y.shape == (tokens, 61)
            rounded = 2.0**-8 * np.abs(x64 @ weights.T)  # the product itself comes out in bfloat16
            assert np.all(np.abs(y.double().numpy() - x64 @ weights.T) <= bound + rounded), LEVELS[level]


def test_segments_of_mixed_types_fill_their_own_columns(library):
    """A fused QKV of Q4_K rows and Q6_K rows (as Q4_K_M files have): each segment's
    columns equal that segment alone."""
    cols = 512
    first = torch.from_numpy(random_blocks(12, 24, cols, seed=1))
    second = torch.from_numpy(random_blocks(14, 9, cols, seed=2))
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(3))
    level = quant_matmul.best_level(library)

    both = quant_matmul.linear(library, x, Segments([(12, first), (14, second)], cols), level)

    assert both.shape == (5, 33)
    assert torch.equal(both[:, :24], quant_matmul.linear(library, x, Segments([(12, first)], cols), level))
    assert torch.equal(both[:, 24:], quant_matmul.linear(library, x, Segments([(14, second)], cols), level))


@pytest.mark.parametrize("type_code", TYPES, ids=[KERNEL_TYPES[t] for t in TYPES])
def test_dequantize_rows_matches_gguf(library, type_code):
    cols = quant_matmul.BLOCK_SIZES[type_code][0] * 2
    blocks = random_blocks(type_code, 11, cols, seed=type_code + 7)
    expected = torch.from_numpy(dequantize(blocks, GGMLQuantizationType(type_code)).astype(np.float32))
    indices = torch.tensor([10, 0, 3, 3])

    rows = quant_matmul.dequantize_rows(library, torch.from_numpy(blocks), type_code, cols, indices, torch.float32)

    # gguf computes d * q + m in float32 too; only a fused multiply-add may round differently.
    torch.testing.assert_close(rows, expected[indices], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_level_quantizes_the_activations_alike(library, dtype):
    """The SIMD levels quantize x in vectors: the same bytes, scales and sums as the portable
    C, and as numpy's rounding of the same arithmetic, for blocks with ties (x.5 after
    scaling), zeros, one value alone and both signs."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(5, 128, generator=generator) * torch.tensor([1e-3, 1.0, 30.0, 1.0]).repeat_interleave(32)
    x[1, :32] = 0.0  # a block of zeros: scale 0, values 0
    x[2, 32:64] = torch.cat([torch.tensor([127.0]), torch.arange(31) - 14.5])  # scale 1: halves tie, to even
    x[3, 64:96] = 0.0
    x[3, 70] = -2.0  # one value alone
    x = x.to(dtype)
    portable = quant_matmul.quantize_activations(library, x, 0)
    for level in levels_here(library)[1:]:
        for ours, theirs in zip(quant_matmul.quantize_activations(library, x, level), portable, strict=True):
            assert torch.equal(ours, theirs), LEVELS[level]
    blocks = x.float().numpy().reshape(5, -1, 32)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    np.testing.assert_array_equal(portable[0].numpy().reshape(5, -1, 32), np.rint(blocks * inverse[..., None]))
    np.testing.assert_array_equal(portable[1].numpy(), amax / np.float32(127))
    np.testing.assert_array_equal(portable[3].numpy(), portable[0].numpy().reshape(5, -1, 32).sum(axis=-1))


def test_zero_activations_give_zero(library):
    cols = 64
    blocks = torch.from_numpy(random_blocks(3, 4, cols, seed=0))
    y = quant_matmul.linear(library, torch.zeros(2, cols), Segments([(3, blocks)], cols), 0)
    assert torch.equal(y, torch.zeros(2, 4))


def test_a_wrong_row_width_is_refused():
    with pytest.raises(ValueError, match="must be uint8"):
        Segments([(8, torch.zeros(3, 33, dtype=torch.uint8))], 32)


