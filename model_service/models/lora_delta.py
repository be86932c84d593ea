"""LoRA deltas added to a projection's output, batched per run of rows of one adapter.

A step's rows (decode sequences first, then prefill chunks) are grouped into runs of
consecutive rows whose sequences use the same adapter; each run's delta is one shrink
(x · Aᵀ, [n, r]) and one expand (· Bᵀ, [n, out]) added in place into the base projection's
output: the segmented product of Punica's SGMV, with the base weights never merged, so rows
of different adapters and of the base share the one base matmul. Rows of the base model
belong to no run and cost nothing here.

The fused projections (qkv_proj, gate_up_proj) take each target's delta into its columns
(`column` is where they start). On CPU, float32 and bfloat16 runs go to the C kernels of
cpu_kernels/lora_sgmv.py (shrink and expand in one call, PAGEDKV_LORA_KERNELS), all of a
step's runs for a projection's targets in one call (cpu_kernels/lora_runs.py: the call the
decode stack makes too). On CUDA all of a step's runs go to the Triton kernels of
lora_triton.py, one shrink and one expand launch a projection, over the step's tables of
factor addresses (lora_tables.py), where triton imports and the factors are on the device
in the activations' dtype. These matmuls are the kernels' reference and serve everything
else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import structlog
import torch

from model_service.cpu_kernels import lora_runs, lora_sgmv
from model_service.models.lora_tables import StepTables

log = structlog.get_logger()

_triton: ModuleType | None = None
_triton_error: Exception | None = None


def load_triton() -> ModuleType | None:
    """lora_triton, or None where triton does not import (imported on first use: see
    attention/backend.py's load_triton_kernels for why)."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            from model_service.models import lora_triton
        except Exception as error:  # ImportError, or triton failing to find a backend
            _triton_error = error
            log.warning("LoRA on CUDA runs torch's matmuls: triton does not import", error=repr(error))
        else:
            _triton = lora_triton
    return _triton


class Factors(Protocol):
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


class Adapter(Protocol):
    scaling: float
    weights: dict[tuple[int, str], Factors]


@dataclass(frozen=True, slots=True)
class LoraRun:
    start: int  # first row
    end: int  # one past the last
    adapter: Adapter


@dataclass(frozen=True, slots=True)
class LoraStep:
    """The runs of one step; a step without adapter rows has none and is passed as None."""

    runs: tuple[LoraRun, ...]
    # device -> StepTables (None: torch's matmuls serve), built at the first projection there.
    _tables: dict[torch.device, StepTables | None] = field(default_factory=dict, compare=False, repr=False)
    # ("cpu", dtype) -> the runs described for lora_runs.c (None: some adapter's factors it cannot take)
    _described: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of_sequences(cls, query_lens: Sequence[int], adapters: Sequence[Adapter | None]) -> LoraStep | None:
        """Runs over the step's rows from each sequence's new-token count and adapter (None:
        the base); neighbouring sequences of one adapter share a run."""
        runs: list[LoraRun] = []
        row = 0
        for query_len, adapter in zip(query_lens, adapters, strict=True):
            if adapter is not None:
                if runs and runs[-1].adapter is adapter and runs[-1].end == row:
                    runs[-1] = LoraRun(runs[-1].start, row + query_len, adapter)
                else:
                    runs.append(LoraRun(row, row + query_len, adapter))
            row += query_len
        return cls(tuple(runs)) if runs else None

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str, column: int = 0) -> None:
        """out[run rows, column:column + out_features] += scaling · (x[run rows] · Aᵀ) · Bᵀ
        for every run whose adapter trains `target` on `layer`."""
        self.add_targets(out, x, layer, ((target, column),))

    def add_targets(self, out: torch.Tensor, x: torch.Tensor, layer: int,
                    targets: Sequence[tuple[str, int]]) -> None:
        """`add` for each (target, column) of a fused projection's (q, k and v into qkv; gate
        and up): they read the same x and write apart, so on CPU the C kernel takes all of
        them, for every run, in one call."""
        if out.device.type == "cuda":
            tables = self.triton_tables(out.device)
            if tables is not None and tables.supports(out, x):
                for target, column in targets:
                    load_triton().add(tables, out, x, layer, target, column)
                return
        level = lora_sgmv.chosen_level() if out.device.type == "cpu" else None
        if level is not None and lora_runs.supports(out, x):
            described = self.cpu_runs(x.dtype)
            if described is not None:
                lora_runs.add(described, out, x, layer, targets, level)
                return
        for target, column in targets:
            self._add_run_by_run(out, x, layer, target, column, level)

    def _add_run_by_run(self, out: torch.Tensor, x: torch.Tensor, layer: int, target: str, column: int,
                        level: int | None) -> None:
        for run in self.runs:
            factors = run.adapter.weights.get((layer, target))
            if factors is None:
                continue
            rows = out[run.start:run.end, column:column + factors.b.shape[0]]
            if level is not None and lora_sgmv.supports(rows, x, factors.a, factors.b):
                lora_sgmv.shrink_expand(rows, x[run.start:run.end], factors.a, factors.b, run.adapter.scaling, level)
                continue
            shrunk = x[run.start:run.end] @ factors.a.t()  # [n, r]
            shrunk.mul_(run.adapter.scaling)
            rows.addmm_(shrunk, factors.b.t())

    def cpu_runs(self, dtype: torch.dtype):
        """The runs described for lora_runs.c in `dtype` (built once a step), or None where
        some adapter's factors are not ones it takes (run by run then)."""
        key = ("cpu", dtype)
        if key not in self._described:
            self._described[key] = lora_runs.describe(self.runs, dtype)
        return self._described[key]

    def triton_tables(self, device: torch.device) -> StepTables | None:
        """The step's tables for lora_triton on `device`, or None where torch's matmuls serve."""
        if device not in self._tables:
            self._tables[device] = StepTables.of_runs(self.runs, device) if load_triton() is not None else None
        return self._tables[device]
