"""The C kernel of LoRA's segmented product (model_service/cpu_kernels/lora_sgmv.py) at every
level this CPU runs: the same delta as torch's shrink and expand into a column slice of a
fused projection's output, for ranks and widths that do and do not fill a vector, and a
LoraStep of several runs the same through either path."""

from __future__ import annotations

import types

import pytest
import torch

from model_service.cpu_kernels import load, lora_sgmv
from model_service.models.lora_delta import LoraStep

from kernel_levels import level_fixture

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel library did not build (no C compiler?)")
level = level_fixture(lora_sgmv)


def reference(out, x, a, b, scaling):
    return out + scaling * (x.double() @ a.double().t() @ b.double().t()).float()


@pytest.mark.parametrize(("rows", "in_features", "rank", "out_features"),
                         [(1, 64, 8, 64), (5, 67, 7, 33), (3, 256, 64, 172), (2, 17, 1, 5), (4, 40, 16, 16),
                          (2, 100, 24, 40),  # whole sixteens of outputs, a rank tail of eight
                          # from lora_sgmv.c's LORA_TRANSPOSE_ROWS on, the expand runs over b transposed
                          (8, 67, 7, 33), (27, 256, 64, 172), (19, 40, 16, 17),
                          # from LORA_PANEL_ROWS on (AVX2 and up), through f32_matmul.c's panels
                          (64, 67, 7, 33), (130, 256, 64, 172), (75, 40, 16, 17)])
def test_each_level_gives_torchs_delta(level, rows, in_features, rank, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + rank)
    x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]  # rows further apart than a row
    a = torch.randn(rank, in_features, generator=generator)
    b = torch.randn(out_features, rank, generator=generator)
    fused = torch.randn(rows, out_features + 20, generator=generator)
    expected = fused.clone()
    expected[:, 10:10 + out_features] = reference(fused[:, 10:10 + out_features], x, a, b, 0.5)
    target = fused[:, 10:10 + out_features]
    assert lora_sgmv.supports(target, x, a, b)
    lora_sgmv.shrink_expand(target, x, a, b, 0.5, level)
    torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(fused[:, :10], expected[:, :10]) and torch.equal(fused[:, -10:], expected[:, -10:])


def test_a_rank_past_the_ceiling_is_refused(level):
    x, a, b = torch.zeros(1, 8), torch.zeros(513, 8), torch.zeros(8, 513)
    with pytest.raises(ValueError, match="rank 513"):
        lora_sgmv.shrink_expand(torch.zeros(1, 8), x, a, b, 1.0, level)


def adapter(seed: int, rank: int, scaling: float):
    generator = torch.Generator().manual_seed(seed)
    factors = types.SimpleNamespace(a=torch.randn(rank, 32, generator=generator),
                                    b=torch.randn(48, rank, generator=generator))
    return types.SimpleNamespace(scaling=scaling, weights={(0, "q_proj"): factors})


def test_a_step_of_several_runs_is_the_same_through_the_kernel_and_torch(level, monkeypatch):
    one, two = adapter(1, 8, 2.0), adapter(2, 4, 0.25)
    step = LoraStep.of_sequences([3, 1, 2, 4], [one, None, two, one])
    x = torch.randn(10, 32)
    base = torch.randn(10, 64)
    through_kernel = base.clone()
    step.add(through_kernel, x, 0, "q_proj", column=16)
    monkeypatch.setenv(lora_sgmv.ENV, "torch")
    through_torch = base.clone()
    step.add(through_torch, x, 0, "q_proj", column=16)
    torch.testing.assert_close(through_kernel, through_torch, rtol=1e-4, atol=1e-4)
    assert torch.equal(through_kernel[3], base[3])  # the base model's row
    assert not torch.equal(through_kernel, base)


# bfloat16 (csrc/lora_sgmv_bf16.c): x, the factors and out in bfloat16, the delta summed in
# float32 and rounded once where it is added. So each output is the exact value (float64
# over the same bfloat16 inputs) rounded to bfloat16, but where float32's summing error
# moves the sum across a rounding boundary: there, off by that error (BF16_ATOL at these
# magnitudes) and the final rounding (half a bfloat16 ulp, at most 2^-8 of the value), and
# only there (a handful of outputs in ten thousand; BF16_OFF_BY_ONE bounds the share).
BF16_RTOL, BF16_ATOL, BF16_OFF_BY_ONE = 2 ** -8, 1e-4, 0.005


def bf16_ulps_apart(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values lie between x and y (their bits as integers in value order)."""
    def ordered(t):
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(x) - ordered(y)).abs()
BF16_SHAPES = [(1, 64, 8, 64), (5, 67, 7, 33), (3, 256, 64, 172), (2, 17, 1, 5), (4, 40, 16, 16),
               (6, 256, 16, 688), (1, 100, 24, 40),
               (8, 67, 7, 33), (27, 256, 64, 172), (19, 40, 16, 17), (12, 256, 8, 130),
               (64, 67, 7, 33), (130, 256, 64, 172), (75, 40, 16, 17), (32, 256, 8, 688)]


@pytest.mark.parametrize(("rows", "in_features", "rank", "out_features"), BF16_SHAPES)
def test_each_level_gives_the_exact_bf16_delta_rounded_once(level, rows, in_features, rank, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + rank)
    x = torch.randn(rows, in_features + 3, generator=generator).bfloat16()[:, :in_features]
    a = (torch.randn(rank, in_features, generator=generator) / in_features ** 0.5).bfloat16()
    b = torch.randn(out_features, rank, generator=generator).bfloat16()
    fused = torch.randn(rows, out_features + 20, generator=generator).bfloat16()
    exact = fused[:, 10:10 + out_features].double() + 0.5 * (x.double() @ a.double().t() @ b.double().t())
    before = fused.clone()
    target = fused[:, 10:10 + out_features]
    assert lora_sgmv.supports(target, x, a, b)
    lora_sgmv.shrink_expand(target, x, a, b, 0.5, level)
    torch.testing.assert_close(target.double(), exact, rtol=BF16_RTOL, atol=BF16_ATOL)
    assert float((bf16_ulps_apart(target, exact.bfloat16()) > 0).float().mean()) <= BF16_OFF_BY_ONE
    assert torch.equal(fused[:, :10], before[:, :10]) and torch.equal(fused[:, -10:], before[:, -10:])


def test_bf16_rounds_to_nearest_even_once(level):
    """A delta that lands exactly halfway between two bfloat16 values goes to the even one,
    and one a hair past halfway goes up."""
    out = torch.tensor([[1.0, 1.0, 1.0 + 2 ** -7]], dtype=torch.bfloat16)
    x, a = torch.ones(1, 1, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.bfloat16)
    b = torch.tensor([[2 ** -8], [2 ** -8 + 2 ** -15], [2 ** -8]], dtype=torch.bfloat16)
    lora_sgmv.shrink_expand(out, x, a, b, 1.0, level)
    assert out.float().tolist() == [[1.0, 1.0 + 2 ** -7, 1.0 + 2 ** -6]]


def test_mixed_or_float16_tensors_are_left_to_torch():
    x, a, b = torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8), torch.zeros(8, 4)
    assert not lora_sgmv.supports(torch.zeros(1, 8, dtype=torch.bfloat16), x, a, b)
    half = [t.half() for t in (torch.zeros(1, 8), torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(8, 4))]
    assert not lora_sgmv.supports(*half)


def test_a_bf16_step_of_several_runs_is_the_exact_delta_through_the_kernel_and_near_it_through_torch(level, monkeypatch):
    """Every run through the kernel holds to the exact delta as one call does; torch's
    bfloat16 matmuls round the shrunk values to bfloat16 besides (2^-9 of each, so up to
    rank x 2^-9 x |shrunk| x |b| x scaling more), which the looser bound allows."""
    one, two = adapter(1, 8, 2.0), adapter(2, 4, 0.25)
    for each in (one, two):
        for factors in each.weights.values():
            factors.a, factors.b = (factors.a / 32 ** 0.5).bfloat16(), factors.b.bfloat16()
    step = LoraStep.of_sequences([3, 1, 2, 4], [one, None, two, one])
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(10, 32, generator=generator).bfloat16()
    base = torch.randn(10, 64, generator=generator).bfloat16()
    exact = base.double()
    for run in step.runs:
        factors = run.adapter.weights[(0, "q_proj")]
        exact[run.start:run.end, 16:64] += run.adapter.scaling * (
            x[run.start:run.end].double() @ factors.a.double().t() @ factors.b.double().t())
    through_kernel = base.clone()
    step.add(through_kernel, x, 0, "q_proj", column=16)
    torch.testing.assert_close(through_kernel.double(), exact, rtol=BF16_RTOL, atol=BF16_ATOL)
    monkeypatch.setenv(lora_sgmv.ENV, "torch")
    through_torch = base.clone()
    step.add(through_torch, x, 0, "q_proj", column=16)
    torch.testing.assert_close(through_torch.double(), exact, rtol=2 ** -7, atol=0.1)
    assert torch.equal(through_kernel[3], base[3])
    assert not torch.equal(through_kernel, base)
