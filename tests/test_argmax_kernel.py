"""The C argmax (cpu_kernels/argmax.py) against torch.argmax: first index of the maximum,
NaN largest (the first NaN), in float32, bfloat16 and float16, at widths around the
16-lane chunks and the vocabulary sizes of real models, rows apart, and many rows (the
threaded path)."""

from __future__ import annotations

import pytest
import torch

from model_service import cpu_kernels
from model_service.cpu_kernels.argmax import argmax_rows

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build here")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(logits: torch.Tensor) -> None:
    got = argmax_rows(cpu_kernels.load(), logits)
    assert got.dtype == torch.int64
    expected = logits.float().argmax(dim=-1)  # float32 holds every 16-bit value exactly
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 2, 15, 16, 17, 31, 32, 33, 100, 32000, 49152])
def test_random_rows(dtype, cols):
    generator = torch.Generator().manual_seed(cols)
    check((torch.randn(7, cols, generator=generator) * 4).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_index_in_any_lane(dtype):
    cols = 70  # four full chunks of 16 and a tail of 6
    logits = torch.zeros(8, cols)
    logits[1] = 3.0  # all tied: 0
    logits[2, [5, 21, 37]] = 9.0  # same lane of three chunks: the first chunk's
    logits[3, [20, 5]] = 9.0  # two lanes: the smaller index, wherever it lies
    logits[4, [66, 69]] = 9.0  # both in the tail
    logits[5, [64, 3]] = 9.0  # tail and a chunk: the chunk's, the smaller
    logits[6] = float("-inf")  # every value -inf: 0
    logits[7, 45] = float("inf")
    check(logits.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_is_largest_and_the_first_nan_wins(dtype):
    cols = 40
    logits = torch.randn(6, cols) * 10
    logits[0, 17] = float("nan")
    logits[1, [33, 2]] = float("nan")  # the earlier one
    logits[2, 38] = float("nan")  # only in the tail
    logits[2, 3] = float("inf")  # NaN beats inf
    logits[3] = float("nan")  # all NaN: 0
    logits[4, [39, 35]] = float("nan")  # two in the tail
    logits[5, [18, 2]] = float("nan")  # lanes 2 of chunks 1 and 0
    check(logits.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_apart_and_many_rows(dtype):
    wide = (torch.randn(64, 3000) * 3).to(dtype)
    check(wide[:, 100:2100])  # rows 3000 elements apart, 2000 read
    check((torch.randn(300, 1000) * 3).to(dtype))  # 300,000 values: split over threads
