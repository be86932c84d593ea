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


# Start-up work (in the main thread, or in a passing thread), then 300 parallel regions
# back to back in an "engine" thread; prints the process's voluntary context switches
# during those regions. A worker that sleeps between regions switches once per region.
WAKE_UPS = textwrap.dedent("""
    import os, resource, sys, threading, torch
    from model_service.worker.torch_threads import run_in_passing_thread
    cores = len(os.sched_getaffinity(0))  # the CPUs libgomp counts
    torch.set_num_threads(cores)
    startup = lambda: torch.ones(4_000_000).mul(2.0).sum()  # parallel regions, as loading a model runs
    if sys.argv[1] == "passing":
        run_in_passing_thread(startup)
    else:
        startup()
    counts = []

    def engine():
        torch.set_num_threads(cores)
        x = torch.ones(400_000)
        x.mul_(1.0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(300):
            x.mul_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before)

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    print(counts[0])
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: torch runs no worker threads to sleep")
def test_start_up_in_a_passing_thread_leaves_the_engine_s_workers_spinning():
    def wake_ups(mode: str) -> int:
        env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        result = subprocess.run([sys.executable, "-c", WAKE_UPS, mode], capture_output=True, text=True,
                                timeout=120, env=env)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1])

    in_main, passing = wake_ups("main"), wake_ups("passing")
    # Two pools of `cores` workers on `cores` CPUs: libgomp throttles, a sleep per region.
    assert in_main >= 150, in_main
    assert passing < in_main / 3, (passing, in_main)
