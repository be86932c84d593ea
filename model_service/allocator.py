"""glibc malloc settings for a long-running server: fewer arenas, free pages given back.

The model service allocates from many threads (gRPC's, the HTTP server's, tokenizing and
grammar-compiling workers, the engine's). glibc gives threads arenas of their own, up to
eight a core, and returns an arena's free pages to the system only from its top: freed
memory in the middle of an arena stays resident, so resident memory creeps up with the
requests served although nothing is kept. Two remedies, each a flag:

- ``arena_max``: ``mallopt(M_ARENA_MAX, n)`` before the server's threads start, so that
  threads share a few arenas and reuse each other's free chunks;
- ``trim_interval_s``: ``malloc_trim(0)`` on a thread of its own every so often, which
  gives every arena's free pages back (madvise), wherever they are in the arena. A trim
  holds each arena's lock in turn for a moment; far apart, it costs nothing measurable.

On a C library without these functions (musl, macOS) both are skipped, with a log line.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import structlog

from pagedkv import libc

log = structlog.get_logger()

M_ARENA_MAX = -8  # malloc.h
# The model service's defaults (server.py): two arenas are enough for threads that mostly
# wait on the engine and bound the arenas on a machine of many cores (glibc allows eight a
# core); a trim every ten seconds is far from any request's path. Together they lower the
# resident set a little; they do not change its slow growth (docs/benchmark-log.md, "Memory soak").
DEFAULT_ARENA_MAX = 2
DEFAULT_TRIM_INTERVAL_S = 10.0


def _libc() -> SimpleNamespace | None:
    """glibc's mallopt and malloc_trim; None where the C library lacks either (not glibc)."""
    mallopt = libc.function("mallopt", [ctypes.c_int, ctypes.c_int])
    malloc_trim = libc.function("malloc_trim", [ctypes.c_size_t])
    if mallopt is None or malloc_trim is None:
        return None
    return SimpleNamespace(mallopt=mallopt, malloc_trim=malloc_trim)


def configure(arena_max: int, trim_interval_s: float, stop: threading.Event | None = None) -> threading.Thread | None:
    """Applies the settings (0 leaves glibc's own); returns the trimming thread, if one runs
    (it ends when ``stop`` is set)."""
    if arena_max < 0 or trim_interval_s < 0:
        raise ValueError(f"--malloc-arena-max and --malloc-trim-interval-s must be 0 (glibc's default) or more, "
                         f"got {arena_max} and {trim_interval_s:g}")
    if not arena_max and not trim_interval_s:
        return None
    glibc = _libc()
    if glibc is None:
        log.warning("malloc_settings_skipped", reason="the C library has no mallopt/malloc_trim (not glibc)")
        return None
    if arena_max and glibc.mallopt(M_ARENA_MAX, arena_max) != 1:
        log.warning("malloc_settings_skipped", reason=f"mallopt(M_ARENA_MAX, {arena_max}) refused")
    log.info("malloc_settings", arena_max=arena_max or "glibc default", trim_interval_s=trim_interval_s or "off")
    if not trim_interval_s:
        return None
    stop = stop or threading.Event()

    def trim() -> None:
        while not stop.wait(trim_interval_s):
            glibc.malloc_trim(0)

    thread = threading.Thread(target=trim, name="malloc-trim", daemon=True)
    thread.start()
    return thread
