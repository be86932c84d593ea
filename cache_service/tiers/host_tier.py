"""The host-memory tier's storage: a block-slot tensor laid out as the pool, outside its budget.

Shape ``[num_layers, 2, num_slots, block_size, num_kv_heads, head_dim]``, the pool's with
slots for blocks. On CPU blocks are copied one ``copy_`` each: 16 bfloat16 blocks of
SmolLM2 copy several times faster that way than through ``index_select``/``index_copy_``
on one thread; it is plain memory of the cache service, apart from the shared pool file.
On CUDA the slots are page-locked exactly (``device_copies.pin_exact``: no power-of-two
rounding) and a batch of blocks crosses to or from the device in one DMA
(``device_copies.BlockMover``). Both run in a worker thread (torch releases the GIL
while it copies).
"""

from __future__ import annotations

import torch

from cache_service.tiers.device_copies import BlockMover, pin_exact, unpin


class HostTier:
    def __init__(self, pool_tensor: torch.Tensor, num_slots: int, mover: BlockMover | None = None) -> None:
        """``mover``: the pool's CUDA block mover (None: a CPU pool; one is made for a CUDA pool)."""
        shape = list(pool_tensor.shape)
        shape[2] = num_slots
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first
        if not pool_tensor.is_cuda:
            self.mover = None
            self.tensor = torch.zeros(shape, dtype=pool_tensor.dtype)
            return
        # Pageable memory pinned in place; its pages are touched (and locked) by the registration.
        self.tensor = torch.empty(shape, dtype=pool_tensor.dtype)
        pin_exact(self.tensor)
        self.mover = mover if mover is not None else BlockMover(pool_tensor, self.tensor[:, :, 0].nbytes)

    def store(self, pool_tensor: torch.Tensor, block_ids: list[int], slots: list[int]) -> None:
        """Copies pool blocks into host slots; done when this returns."""
        if self.mover is None:
            for block_id, slot in zip(block_ids, slots):
                self.tensor[:, :, slot].copy_(pool_tensor[:, :, block_id])
            return
        self.mover.to_host(block_ids, lambda i, block: self.tensor[:, :, slots[i]].copy_(block))

    def load(self, slots: list[int], pool_tensor: torch.Tensor, block_ids: list[int]) -> None:
        """Copies host slots into pool blocks; the bytes are there when this returns."""
        if self.mover is None:
            for slot, block_id in zip(slots, block_ids):
                pool_tensor[:, :, block_id].copy_(self.tensor[:, :, slot])
            return
        self.mover.from_host(block_ids, lambda i, staged: staged.copy_(self.tensor[:, :, slots[i]]))

    def read(self, slot: int) -> torch.Tensor:
        """One slot's bytes, copied out (for a write to disk)."""
        return self.tensor[:, :, slot].clone()

    def close(self) -> None:
        """Unpins the slots (CUDA); call once no copy runs."""
        if self.mover is not None:
            unpin(self.tensor)
