"""run_in_passing_thread (model_service/worker/torch_threads.py): the work's result or its
exception, in a thread that is gone afterwards; and what it is for: no second OpenMP pool,
so the engine thread's workers keep spinning between parallel regions instead of sleeping
and being woken for each one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from model_service.worker.torch_threads import run_in_passing_thread


def test_returns_the_result_from_another_thread_that_has_ended():
    seen = []

    def work():
        seen.append(threading.current_thread())
        return 42

    assert run_in_passing_thread(work) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_raises_the_work_s_exception():
    def work():
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        run_in_passing_thread(work)


def test_runs_at_the_caller_s_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert run_in_passing_thread(torch.get_num_threads) == 1
    finally:
        torch.set_num_threads(before)


# Start-up work (in the main thread, or in a passing thread), then parallel regions in an
# "engine" thread; prints the CPUs, the process's threads before start-up and its threads
# once the engine's pool runs. What the passing thread is for: no OpenMP pool but the
# engine's is left, as libgomp throttles two pools of `cores` workers on `cores` CPUs to a
# sleep per region. Counted in threads, not in context switches: a thread count does not
# move with the machine's load (the context-switch ratio this replaces failed about one
# run in four on a loaded 2-core machine).
THREADS = textwrap.dedent("""
    import os, sys, threading, time, torch
    from model_service.worker.torch_threads import run_in_passing_thread
    cores = len(os.sched_getaffinity(0))  # the CPUs libgomp counts
    torch.set_num_threads(cores)
    before = len(os.listdir("/proc/self/task"))
    startup = lambda: torch.ones(4_000_000).mul(2.0).sum()  # parallel regions, as loading a model runs
    if sys.argv[1] == "passing":
        run_in_passing_thread(startup)
    else:
        startup()
    counts = []

    def engine():
        torch.set_num_threads(cores)
        x = torch.ones(400_000)
        for _ in range(10):
            x.mul_(1.0)
        # The passing thread's workers end with it, perhaps a moment after it: waited for,
        # up to 10 s (a second pool never ends, and is seen after the wait).
        deadline = time.monotonic() + 10
        while len(os.listdir("/proc/self/task")) > before + cores and time.monotonic() < deadline:
            time.sleep(0.01)
        counts.append(len(os.listdir("/proc/self/task")))

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    print(cores, before, counts[0])
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: torch runs no worker threads")
def test_start_up_in_a_passing_thread_leaves_only_the_engine_s_pool():
    def threads(mode: str) -> tuple[int, int, int]:
        env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        result = subprocess.run([sys.executable, "-c", THREADS, mode], capture_output=True, text=True,
                                timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        cores, before, after = map(int, result.stdout.split()[-3:])
        return cores, before, after

    cores, before, after = threads("main")
    # The engine thread, its cores - 1 workers, and start-up's pool of cores - 1 beside them.
    assert after == before + cores + (cores - 1), (cores, before, after)
    cores, before, after = threads("passing")
    assert after == before + cores, (cores, before, after)  # the engine thread and its workers only
