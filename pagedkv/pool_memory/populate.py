"""A CPU pool's pages mapped into this process ahead of use, off the calls' path.

A shared file mapping gets each 4 KiB page into a process on that process's first touch
of it: one page fault a page. The cache service first touches a block when it promotes
into it (a host, disk or remote block copied in during a Lease call), and a block of a
real model is hundreds of KiB, so a promotion of a few dozen fresh blocks would take
thousands of faults on the Lease call's path (in a virtual machine each costs
microseconds). The model service first touches a block when a prompt's K/V is written
into it, on the engine thread; and a tmpfs page that `fallocate` reserved is zeroed at
its first touch, so until every block has been written once (minutes into a fresh
service) each fresh block costs the engine a page clear and a fault a page. The model
service maps its own view of the pool ahead, too, on a thread of its own.
``MADV_POPULATE_WRITE`` (Linux 5.14) maps a range in one call without changing its
bytes; the pool's file is already allocated (``shm_file._reserve``), so populating takes
no new memory, only page-table entries.

Where the kernel refuses the call (older kernels, other systems) nothing is populated and
first touches fault as before.
"""

from __future__ import annotations

import ctypes
import threading

import structlog
import torch

from pagedkv import libc
from pagedkv.thread_names import name_this_thread
from pagedkv.thread_priority import lower_this_thread

log = structlog.get_logger()

MADV_POPULATE_WRITE = 23  # <linux/mman.h>
# Mapped a chunk a call: each call is short, so closing the service never waits on one long call.
CHUNK_BYTES = 64 << 20
PAGE_BYTES = 4096
# Nice value of the populating thread relative to the service's: it gives way to the calls.
NICENESS = 10

_madvise = libc.function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def populate(tensor: torch.Tensor) -> int:
    """Maps every page of ``tensor``'s storage (a CPU tensor over a shared mapping) into
    this process; returns the bytes populated (0 where the kernel does not offer it).
    ctypes lets go of the GIL in each call."""
    if _madvise is None or tensor.device.type != "cpu":
        return 0
    start = tensor.untyped_storage().data_ptr()
    size = tensor.untyped_storage().nbytes()
    if start % PAGE_BYTES:
        return 0  # not a mapping of its own (madvise takes page-aligned ranges only)
    done = 0
    while done < size:
        length = min(CHUNK_BYTES, size - done)
        if _madvise(start + done, length, MADV_POPULATE_WRITE) != 0:
            errno = ctypes.get_errno()
            log.info("pool_populate_unavailable", errno=errno, populated_bytes=done,
                     reason="the kernel maps the pool's pages on first touch instead (MADV_POPULATE_WRITE needs Linux 5.14)")
            return done
        done += length
    return done


def populate_in_background(tensor: torch.Tensor, name: str = "pool-populate") -> threading.Thread:
    """``populate`` on a daemon thread at a lower priority; the thread holds ``tensor`` (so
    its mapping) until it is done."""

    def run() -> None:
        name_this_thread(name)
        lower_this_thread(NICENESS)
        populated = populate(tensor)
        log.info("pool_populated", populated_bytes=populated)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
