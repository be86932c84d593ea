"""PoolHandle, the proto that AttachResponse carries: built from either kind of pool, mapped back.

The cache service calls `handle_to_proto` (or the two shorthands at the end); the model
service calls `map_pool` on the PoolHandle from AttachResponse.
"""

from __future__ import annotations

import os

import torch

from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import dtype_from_proto, dtype_to_proto
from pagedkv.pool_memory.cuda_ipc import CudaIpcInfo, export_cuda_pool, import_cuda_pool
from pagedkv.pool_memory.errors import PoolMappingError
from pagedkv.pool_memory.shm_file import SharedPoolHandle, pool_size_bytes
from pagedkv.records import record_from


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
    return record_from(CudaIpcInfo, ipc, shape=tuple(handle.shape), stride=tuple(ipc.stride),
                       dtype=dtype_from_proto(handle.dtype))


def map_pool(handle: cache_pb2.PoolHandle) -> torch.Tensor:
    """The pool tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] of `handle`.

    Raises ValueError for a malformed handle and PoolMappingError when the memory it
    names cannot be mapped (file missing or of another size, IPC handle refused).
    """
    shape = tuple(handle.shape)
    dtype = dtype_from_proto(handle.dtype)
    numel, size_bytes = pool_size_bytes(shape, dtype)
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
