"""pagedkv/libc.py: one handle to the C library, a function or None, types as asked, and
subprocesses that die with their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedkv import libc


def test_a_function_the_c_library_lacks_is_none_not_an_error():
    assert libc.function("pagedkv_no_such_function") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_function_comes_with_the_types_asked_and_is_the_same_everywhere():
    trim = libc.function("malloc_trim", [ctypes.c_size_t])
    assert trim is not None and trim.argtypes == [ctypes.c_size_t] and trim.restype is ctypes.c_int
    assert libc.function("malloc_trim") is trim  # one handle: the types set once hold for every caller
    assert trim(0) in (0, 1)


LAUNCHES = {
    "a service": '[sys.executable, "-c", "from pagedkv import libc; libc.die_with_launcher(); import time; time.sleep(60)"]',
    "a binary": '[sys.executable, "-m", "pagedkv.exec_with_parent", "sleep", "60"]',
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_a_launched_child_gets_sigterm_at_its_launchers_death(launch):
    # The launcher starts a sleeping child as the services are started (no preexec_fn, so
    # Popen does not fork for real) and exits at once: the child, orphaned, must end by
    # SIGTERM rather than sleep on.
    parent = textwrap.dedent(f"""
        import subprocess, sys
        from pagedkv import libc
        child = subprocess.Popen({LAUNCHES[launch]}, env=libc.with_parent())
        print(child.pid, flush=True)
    """)
    output = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, check=True)
    pid = int(output.stdout)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    raise AssertionError("the orphaned child outlived its launcher by 30 s")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_child_whose_launcher_is_already_gone_ends_at_once():
    # Named a launcher that is not its parent (as when the launcher died before the child
    # armed its signal and the child was handed to another), it cannot wait for a signal.
    child = subprocess.run([sys.executable, "-c", "from pagedkv import libc; libc.die_with_launcher(); print('on')"],
                           env={**os.environ, libc.PARENT_ENV: "1"}, capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGTERM and "on" not in child.stdout
    # Without the variable, nothing is armed and nothing ends.
    assert subprocess.run([sys.executable, "-c", "from pagedkv import libc; libc.die_with_launcher()"],
                          env={k: v for k, v in os.environ.items() if k != libc.PARENT_ENV}, timeout=60).returncode == 0
