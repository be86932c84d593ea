"""glibc malloc settings for a long-running server: fewer arenas, free pages given back,
but not between one layer's activations and the next's.

The model service allocates from many threads (gRPC's, the HTTP server's, tokenizing and
grammar-compiling workers, the engine's). glibc gives threads arenas of their own, up to
eight a core, and returns an arena's free pages to the system only from its top: freed
memory in the middle of an arena stays resident, so resident memory creeps up with the
requests served although nothing is kept. Two remedies, each a flag:

- ``arena_max``: ``mallopt(M_ARENA_MAX, n)`` before the server's threads start, so that
  threads share a few arenas and reuse each other's free chunks;
- ``trim_interval_s``: ``malloc_trim(0)`` on a thread of its own every so often, which
  gives every arena's free pages back (madvise), wherever they are in the arena. A trim
  holds each arena's lock in turn for a moment; far apart, it costs nothing measurable;
- ``keep_free_bytes``: the free memory an arena keeps mapped rather than give back at once
  (``M_TRIM_THRESHOLD``), with every allocation up to glibc's ceiling for it served from the
  arenas (``M_MMAP_THRESHOLD``). A forward pass frees each layer's activations (tens of MB
  in a long prefill) just before the next layer asks for as much again. glibc's own
  thresholds give most of those blocks back at free (munmap, or madvise of an arena's top),
  so each layer faulted those pages in again, each zeroed by the kernel. Kept, the next
  layer reuses them; the periodic trim above still gives them back between bursts.

On a C library without these functions (musl, macOS) both are skipped, with a log line.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import structlog

from pagedkv import libc

log = structlog.get_logger()

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # malloc.h
# glibc refuses an M_MMAP_THRESHOLD above this (4 MiB * sizeof(long) on 64-bit systems);
# larger allocations are always mapped on their own.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
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


def configure(arena_max: int, trim_interval_s: float, keep_free_bytes: int = 0,
              stop: threading.Event | None = None) -> threading.Thread | None:
    """Applies the settings (0 leaves glibc's own); returns the trimming thread, if one runs
    (it ends when ``stop`` is set)."""
    if arena_max < 0 or trim_interval_s < 0 or keep_free_bytes < 0:
        raise ValueError(f"--malloc-arena-max, --malloc-trim-interval-s and --malloc-keep-free-bytes must be 0 "
                         f"(glibc's default) or more, got {arena_max}, {trim_interval_s:g} and {keep_free_bytes}")
    if not arena_max and not trim_interval_s and not keep_free_bytes:
        return None
    glibc = _libc()
    if glibc is None:
        log.warning("malloc_settings_skipped", reason="the C library has no mallopt/malloc_trim (not glibc)")
        return None
    if arena_max and glibc.mallopt(M_ARENA_MAX, arena_max) != 1:
        log.warning("malloc_settings_skipped", reason=f"mallopt(M_ARENA_MAX, {arena_max}) refused")
    if keep_free_bytes:
        for option, value in ((M_MMAP_THRESHOLD, min(keep_free_bytes, MMAP_THRESHOLD_MAX)),
                              (M_TRIM_THRESHOLD, keep_free_bytes)):
            if glibc.mallopt(option, value) != 1:
                log.warning("malloc_settings_skipped", reason=f"mallopt({option}, {value}) refused")
    log.info("malloc_settings", arena_max=arena_max or "glibc default", trim_interval_s=trim_interval_s or "off",
             keep_free_bytes=keep_free_bytes or "glibc default")
    if not trim_interval_s:
        return None
    stop = stop or threading.Event()

    def trim() -> None:
        while not stop.wait(trim_interval_s):
            glibc.malloc_trim(0)

    thread = threading.Thread(target=trim, name="malloc-trim", daemon=True)
    thread.start()
    return thread
