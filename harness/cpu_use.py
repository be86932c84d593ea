"""CPU seconds of processes, and of a process's threads by name, from Linux /proc: what a
soak reports beside its latencies, so that the server's share of a gap can be told from
the clients'."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _stat_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, its threads' (live and ended) included."""
    return _stat_seconds(Path(f"/proc/{pid}/stat").read_text())


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, live now."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending += [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
    return tree


def tree_seconds(pid: int, *, with_root: bool = True) -> float:
    """CPU seconds of `pid`'s process tree so far, or of the processes below it alone
    (with_root=False); processes that ended are not counted."""
    total = 0.0
    for member in process_tree(pid)[0 if with_root else 1:]:
        try:
            total += cpu_seconds(member)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def thread_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread's name and CPU seconds so far, by thread id."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            found[int(task.name)] = (name, _stat_seconds((task / "stat").read_text()))
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return found


def by_name(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> Counter[str]:
    """CPU seconds each thread name took between two thread_seconds() (threads that ended
    meanwhile are missing: the process total has them)."""
    taken: Counter[str] = Counter()
    for tid, (name, seconds) in after.items():
        taken[name] += seconds - before.get(tid, (name, 0.0))[1]
    return taken
