"""Background threads at a lower CPU priority than the threads that answer calls.

Linux keeps a nice value per thread (and a thread starts with its creator's), so a
worker that lowers its own gives way, on a busy machine, to the event loop and the
engine of the same process; where that is not possible the work runs as before.
"""

from __future__ import annotations

import os
import threading


def lower_this_thread(niceness: int) -> None:
    """Raises the calling thread's nice value by ``niceness`` (and that of any thread it starts)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + niceness)
    except (OSError, AttributeError):
        pass  # not Linux, or not allowed: the work runs at the service's priority


def idle_threads(tids: list[int]) -> int:
    """Moves these threads of this process to SCHED_IDLE: they run only on a core that
    nothing else wants (a nice value still takes a share from the threads beside it), and
    a thread they start afterwards inherits it. For work nobody waits for any more.
    Returns how many were moved."""
    moved = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved += 1
        except (OSError, AttributeError):  # ended meanwhile, or not Linux
            continue
    return moved
