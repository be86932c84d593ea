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


SCHED_IDLE = 5  # the scheduling policy os.SCHED_IDLE, as /proc/PID/task/TID/stat gives it


def thread_stats(pid: int) -> dict[int, tuple[str, float, int]]:
    """Each live thread's name, CPU seconds so far and scheduling policy, by thread id."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        found[int(task.name)] = (name, _stat_seconds(stat), int(stat.rsplit(")", 1)[1].split()[38]))
    return found


def thread_role(pid: int, tid: int, name: str) -> str:
    """What a model service's thread does, from the names it gives its threads
    (pagedkv/thread_names.py): its main thread runs the event loop; a grammar compile names
    itself grammar-TID, and the threads xgrammar starts from it inherit that name."""
    if tid == pid:
        return "event loop (main thread)"
    if name == "engine":
        return "engine"
    if name.startswith("grammar-"):
        return "grammar-compile" if name == f"grammar-{tid}" else "xgrammar pool"
    return "other"


class ThreadSampler:
    """The CPU seconds a process's threads take while it is entered, by thread_role and
    scheduling policy, read every `interval_s` on a thread of its own: a grammar compile's
    threads live less than a second, so reading at the start and the end alone would
    miss them; here a thread that ends loses at most its last interval, and what the
    process took beyond its threads' sum is reported as "ended between reads"."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        import threading

        self.pid = pid
        self.interval_s = interval_s
        self.roles: Counter[str] = Counter()
        self._seen: dict[int, float] = {}  # thread id -> CPU seconds at its last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self._process_start = 0.0

    def _read(self, first: bool = False) -> None:
        for tid, (name, seconds, policy) in thread_stats(self.pid).items():
            before = self._seen.get(tid, seconds if first else 0.0)
            if seconds < before:  # the id of a thread that ended, taken by a new one
                before = 0.0
            self._seen[tid] = seconds
            if seconds > before:
                role = thread_role(self.pid, tid, name)
                self.roles[role + (" (SCHED_IDLE)" if policy == SCHED_IDLE else "")] += seconds - before

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._read()
            except FileNotFoundError:  # the process ended
                return

    def start(self) -> ThreadSampler:
        self._process_start = cpu_seconds(self.pid)
        self._read(first=True)
        self._thread.start()
        return self

    def __enter__(self) -> ThreadSampler:
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._read()
            ended = cpu_seconds(self.pid) - self._process_start - sum(self.roles.values())
        except FileNotFoundError:
            return
        if ended > 0:
            self.roles["ended between reads"] += ended


def main() -> None:
    import argparse
    import time

    parser = argparse.ArgumentParser(description="CPU seconds a process's threads take, by role")
    parser.add_argument("pid", type=int)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    with ThreadSampler(args.pid) as sampler:
        time.sleep(args.seconds)
    for role, seconds in sampler.roles.most_common():
        print(f"{role}: {seconds:.2f} s")


if __name__ == "__main__":
    main()
