"""The physical KV pool: one tensor that the cache service allocates and the model service maps.

CPU: a file in /dev/shm (mode 0600: the KV cache holds users' prompts) mapped with
`torch.from_file(shared=True)`. Not `multiprocessing.shared_memory`: on Python 3.11 a
process that merely attaches unlinks the segment when it exits (PERF.md).
CUDA: a CUDA IPC handle, the fields of `torch.multiprocessing.reductions.reduce_tensor`.

The cache service calls `create_shared_pool` / `export_cuda_pool` and `handle_to_proto`;
the model service calls `map_pool` on the PoolHandle from AttachResponse.
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
import torch.multiprocessing.reductions as reductions

from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import check_dtype, dtype_from_proto, dtype_to_proto
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


class PoolMappingError(RuntimeError):
    """The pool named by a handle cannot be mapped; the message says why and what to fix."""


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


def _size_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
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
    numel, size_bytes = _size_bytes(shape, dtype)
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


# ---- CUDA IPC ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaIpcInfo:
    """The arguments of torch's rebuild_cuda_tensor for one tensor, as plain fields."""

    device_index: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype

    @property
    def device(self) -> str:
        return f"cuda:{self.device_index}"


def export_cuda_pool(tensor: torch.Tensor) -> CudaIpcInfo:
    """A handle another process can open to map `tensor` (which must stay alive here).

    Each call takes a fresh IPC reference count slot: export again for every Attach,
    not once for all. Importing in the exporting process itself fails (CUDA refuses to
    open its own IPC handle); use the tensor directly there.
    """
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is not reductions.rebuild_cuda_tensor:
        raise ValueError(f"export_cuda_pool needs a CUDA tensor, got one on {tensor.device}")
    (
        _tensor_cls,
        size,
        stride,
        tensor_offset,
        _storage_cls,
        dtype,
        device_index,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcInfo(
        device_index=int(device_index),
        storage_handle=bytes(storage_handle or b""),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle or b""),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
        shape=tuple(int(dim) for dim in size),
        stride=tuple(int(step) for step in stride),
        storage_offset=int(tensor_offset),
        dtype=dtype,
    )


def import_cuda_pool(info: CudaIpcInfo) -> torch.Tensor:
    """Map a pool exported by another process with export_cuda_pool."""
    if not info.storage_handle or info.storage_size_bytes == 0:
        raise PoolMappingError("CUDA pool handle has no storage handle (an empty or unset CudaIpcHandle)")
    try:
        return reductions.rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size(info.shape),
            tuple(info.stride),
            info.storage_offset,
            torch.storage.TypedStorage,  # what reduce_tensor sends: type(tensor._typed_storage())
            info.dtype,
            info.device_index,
            info.storage_handle,
            info.storage_size_bytes,
            info.storage_offset_bytes,
            False,  # requires_grad
            info.ref_counter_handle,
            info.ref_counter_offset,
            # torch takes None, not empty bytes, when no event is to be waited on.
            info.event_handle or None,
            info.event_sync_required,
        )
    except RuntimeError as error:
        raise PoolMappingError(
            f"cannot open the CUDA IPC handle of the KV pool on cuda:{info.device_index}: {error}. "
            f"Both services must see the same GPU and share a PID namespace "
            f"(docker-compose: pid: \"service:cache\"), and the cache service must still be running"
        ) from error


# ---- PoolHandle (proto) --------------------------------------------------------------


def handle_to_proto(handle: SharedPoolHandle | CudaIpcInfo) -> cache_pb2.PoolHandle:
    """The PoolHandle for AttachResponse.pool."""
    if isinstance(handle, SharedPoolHandle):
        return cache_pb2.PoolHandle(
            shape=list(handle.shape),
            dtype=dtype_to_proto(handle.dtype),
            device=handle.device,
            shared_memory=cache_pb2.SharedMemoryHandle(path=handle.path, size_bytes=handle.size_bytes),
        )
    if isinstance(handle, CudaIpcInfo):
        return cache_pb2.PoolHandle(
            shape=list(handle.shape),
            dtype=dtype_to_proto(handle.dtype),
            device=handle.device,
            cuda_ipc=cache_pb2.CudaIpcHandle(
                device_index=handle.device_index,
                storage_handle=handle.storage_handle,
                storage_size_bytes=handle.storage_size_bytes,
                storage_offset_bytes=handle.storage_offset_bytes,
                ref_counter_handle=handle.ref_counter_handle,
                ref_counter_offset=handle.ref_counter_offset,
                event_handle=handle.event_handle,
                event_sync_required=handle.event_sync_required,
                stride=list(handle.stride),
                storage_offset=handle.storage_offset,
            ),
        )
    raise TypeError(f"handle_to_proto takes a SharedPoolHandle or CudaIpcInfo, got {type(handle).__name__}")


def cuda_info_from_proto(handle: cache_pb2.PoolHandle) -> CudaIpcInfo:
    ipc = handle.cuda_ipc
    return CudaIpcInfo(
        device_index=ipc.device_index,
        storage_handle=ipc.storage_handle,
        storage_size_bytes=ipc.storage_size_bytes,
        storage_offset_bytes=ipc.storage_offset_bytes,
        ref_counter_handle=ipc.ref_counter_handle,
        ref_counter_offset=ipc.ref_counter_offset,
        event_handle=ipc.event_handle,
        event_sync_required=ipc.event_sync_required,
        shape=tuple(handle.shape),
        stride=tuple(ipc.stride),
        storage_offset=ipc.storage_offset,
        dtype=dtype_from_proto(handle.dtype),
    )


def map_pool(handle: cache_pb2.PoolHandle) -> torch.Tensor:
    """The pool tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] of `handle`.

    Raises ValueError for a malformed handle and PoolMappingError when the memory it
    names cannot be mapped (file missing or of another size, IPC handle refused).
    """
    shape = tuple(handle.shape)
    dtype = dtype_from_proto(handle.dtype)
    numel, size_bytes = _size_bytes(shape, dtype)
    kind = handle.WhichOneof("memory")
    if kind == "cuda_ipc":
        info = cuda_info_from_proto(handle)
        if len(info.stride) != len(shape):
            raise ValueError(f"CUDA pool handle has stride {info.stride} for shape {shape}")
        return import_cuda_pool(info)
    if kind != "shared_memory":
        raise ValueError("pool handle names no memory: neither shared_memory nor cuda_ipc is set")

    path = handle.shared_memory.path
    if handle.shared_memory.size_bytes != size_bytes:
        raise ValueError(
            f"pool handle says {handle.shared_memory.size_bytes:,} bytes but shape {list(shape)} of "
            f"{dtype} is {size_bytes:,} bytes"
        )
    # Check before torch.from_file: with shared=True it would create a missing file, or
    # grow a short one, and map fresh zeros instead of the cache service's pool.
    try:
        file_size = os.stat(path).st_size
    except FileNotFoundError:
        raise PoolMappingError(
            f"KV pool file {path} does not exist here: the model and cache services must share "
            f"{os.path.dirname(path) or '/dev/shm'} (same host, or docker-compose ipc: \"service:cache\"), "
            f"and the cache service must still be running"
        ) from None
    if file_size != size_bytes:
        raise PoolMappingError(
            f"KV pool file {path} holds {file_size:,} bytes, the handle says {size_bytes:,}: "
            f"it is not the pool this handle describes"
        )
    try:
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    except RuntimeError as error:
        if not os.access(path, os.R_OK | os.W_OK):
            raise PoolMappingError(
                f"KV pool file {path} is not readable and writable by this user (it is created with mode "
                f"0600): run both services as the same user"
            ) from error
        raise PoolMappingError(f"cannot map KV pool file {path}: {error}") from error


def shared_handle_to_proto(handle: SharedPoolHandle) -> cache_pb2.PoolHandle:
    """handle_to_proto for a CPU pool's SharedPoolHandle."""
    return handle_to_proto(handle)


def cuda_handle_to_proto(tensor: torch.Tensor) -> cache_pb2.PoolHandle:
    """export_cuda_pool then handle_to_proto: call it once per Attach (a fresh IPC ref count)."""
    return handle_to_proto(export_cuda_pool(tensor))
