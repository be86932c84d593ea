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
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", "/somewhere/else")
    env = _test_env({"EXTRA": "1"})
    assert env["PAGEDKV_F32_KERNELS"] == "avx2" and env["EXTRA"] == "1"
    assert "PAGEDKV_KERNEL_CACHE" not in env
