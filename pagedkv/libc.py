"""The C library's functions that Python's standard library does not wrap (prctl, madvise,
mallopt, malloc_trim), from one handle loaded once.

`function` gives None where this system's C library has no such function (not Linux, not
glibc), and each caller keeps its own fallback: the feature is skipped, never an error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
_PRCTL = function("prctl")  # looked up before any fork: a child only calls it


def die_with_parent() -> None:
    """A subprocess's preexec_fn (it runs in the child between fork and exec): a parent killed
    with SIGKILL cannot stop its children, so the kernel sends them SIGTERM when it dies
    (Linux only; elsewhere a no-op)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
