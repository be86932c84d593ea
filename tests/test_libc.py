"""pagedkv/libc.py: one handle to the C library, a function or None, types as asked, and
subprocesses that die with their parent."""

from __future__ import annotations

import ctypes
import os
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_a_child_started_with_die_with_parent_gets_sigterm_at_its_parents_death():
    # The parent starts a sleeping child with die_with_parent and exits at once: the child,
    # orphaned, must end by SIGTERM rather than sleep on.
    parent = textwrap.dedent("""
        import subprocess, sys
        from pagedkv import libc
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=libc.die_with_parent)
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
    raise AssertionError("the orphaned child outlived its parent by 30 s")
