"""Where the Triton LoRA kernels (lora_triton.py) find a step's adapters: each run's factor
addresses, ranks and widths, and the runs' rows and scalings, as small int64 tables on the
device.

Each adapter's table ([layers, targets, 3]: A's address, B's address, rank; zeros for a
projection it leaves out) is built once per adapter and device, checked then (every factor
contiguous, on the device, in one dtype), and dropped when the adapter is (weakref.finalize:
an adapter that takes no weak reference is tabled again each step). A step stacks its runs'
tables, so its cost does not grow with layers x targets in Python, and copies them to the
device from pinned memory (three small copies a step, none a projection).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from model_service.lora.peft_adapter import TARGETS

TARGET_INDEX = {target: index for index, target in enumerate(TARGETS)}


class Run(Protocol):
    start: int
    end: int
    adapter: object  # .scaling, .weights: {(layer, target): factors with a [rank, in], b [out, rank]}


@dataclass(frozen=True, slots=True)
class AdapterTable:
    factors: torch.Tensor  # int64 [layers, targets, 3]: A's address, B's address, rank (0: none)
    features: torch.Tensor  # int64 [layers, targets, 2]: in_features, out_features
    dtype: torch.dtype | None  # None: no factors at all


# (id(adapter), device) -> its table, or None where the kernels cannot read its factors.
_TABLES: dict[tuple[int, torch.device], AdapterTable | None] = {}


def adapter_table(adapter: object, device: torch.device) -> AdapterTable | None:
    key = (id(adapter), device)
    if key in _TABLES:
        return _TABLES[key]
    table = _build(adapter, device)
    try:
        weakref.finalize(adapter, _TABLES.pop, key, None)
    except TypeError:  # no weak reference to it: nothing would drop the entry, so keep none
        return table
    _TABLES[key] = table
    return table


def _build(adapter: object, device: torch.device) -> AdapterTable | None:
    weights = adapter.weights
    layers = max((layer for layer, _ in weights), default=-1) + 1
    factors = [[[0, 0, 0] for _ in TARGETS] for _ in range(layers)]
    features = [[[0, 0] for _ in TARGETS] for _ in range(layers)]
    dtypes = {f.a.dtype for f in weights.values()} | {f.b.dtype for f in weights.values()}
    if len(dtypes) > 1:
        return None
    for (layer, target), f in weights.items():
        if (target not in TARGET_INDEX or f.a.device != device or f.b.device != device
                or not (f.a.is_contiguous() and f.b.is_contiguous())):
            return None
        factors[layer][TARGET_INDEX[target]] = [f.a.data_ptr(), f.b.data_ptr(), f.a.shape[0]]
        features[layer][TARGET_INDEX[target]] = [f.a.shape[1], f.b.shape[0]]
    return AdapterTable(torch.tensor(factors, dtype=torch.int64).view(layers, len(TARGETS), 3),
                        torch.tensor(features, dtype=torch.int64).view(layers, len(TARGETS), 2),
                        dtypes.pop() if dtypes else None)


@dataclass(frozen=True, slots=True)
class Projection:
    """One (layer, target)'s factors over a step's runs."""

    factors: torch.Tensor  # int64 [runs, 3] on the device: A's address, B's address, rank (0: none)
    max_rank: int
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class StepTables:
    """A step's runs and every (layer, target)'s factor table, on the device."""

    bounds: torch.Tensor  # int32 [runs, 2]: first row, one past the last
    scaling: torch.Tensor  # float32 [runs]
    factors: torch.Tensor  # int64 [layers, targets, runs, 3]
    max_ranks: list[list[int]]  # [layers][targets]: the largest of the runs' ranks, 0: none trains it
    features: list[list[list[int]]]  # [layers][targets]: in_features, out_features
    longest: int  # rows of the longest run
    dtype: torch.dtype | None

    @classmethod
    def of_runs(cls, runs: Sequence[Run], device: torch.device) -> StepTables | None:
        """None when some adapter's factors are not where the kernels can read them (another
        device, not contiguous) or the adapters differ in dtype: torch's matmuls serve."""
        tables = [adapter_table(run.adapter, device) for run in runs]
        if not tables or any(table is None for table in tables):
            return None
        dtypes = {table.dtype for table in tables} - {None}
        if len(dtypes) > 1:
            return None
        layers = max(table.factors.shape[0] for table in tables)
        factors = torch.stack([F.pad(t.factors, (0, 0, 0, 0, 0, layers - t.factors.shape[0])) for t in tables])
        features = torch.stack([F.pad(t.features, (0, 0, 0, 0, 0, layers - t.features.shape[0])) for t in tables])
        bounds = torch.tensor([(run.start, run.end) for run in runs], dtype=torch.int32)
        scaling = torch.tensor([run.adapter.scaling for run in runs], dtype=torch.float32)
        return cls(_to_device(bounds, device), _to_device(scaling, device),
                   _to_device(factors.permute(1, 2, 0, 3).contiguous(), device),
                   factors[..., 2].amax(0).tolist(), features.amax(0).tolist(),
                   max(run.end - run.start for run in runs), dtypes.pop() if dtypes else None)

    def projection(self, layer: int, target: str) -> Projection | None:
        """None where no run's adapter trains it."""
        index = TARGET_INDEX.get(target)
        if index is None or layer >= len(self.max_ranks) or self.max_ranks[layer][index] == 0:
            return None
        return Projection(self.factors[layer, index], self.max_ranks[layer][index], *self.features[layer][index])

    def supports(self, out: torch.Tensor, x: torch.Tensor) -> bool:
        return out.dtype == x.dtype == self.dtype and out.stride(-1) == 1 and x.stride(-1) == 1


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned, so the copy does not wait for the stream's queued work.
    if device.type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)
