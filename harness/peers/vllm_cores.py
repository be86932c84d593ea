"""vLLM's CPU engine on every core, and a record of the cores it actually computed on.

vLLM's CPU backend reserves one core per rank for its scheduler process and pins its
model's OpenMP threads to the others, whatever OMP_NUM_THREADS says (`reserve_cpu_num` in
vllm/utils/ompmultiprocessing.py). On a 2-core machine that leaves its model ONE core while
pagedkv computes on two: a comparison run that way measures half of vLLM.
VLLM_CPU_NUM_OF_RESERVED_CPU=0 makes it bind every core (it warns, then does), so every
bench that starts vLLM takes its environment from `environment()` here, and prints
`binding(pid)` beside its numbers so a reader can check which cores vLLM had.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.cpu_use import process_tree


def environment(threads: int, **extra: str) -> dict[str, str]:
    """os.environ for a vLLM process computing on `threads` cores, none held back."""
    return dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(threads), **extra)


def _busy_threads(pid: int) -> list[tuple[str, str, int]]:
    """(process name, thread's Cpus_allowed_list, its CPU ticks so far) for each thread."""
    rows = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        rows.append((status.get("Name", "?").strip(), status.get("Cpus_allowed_list", "?").strip(),
                     int(fields[11]) + int(fields[12])))
    return rows


def binding(pid: int) -> str:
    """Which cores the threads of `pid`'s process tree that have computed may run on, e.g.
    "VLLM::EngineCor: cpus 0, 1 (2 busy threads)": the busiest process's, and every
    affinity its busy threads have. Linux /proc only; "unknown" elsewhere."""
    per_process: dict[str, tuple[int, set[str], int]] = {}
    for member in process_tree(pid):
        threads = _busy_threads(member)
        busy = [(cpus, ticks) for _, cpus, ticks in threads if ticks > 0]
        if not threads or not busy:
            continue
        name = threads[0][0]
        ticks = sum(t for _, t in busy)
        if name not in per_process or ticks > per_process[name][0]:
            per_process[name] = (ticks, {cpus for cpus, _ in busy}, len(busy))
    if not per_process:
        return "unknown"
    name, (_, affinities, count) = max(per_process.items(), key=lambda item: item[1][0])
    return f"{name}: cpus {' | '.join(sorted(affinities))} ({count} busy threads)"


__all__ = ["binding", "environment"]
