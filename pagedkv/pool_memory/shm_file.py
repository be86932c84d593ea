"""A CPU pool: a file in /dev/shm, mode 0600, locked while its owner lives, mapped by others.

Not `multiprocessing.shared_memory`: on Python 3.11 a process that merely attaches unlinks
the segment when it exits. The flock held for the pool's life is what tells a later
`cleanup_stale_pools` that a file is in use.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass

import structlog
import torch

from pagedkv.pool_memory.errors import PoolMappingError
from pagedkv.kv_geometry import check_dtype
from pagedkv.units import format_bytes

DEFAULT_SHM_DIRECTORY = "/dev/shm"
# Any name the cache service could have written, whatever pid it had. The pid in the
# name is only a hint for people; ownership is the flock (see cleanup_stale_pools).
_POOL_FILE = re.compile(r"^pagedkv-.*\.kv$")
# A pool file while it is being created and not yet locked (see create_shared_pool). One
# left behind by a service that died in that moment is removed once it is clearly old.
_CREATING_FILE = re.compile(r"^\.pagedkv-.*\.kv\.creating$")
_CREATING_STALE_AFTER_S = 60.0

log = structlog.get_logger()

@dataclass(frozen=True, slots=True)
class SharedPoolHandle:
    """What a second process needs to map a CPU pool."""

    path: str
    size_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"


class SharedPool:
    """A pool tensor backed by a file in shared memory; `close()` unlinks the file.

    `lock_fd` holds an exclusive flock on the file for as long as the pool is open: it
    is what tells a later cleanup that the file is in use (see cleanup_stale_pools).
    Mappings (this process's `.tensor`, other processes' `map_pool` results) stay valid
    after close(): the memory is freed when the last one goes away.
    """

    def __init__(self, tensor: torch.Tensor, handle: SharedPoolHandle, lock_fd: int | None = None) -> None:
        self.tensor = tensor
        self.handle = handle
        self.lock_fd = lock_fd
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unlink the backing file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            os.unlink(self.handle.path)
        except FileNotFoundError:
            pass
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # drops the flock
            self.lock_fd = None

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SharedPool({self.handle.path!r}, shape={self.handle.shape}, dtype={self.handle.dtype}, {state})"


def pool_size_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    if not shape or any(isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 for dim in shape):
        raise ValueError(f"pool shape must be positive integers, got {shape}")
    numel = math.prod(shape)
    return numel, numel * dtype.itemsize


def create_shared_pool(
    shape: tuple[int, ...], dtype: torch.dtype, directory: str = DEFAULT_SHM_DIRECTORY
) -> SharedPool:
    """Create `pagedkv-<pid>-<random>.kv` in `directory` (mode 0600), zero-filled, and map it.

    The file's pages are reserved up front (posix_fallocate): a tmpfs too small for the
    pool (Docker's default /dev/shm is 64 MiB) fails here with a clear error rather than
    with SIGBUS when a late block is first written. The file is flocked before anything
    else can see it in use, and stays locked until close() (or this process's death).
    """
    shape = tuple(shape)
    check_dtype(dtype)
    numel, size_bytes = pool_size_bytes(shape, dtype)
    name = f"pagedkv-{os.getpid()}-{secrets.token_hex(8)}.kv"
    path = os.path.join(directory, name)
    # Created under a name no cleaner matches, locked, and only then renamed to the pool's
    # name (the flock stays with the open file): another cache service's start-up cleanup
    # must never find the pool's name unlocked, or it takes it for stale and removes it.
    creating = os.path.join(directory, f".{name}.creating")
    fd = os.open(creating, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.unlink(creating)
        os.close(fd)
        raise
    os.rename(creating, path)
    try:
        os.ftruncate(fd, size_bytes)
        _reserve(fd, size_bytes, directory)
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return SharedPool(tensor, SharedPoolHandle(path=path, size_bytes=size_bytes, shape=shape, dtype=dtype), fd)


def _reserve(fd: int, size_bytes: int, directory: str) -> None:
    def too_small(available: int) -> PoolMappingError:
        return PoolMappingError(
            f"{directory} has {format_bytes(available)} free but the KV pool needs "
            f"{format_bytes(size_bytes)} ({size_bytes:,} bytes): enlarge it (Docker: shm_size / "
            f"--shm-size) or lower --kv-cache-bytes"
        )

    stats = os.statvfs(directory)
    available = stats.f_bavail * stats.f_frsize
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise too_small(available) from error
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        # A filesystem without fallocate: the free-space check is the best we can do.
        if available < size_bytes:
            raise too_small(available) from None
    except AttributeError:  # no posix_fallocate (macOS)
        if available < size_bytes:
            raise too_small(available) from None


def cleanup_stale_pools(directory: str = DEFAULT_SHM_DIRECTORY) -> list[str]:
    """Remove pool files no live cache service holds; returns the paths removed.

    A live pool's file is flocked by the cache service that created it, for as long as
    that process lives (the kernel drops the lock when it dies, however it dies). So a
    file whose lock can be taken is stale, whatever pid its name carries: a restarted
    service that got its predecessor's pid still removes the old pool, and services in
    PID namespaces that share /dev/shm never remove each other's live pools. Anything
    else in the directory (another user's file, a directory, a symlink, a file that
    cannot be opened) is skipped with a warning: /dev/shm is writable by everyone, so
    nothing found there may stop the service from starting.
    """
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(directory, name)
        if _POOL_FILE.match(name) is None and not (_CREATING_FILE.match(name) and _older_than(path, _CREATING_STALE_AFTER_S)):
            continue
        if _remove_if_stale(path):
            removed.append(path)
    return removed


def _older_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path, follow_symlinks=False).st_mtime > seconds
    except OSError:
        return False


def _remove_if_stale(path: str) -> bool:
    try:
        # O_NOFOLLOW: a symlink named like a pool must not make us lock (or remove) its target.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False  # another cleaner got there first
    except OSError as error:
        log.warning("shm_file_skipped", path=path, reason=f"cannot open it: {error.strerror}")
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            log.warning("shm_file_skipped", path=path, reason="not a regular file")
            return False
        if info.st_uid != os.geteuid():
            log.warning("shm_file_skipped", path=path, reason=f"owned by uid {info.st_uid}, not this user")
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live cache service holds it
        except OSError as error:
            log.warning("shm_file_skipped", path=path, reason=f"cannot lock it: {error.strerror}")
            return False
        try:
            # Still the file we locked? (It may have been removed and the name reused.)
            current = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (current.st_dev, current.st_ino) != (info.st_dev, info.st_ino):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as error:
            log.warning("shm_file_skipped", path=path, reason=f"cannot remove it: {error.strerror}")
            return False
        return True
    finally:
        os.close(fd)
