"""A step's LoRA runs described for csrc/lora_runs.c, which adds all of them for one
projection's targets in one call: the per-layer path (models/lora_delta.py) and the decode
stack (models/cpu_decode_stack.py, whose C side calls lora_runs.c itself) describe them
here alike, so both paths give the same bits.

Each adapter's table of factors (lora_runs.h's lora_factor, [layers][targets]) is built at
its first step in a dtype and kept while the adapter lives. A step's runs are listed with
the runs of one adapter next to each other (lora_runs.c shares the work out by adapter and
target, each adapter's factors fetched once); the order of the rows' deltas does not
change what any row gets.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import weakref
from collections.abc import Sequence

import torch

from model_service.cpu_kernels import lora_sgmv
from model_service.cpu_kernels.build import DTYPE_CODES, load
from model_service.lora.peft_adapter import TARGETS

TARGET_INDEX = {target: index for index, target in enumerate(TARGETS)}  # lora_runs.h's LORA_Q...


class Factor(ctypes.Structure):  # lora_runs.h's lora_factor
    _fields_ = [("a", ctypes.c_int64), ("b", ctypes.c_int64), ("rank", ctypes.c_int32),
                ("out_features", ctypes.c_int32)]


class Run(ctypes.Structure):  # lora_runs.h's lora_run
    _fields_ = [("start", ctypes.c_int32), ("end", ctypes.c_int32), ("scaling", ctypes.c_float),
                ("layers", ctypes.c_int32), ("factors", ctypes.POINTER(Factor))]


# (id(adapter), dtype) -> (a weak reference to it, its table or None)
_TABLES: dict[tuple[int, torch.dtype], tuple[weakref.ref | None, ctypes.Array | None]] = {}


def _build(adapter, dtype: torch.dtype) -> ctypes.Array | None:
    """The adapter's factors by (layer, target), or None where the C kernel cannot take them
    (not in `dtype`, not contiguous, not on CPU)."""
    layers = max((layer for layer, _ in adapter.weights), default=-1) + 1
    table = (Factor * (layers * len(TARGETS)))()
    for (layer, target), factors in adapter.weights.items():
        a, b = factors.a, factors.b
        if not (a.dtype == b.dtype == dtype and a.device.type == b.device.type == "cpu"
                and a.is_contiguous() and b.is_contiguous()) or target not in TARGET_INDEX:
            return None
        table[layer * len(TARGETS) + TARGET_INDEX[target]] = Factor(a.data_ptr(), b.data_ptr(), a.shape[0],
                                                                    b.shape[0])
    return table


def adapter_table(adapter, dtype: torch.dtype) -> ctypes.Array | None:
    key = (id(adapter), dtype)
    known = _TABLES.get(key)
    if known is not None and known[0] is not None and known[0]() is adapter:
        return known[1]
    for stale in [k for k, (ref, _) in _TABLES.items() if ref is None or ref() is None]:
        del _TABLES[stale]
    table = _build(adapter, dtype)
    try:
        _TABLES[key] = (weakref.ref(adapter), table)
    except TypeError:  # no weak reference to it: nothing could tell when it is gone, so keep none
        pass
    return table


# Run's fields as lora_runs.h lays them out (no padding: the pointer falls on 8 bytes), so a
# step's runs are packed into one buffer, where a Run built a field at a time each, its
# table converted to a pointer, cost a step more than the rest of describe.
_PACKED_RUN = struct.Struct("=iifiq")
assert ctypes.sizeof(Run) == _PACKED_RUN.size and Run.factors.offset == 16


def describe(runs: Sequence, dtype: torch.dtype) -> ctypes.Array | None:
    """The runs (start, end, adapter with .scaling and .weights), one adapter's next to each
    other, or None where some adapter's factors are not ones the C kernel takes."""
    by_adapter: dict[int, tuple[ctypes.Array, list]] = {}  # in the order adapters first appear
    for run in runs:
        listed = by_adapter.get(id(run.adapter))
        if listed is None:
            table = adapter_table(run.adapter, dtype)
            if table is None:
                return None
            listed = by_adapter[id(run.adapter)] = (table, [])
        listed[1].append(run)
    pack = _PACKED_RUN.pack
    packed = b"".join(pack(run.start, run.end, run.adapter.scaling, len(table) // len(TARGETS),
                           ctypes.addressof(table))
                      for table, listed in by_adapter.values() for run in listed)
    described = (Run * len(runs)).from_buffer_copy(packed)
    described.tables = [table for table, _ in by_adapter.values()]  # what its pointers point at, kept alive
    return described


@functools.lru_cache(maxsize=64)
def _targets(targets: tuple[tuple[str, int], ...]) -> tuple[ctypes.Array, ctypes.Array]:
    """The targets' indices and columns as lora_add_runs takes them: a model asks the same few
    every step, so each is built once."""
    return ((ctypes.c_int * len(targets))(*(TARGET_INDEX[target] for target, _ in targets)),
            (ctypes.c_int * len(targets))(*(column for _, column in targets)))


def supports(out: torch.Tensor, x: torch.Tensor) -> bool:
    """CPU tensors of one of the kernel's dtypes, rows of x and out contiguous."""
    return (out.device.type == x.device.type == "cpu" and out.dtype in lora_sgmv.DTYPES and out.dtype == x.dtype
            and x.stride(-1) == 1 and out.stride(-1) == 1)


def add(described: ctypes.Array, out: torch.Tensor, x: torch.Tensor, layer: int,
        targets: Sequence[tuple[str, int]], level: int) -> None:
    """out[run rows, column:column + out_features] += each run's delta for every (target,
    column) of `targets` its adapter trains on `layer`. Checked by `supports` first."""
    count = len(targets)
    indices, columns = _targets(tuple(targets))
    status = load().lora_add_runs(described, len(described), layer, count, indices, columns, x.data_ptr(),
                                  x.stride(0), x.shape[1], out.data_ptr(), out.stride(0), DTYPE_CODES[x.dtype],
                                  level, torch.get_num_threads())
    if status == 3:
        raise MemoryError("lora_add_runs could not allocate its scratch")
    if status != 0:
        raise ValueError(f"lora_add_runs refused ({status}) at level {lora_sgmv.LEVELS[level]}")
