"""Start-up's objects kept out of the garbage collector's full collections.

A service's start-up leaves hundreds of thousands of objects the collector tracks (torch's,
transformers' and grpc's modules and tables, the model's modules, the tokenizer's) that live
as long as the process. Every full collection walks all of them with the GIL held, a stall of
every stream in the process that lands in its inter-token latency, and its length grows with
them. `gc.freeze()` moves them to a generation no collection walks; the objects requests
make are collected as before.

The price: an object frozen here that later becomes part of an unreachable cycle stays in
memory. Start-up's objects are the process's for its life, so that leak is bounded by what
start-up built.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger()


def freeze_startup_objects() -> int:
    """Collects once, then freezes every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("startup_objects_frozen", objects=frozen)
    return frozen
