"""A CUDA pool shared by IPC handle: the fields of torch's reduce_tensor, exported and imported."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.multiprocessing.reductions as reductions

from pagedkv.pool_memory.errors import PoolMappingError


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
