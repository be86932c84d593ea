"""harness/cpu_use.py's process tree, harness/peers/settle.py and the environment harness/processes.py gives services."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.cpu_use import process_tree, tree_seconds
from harness.peers.settle import settle

# A child that starts a grandchild, says both pids, burns CPU until told to stop, then waits.
CHILD = """
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(grandchild.pid, flush=True)
while sys.stdin.readline().strip() != "stop":
    pass
sys.stdin.read()
grandchild.stdin.close(); grandchild.wait()
"""


def test_the_tree_holds_children_and_grandchildren_and_settle_waits_for_them_to_go_idle():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree and grandchild in tree
        assert process_tree(child.pid)[0] == child.pid and grandchild in process_tree(child.pid)
        assert tree_seconds(os.getpid(), with_root=False) <= tree_seconds(os.getpid())
        child.stdin.write("stop\n")
        child.stdin.flush()
        # Idle now (blocked reading): settle returns well before its limit.
        assert settle(limit_s=60) < 60
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert child.pid not in process_tree(os.getpid())


def test_services_get_the_kernel_level_switches_and_no_other_pagedkv_setting(monkeypatch):
    from harness.processes import _test_env

    monkeypatch.setenv("PAGEDKV_F32_KERNELS", "avx2")
    monkeypatch.setenv("PAGEDKV_CPU_LEVEL", "avx2")  # the process-wide level and architecture too
    monkeypatch.setenv("PAGEDKV_CPU_ARCH", "x86-64-v3")
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", "/somewhere/else")
    env = _test_env({"EXTRA": "1"})
    assert env["PAGEDKV_F32_KERNELS"] == "avx2" and env["EXTRA"] == "1"
    assert env["PAGEDKV_CPU_LEVEL"] == "avx2" and env["PAGEDKV_CPU_ARCH"] == "x86-64-v3"
    assert "PAGEDKV_KERNEL_CACHE" not in env


def test_the_thread_sampler_tells_the_engine_a_compile_and_its_pool_apart():
    """Threads named as the model service names them (pagedkv/thread_names.py): a compile's
    grammar-TID, inherited by the threads it starts; each burns some CPU, then waits until
    the sampler has read them for the last time."""
    import threading
    import time

    from harness.cache_helpers import wait_for
    from harness.cpu_use import ThreadSampler
    from pagedkv.thread_names import name_this_thread

    done = threading.Event()

    def burn() -> None:
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass
        done.wait()

    def compile_like() -> None:
        name_this_thread(f"grammar-{threading.get_native_id()}")
        pool = threading.Thread(target=burn)
        pool.start()
        burn()
        pool.join()

    def engine() -> None:
        name_this_thread("engine")
        burn()

    threads = [threading.Thread(target=compile_like), threading.Thread(target=engine)]
    with ThreadSampler(os.getpid(), interval_s=0.01) as sampler:
        for thread in threads:
            thread.start()
        wait_for(lambda: all(sampler.roles[role] > 0 for role in ("engine", "grammar-compile", "xgrammar pool")),
                 30, "each thread's CPU to be read")
    done.set()
    for thread in threads:
        thread.join()
    assert {"engine", "grammar-compile", "xgrammar pool"} <= set(sampler.roles)
