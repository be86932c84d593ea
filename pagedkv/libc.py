"""The C library's functions that Python's standard library does not wrap (prctl, madvise,
mallopt, malloc_trim), from one handle loaded once.

`function` gives None where this system's C library has no such function (not Linux, not
glibc), and each caller keeps its own fallback: the feature is skipped, never an error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None


_LIBC = _load()


def function(name: str, argtypes: list | None = None, restype=ctypes.c_int):
    """The C library's `name` (with `argtypes` and `restype` set, where argtypes are given),
    or None where it has none. The handle is shared: give one function the same types
    wherever it is asked for."""
    found = getattr(_LIBC, name, None) if _LIBC is not None else None
    if found is not None and argtypes is not None:
        found.argtypes = argtypes
        found.restype = restype
    return found


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PRCTL = function("prctl")

# Where a launcher names itself to its child (with_parent below); read once by the child.
PARENT_ENV = "PAGEDKV_DIE_WITH_PARENT"


def with_parent(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (by default this process's) naming this process as the parent a service it
    launches must die with: the child calls die_with_launcher() first thing.

    The child arms its own death signal rather than the launcher arming it in a preexec_fn:
    a preexec_fn makes Popen really fork, which runs gRPC's fork handlers in a launcher that
    holds channels, and those hung in fork() for minutes, or broke the child's poller. Without
    one, Popen uses vfork and no handler runs."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """A launched service's first call: when its launcher named itself (with_parent), the
    kernel sends this process SIGTERM when the launcher dies, even by SIGKILL, which leaves
    it no chance to stop its children. A launcher already gone by now (this process was
    handed to another parent) sends nothing, so this process ends at once. Linux only;
    elsewhere, and without the variable, nothing happens."""
    parent = os.environ.pop(PARENT_ENV, None)  # not for this process's own children
    if parent is None or _PRCTL is None or not parent.isdigit():
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)
