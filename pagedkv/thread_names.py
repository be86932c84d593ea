"""The operating system's name of a thread (Linux: /proc/PID/task/TID/comm, 15 bytes).

Python 3.11 names its threads for Python only: every thread of a service reads as the
interpreter in `top -H`, py-spy's native view or /proc, so a thread's CPU cannot be told
from another's from outside. A thread that names itself here can; a thread it starts
afterwards (a C++ library's pool included) starts with the same name.
"""

from __future__ import annotations

from pagedkv import libc

_PR_SET_NAME = 15
MAX_CHARS = 15  # the kernel keeps 16 bytes, the terminating zero included

_prctl = libc.function("prctl")  # None where not Linux: the names stay Python's own


def name_this_thread(name: str) -> None:
    """Gives the calling thread `name` (cut to MAX_CHARS bytes) where the system allows."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, name.encode()[:MAX_CHARS], 0, 0, 0)


def threads_named(name: str) -> list[int]:
    """The ids of this process's threads that bear `name` now (cut as name_this_thread cuts it)."""
    from pathlib import Path

    wanted = name.encode()[:MAX_CHARS].decode(errors="ignore")
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == wanted:
                found.append(int(task.name))
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
    return found
