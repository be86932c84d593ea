"""A step's LoRA runs for a projection's targets in one C call (cpu_kernels/lora_runs.py,
csrc/lora_runs.c), as the per-layer path and the decode stack make it: every row gets the
bits its run gets alone through lora_shrink_expand, whatever the order the runs are shared
out in and on any number of threads, at every level and in both dtypes the kernel takes."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from model_service.cpu_kernels import load, lora_runs, lora_sgmv
from model_service.models.lora_delta import LoraStep

from kernel_levels import level_fixture

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel library did not build (no C compiler?)")
level = level_fixture(lora_sgmv)

IN, Q, K = 40, 48, 24  # x's width, the q and k targets' outputs


class Adapter:  # takes weak references, as the registry's adapters do
    def __init__(self, seed: int, rank: int, scaling: float, targets: tuple[str, ...], dtype: torch.dtype):
        generator = torch.Generator().manual_seed(seed)
        widths = {"q_proj": Q, "k_proj": K}
        self.scaling = scaling
        self.weights = {(1, target): types.SimpleNamespace(
            a=torch.randn(rank, IN, generator=generator).to(dtype) / 4,
            b=torch.randn(widths[target], rank, generator=generator).to(dtype)) for target in targets}


def interleaved_step(dtype: torch.dtype) -> LoraStep:
    """One-row runs of three adapters in turn (a decode step's, requests round robin over
    them), the base's rows between, a run of 9 rows (b transposed) and one of 40 (the
    panels); one adapter leaves k alone."""
    adapters = [Adapter(1, 8, 2.0, ("q_proj", "k_proj"), dtype), Adapter(2, 16, 0.5, ("q_proj",), dtype),
                Adapter(3, 4, 1.0, ("q_proj", "k_proj"), dtype)]
    lens = [1] * 12 + [9, 1, 40]
    chosen = [adapters[i % 3] if i % 4 != 3 else None for i in range(12)] + [adapters[2], None, adapters[0]]
    return LoraStep.of_sequences(lens, chosen)


def one_call_against_run_by_run(step, x, base, layer, targets, dtype, level, threads):
    """`base` plus the step's deltas for `targets` at `layer`, by the one C call on `threads`
    threads, checked equal to the bit to run-by-run calls at `level`; returns the one call's."""
    run_by_run = base.clone()
    for target, column in targets:
        step._add_run_by_run(run_by_run, x, layer, target, column, level)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one_call = base.clone()
        step.add_targets(one_call, x, layer, targets)
    finally:
        torch.set_num_threads(previous)
    assert step.cpu_runs(dtype) is not None  # the one call served it
    assert torch.equal(one_call, run_by_run)
    return one_call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_call_gives_each_runs_own_bits(level, dtype, threads):
    step = interleaved_step(dtype)
    rows = step.runs[-1].end
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, IN + 5, generator=generator).to(dtype)[:, :IN]  # rows further apart than a row
    base = torch.randn(rows, Q + K + 8, generator=generator).to(dtype)
    targets = (("q_proj", 0), ("k_proj", Q))
    one_call = one_call_against_run_by_run(step, x, base, 1, targets, dtype, level, threads)
    assert not torch.equal(one_call, base)
    assert torch.equal(one_call[3], base[3]) and torch.equal(one_call[:, -8:], base[:, -8:])
    untouched = base.clone()
    step.add_targets(untouched, x, 0, targets)  # a layer no adapter trains
    assert torch.equal(untouched, base)


def test_runs_are_listed_by_adapter_and_keep_their_rows():
    step = interleaved_step(torch.float32)
    described = lora_runs.describe(step.runs, torch.float32)
    listed = [(run.start, run.end, ctypes_address(run.factors)) for run in described]
    assert sorted((start, end) for start, end, _ in listed) == [(run.start, run.end) for run in step.runs]
    tables = [table for _, _, table in listed]
    assert all(tables[i] == tables[i + 1] or tables[i] not in tables[i + 1:] for i in range(len(tables) - 1))


def ctypes_address(pointer) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value


class WideAdapter:  # q and k of other widths than Adapter's, on layer 0
    def __init__(self, seed: int, rank: int, in_features: int, dtype: torch.dtype):
        generator = torch.Generator().manual_seed(seed)
        self.scaling = 0.75
        self.weights = {(0, target): types.SimpleNamespace(
            a=torch.randn(rank, in_features, generator=generator).to(dtype) / 4,
            b=torch.randn(out, rank, generator=generator).to(dtype)) for target, out in (("q_proj", 40), ("k_proj", 32))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("in_features", [45, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_adapters_short_runs_taken_together_keep_their_bits(level, dtype, in_features, threads):
    """Ranks of whole sixteens (16, 32) whose short runs lora_runs.c takes together, a rank
    it does not (8); x's width with and without a tail past its sixteens, q's outputs with
    one past theirs; runs of one, three and nine rows."""
    adapters = [WideAdapter(seed, rank, in_features, dtype) for seed, rank in ((4, 16), (5, 32), (6, 8))]
    lens = [1] * 18 + [3, 9, 1]
    chosen = [adapters[i % 3] for i in range(18)] + [adapters[1], adapters[1], None]
    step = LoraStep.of_sequences(lens, chosen)
    rows = sum(lens)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    base = torch.randn(rows, 40 + 32, generator=generator).to(dtype)
    targets = (("q_proj", 0), ("k_proj", 40))
    one_call = one_call_against_run_by_run(step, x, base, 0, targets, dtype, level, threads)
    assert torch.equal(one_call[-1], base[-1]) and not torch.equal(one_call[:-1], base[:-1])
