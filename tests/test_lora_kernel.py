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
