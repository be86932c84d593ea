"""Turns that start on a quiet machine: before an engine's turn, wait until the processes
that are not taking it have stopped computing.

An engine that has just finished its turn may keep computing for a while: OpenMP worker
threads spin before they sleep (vLLM's CPU worker among them), a server drains its
streams. On two cores that tail takes CPU from the engine whose turn comes next, so the
order of the turns, not the engines, would decide part of a ratio. `settle()` polls the
CPU time of every process this one started (the peers' and pagedkv's services alike)
until a short window passes with almost none, and says how long it waited.
"""

from __future__ import annotations

import os
import time

from harness.cpu_use import tree_seconds

# The quiet window: this long with the children's CPU under IDLE_SHARE of a core (Linux
# counts CPU time in ticks of 10 ms, so the window holds a few).
WINDOW_S = 0.2
IDLE_SHARE = 0.1
LIMIT_S = 10.0  # a peer that never goes quiet (a busy-polling server) is waited for this long at most


def settle(*, limit_s: float = LIMIT_S) -> float:
    """Waits until this process's children have been idle for WINDOW_S (or limit_s has
    passed); returns the seconds it waited."""
    started = time.perf_counter()
    before = tree_seconds(os.getpid(), with_root=False)
    while True:
        time.sleep(WINDOW_S)
        now = tree_seconds(os.getpid(), with_root=False)
        waited = time.perf_counter() - started
        if now - before < IDLE_SHARE * WINDOW_S or waited >= limit_s:
            return waited
        before = now
