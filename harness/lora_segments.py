"""Random batches of LoRA segments and their float64 reference, for the Triton segmented
product (model_service/models/lora_triton.py): tests/test_lora_triton.py under the
interpreter and on CUDA, and checks/gpu_check.py's kernels check.

A batch is rows of a step: runs of rows of one adapter each (some empty, some of an adapter
that leaves the projection out) with rows of the base between them, x wider than its rows
(a stride that is not its width), and a fused projection's output of which the projection
takes a column slice. The reference shares no code with the kernel: float64 matmuls over
the same values, row by row.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KEY = (3, "v_proj")
OTHER_KEY = (3, "q_proj")  # what an adapter "without the projection" trains instead
# Relative rounding of one result to each dtype; the interpreter's float32 -> bfloat16 cast
# truncates, so the bound allows a whole unit in the last place (twice the unit roundoff).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
FLOAT32_ROUNDOFF = 2.0 ** -24


@dataclass
class Adapter:
    """What LoraStep reads of an adapter (a dataclass, not a namespace: it takes weak
    references, so lora_tables keeps its table, as it does a loaded LoraAdapter's)."""

    scaling: float
    weights: dict


@dataclass
class SegmentBatch:
    x: torch.Tensor  # [rows, in_features], a column slice of a wider tensor
    out: torch.Tensor  # [rows, column + out_features + 5]: the fused output, before the delta
    column: int
    runs: list  # start, end, adapter (scaling, weights {key: a, b})

    @property
    def out_features(self) -> int:
        return next(run.adapter.weights[KEY].b.shape[0] for run in self.runs if KEY in run.adapter.weights)

    def covered(self) -> torch.Tensor:
        """Rows some run of an adapter with KEY covers (the rest must stay as they were)."""
        mask = torch.zeros(self.out.shape[0], dtype=torch.bool)
        for run in self.runs:
            if KEY in run.adapter.weights:
                mask[run.start:run.end] = True
        return mask


def random_batch(segments: Sequence[tuple[int, int | None]], in_features: int, out_features: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0) -> SegmentBatch:
    """segments: (rows, rank) in row order; rank None: rows of the base (no run); rank 0: a
    run of an adapter that trains only OTHER_KEY. Each run has an adapter of its own."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    runs, row = [], 0
    for rows, rank in segments:
        if rank is not None:
            key, shape = (KEY, (out_features, in_features)) if rank else (OTHER_KEY, (7, in_features))
            rank = rank or 4
            # A's rows of norm about 1, so a shrunk value is about x's size whatever in_features.
            factors = types.SimpleNamespace(a=randn(rank, shape[1], scale=shape[1] ** -0.5), b=randn(shape[0], rank))
            adapter = Adapter(float(torch.rand((), generator=generator)) * 4 + 0.1, {key: factors})
            runs.append(types.SimpleNamespace(start=row, end=row + rows, adapter=adapter))
        row += rows
    column = 3
    x = randn(row, in_features + 9)[:, 4:4 + in_features]
    out = randn(row, column + out_features + 5)
    return SegmentBatch(x, out, column, runs)


def reference(batch: SegmentBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, magnitude): the output with every run's delta added, in float64, and the
    same sum over absolute values (what float32 accumulation errors scale with)."""
    expected = batch.out.double().clone()
    magnitude = batch.out.double().abs()
    x = batch.x.double()
    columns = slice(batch.column, batch.column + batch.out_features)
    for run in batch.runs:
        factors = run.adapter.weights.get(KEY)
        if factors is None:
            continue
        a, b = factors.a.double(), factors.b.double()
        rows = x[run.start:run.end]
        expected[run.start:run.end, columns] += run.adapter.scaling * (rows @ a.t()) @ b.t()
        magnitude[run.start:run.end, columns] += run.adapter.scaling * (rows.abs() @ a.abs().t()) @ b.abs().t()
    return expected, magnitude


def margin(got: torch.Tensor, batch: SegmentBatch) -> float:
    """Largest |got - expected| over its bound; <= 1 passes. The bound: a unit in the last
    place of the output's dtype, plus float32 accumulation over in_features + rank terms
    (each step's rounding at most FLOAT32_ROUNDOFF of the running sum of magnitudes)."""
    expected, magnitude = reference(batch)
    ranks = [run.adapter.weights[KEY].a.shape[0] for run in batch.runs if KEY in run.adapter.weights]
    terms = batch.x.shape[1] + max(ranks, default=0) + 2
    bound = 2 * UNIT_ROUNDOFF[got.dtype] * expected.abs() + terms * FLOAT32_ROUNDOFF * magnitude
    bound = bound.clamp_min(torch.finfo(torch.float64).tiny)
    return float(((got.double() - expected).abs() / bound).max())


# Batches for CUDA (tests/test_lora_triton.py, checks/gpu_check.py): a decode step of 8
# adapters (ranks powers of two and not) and base rows, then the same with prefill runs (long
# ones, an empty one, an adapter without the projection, a rank over one rank block).
DECODE_SEGMENTS = [(1, rank) for rank in (8, 16, 64, 1, 33, 8, 16, 64)] + [(3, None)]
PREFILL_SEGMENTS = DECODE_SEGMENTS + [(37, 16), (5, None), (300, 64), (0, 8), (64, 0), (9, 80)]
# (in_features, out_features): a Llama MLP's and attention's widths, of a 1-2B model.
DEVICE_SHAPES = [(2048, 1408), (4096, 512)]


def through_lora_step(segments: Sequence[tuple[int, int | None]], in_features: int, out_features: int,
                      dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> tuple[float, bool, bool]:
    """One random batch's delta added by LoraStep.add as the model calls it: (margin, rows
    outside the runs untouched bit for bit, served by the Triton kernels)."""
    from model_service.models.lora_delta import LoraStep

    batch = random_batch(segments, in_features, out_features, dtype, device=device, seed=seed)
    step = LoraStep(tuple(batch.runs))
    got = batch.out.clone()
    step.add(got, batch.x, *KEY, column=batch.column)
    untouched = ~batch.covered().to(got.device)
    return (margin(got, batch), torch.equal(got[untouched], batch.out[untouched]),
            step.triton_tables(got.device) is not None)
