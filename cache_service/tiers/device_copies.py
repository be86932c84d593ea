"""Block copies between a CUDA pool and host memory: batched, through pinned staging, on a side stream.

A pool block ``pool[:, :, id]`` is ``num_layers * 2`` separate runs of memory, and the
blocks of a batch are scattered over the pool. ``Tensor.copy_`` between such a slice and
host memory goes through a contiguous temporary on each side, one block at a time. Here
a batch costs one gather (or scatter) kernel on the device and one DMA between two
contiguous staging buffers of STAGE_BLOCKS blocks each (one in pinned host memory, one
on the device), whatever the blocks' ids; the host side moves each block between its
slot (or a disk payload) and the pinned buffer with plain CPU copies.

Every method blocks until its copies are done (it waits on a CUDA event), so it runs in
a worker thread, never on the event loop: the caller's thread holds the staging
buffers, one batch at a time.

Pinned memory is allocated exactly: torch's pinned allocations (``pin_memory=True``)
come from its caching host allocator, which rounds each one up to a power of two, so
the host tier would pin up to twice what --host-cache-bytes says. ``pin_exact``
registers a pageable tensor's own pages with CUDA instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Blocks per gather/scatter: the staging buffers hold this many blocks each (device and pinned host).
STAGE_BLOCKS = 32


def pin_exact(tensor: torch.Tensor) -> None:
    """Page-locks ``tensor``'s own memory (exactly its bytes) for DMA; ``unpin`` undoes it."""
    # cudaHostRegisterPortable: pinned for every device's context, not only the current one's.
    error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 1))
    if error != 0:
        raise RuntimeError(f"could not pin {tensor.nbytes} bytes of host memory for the KV tier (cudaError {error}): "
                           "lower --host-cache-bytes or raise the locked-memory limit (ulimit -l)")


def unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class BlockMover:
    """Batched block copies between ``pool`` (on a CUDA device) and host memory."""

    def __init__(self, pool: torch.Tensor, bytes_per_block: int) -> None:
        self.pool = pool
        self.bytes_per_block = bytes_per_block
        self.stream = torch.cuda.Stream(device=pool.device)
        self.event = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.device_stage = pool.new_empty((STAGE_BLOCKS * bytes_per_block,), dtype=torch.uint8)
        self.host_stage = torch.empty(STAGE_BLOCKS * bytes_per_block, dtype=torch.uint8)
        pin_exact(self.host_stage)

    @property
    def staging_bytes(self) -> tuple[int, int]:
        """(device, pinned host) bytes the staging buffers take, outside the pool and the tiers."""
        return self.device_stage.nbytes, self.host_stage.nbytes

    def _views(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``count`` blocks of each staging buffer, laid out as the pool: [layers, 2, count, ...]."""
        shape = (*self.pool.shape[:2], count, *self.pool.shape[3:])
        size = count * self.bytes_per_block
        return (self.device_stage[:size].view(self.pool.dtype).view(shape),
                self.host_stage[:size].view(self.pool.dtype).view(shape))

    def _after_this_process(self) -> None:
        """Orders the next batch after what this process queued on the pool's device (the
        pool's zeroing at start-up; a test's writes): writers in other processes are
        ordered by the Lease calls instead."""
        self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))

    def _wait(self) -> None:
        self.event.record(self.stream)
        self.event.synchronize()

    def to_host(self, block_ids: Sequence[int], sink: Callable[[int, torch.Tensor], None]) -> None:
        """Copies the pool's ``block_ids`` out; ``sink(i, block)`` gets the i-th block in pinned
        staging (valid only during the call: copy it) once its bytes are all there."""
        self._after_this_process()
        for start in range(0, len(block_ids), STAGE_BLOCKS):
            chunk = block_ids[start:start + STAGE_BLOCKS]
            device_view, host_view = self._views(len(chunk))
            with torch.cuda.stream(self.stream):
                ids = self.pool.new_tensor(chunk, dtype=torch.long)
                torch.index_select(self.pool, 2, ids, out=device_view)
                host_view.copy_(device_view, non_blocking=True)
            self._wait()
            for offset in range(len(chunk)):
                sink(start + offset, host_view[:, :, offset])

    def from_host(self, block_ids: Sequence[int], fill: Callable[[int, torch.Tensor], None]) -> None:
        """Copies into the pool's ``block_ids``: ``fill(i, block)`` writes the i-th block's bytes
        into pinned staging; done (the bytes in the pool) when this returns."""
        self._after_this_process()
        for start in range(0, len(block_ids), STAGE_BLOCKS):
            chunk = block_ids[start:start + STAGE_BLOCKS]
            device_view, host_view = self._views(len(chunk))
            for offset in range(len(chunk)):
                fill(start + offset, host_view[:, :, offset])
            with torch.cuda.stream(self.stream):
                ids = self.pool.new_tensor(chunk, dtype=torch.long)
                device_view.copy_(host_view, non_blocking=True)
                self.pool.index_copy_(2, ids, device_view)
            self._wait()  # before the next chunk refills the staging buffers

    def close(self) -> None:
        unpin(self.host_stage)
