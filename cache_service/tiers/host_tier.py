"""The host-memory tier's storage: a block-slot tensor laid out as the pool, outside its budget.

Shape ``[num_layers, 2, num_slots, block_size, num_kv_heads, head_dim]``, the pool's with
slots for blocks, so one ``index_select``/``index_copy_`` moves any set of blocks either
way. On CUDA the slots are pinned and copies run on a stream of the tier's own, waited on
before the ledger relies on them; on CPU it is plain memory of the cache service, apart
from the shared pool file.
"""

from __future__ import annotations

import torch


class HostTier:
    def __init__(self, pool_tensor: torch.Tensor, num_slots: int) -> None:
        shape = list(pool_tensor.shape)
        shape[2] = num_slots
        self.cuda = pool_tensor.is_cuda
        self.tensor = torch.zeros(shape, dtype=pool_tensor.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(device=pool_tensor.device) if self.cuda else None
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() takes slot 0 first

    def store(self, pool_tensor: torch.Tensor, block_ids: list[int], slots: list[int]) -> None:
        """Copies pool blocks into host slots; done when this returns."""
        source = torch.tensor(block_ids, device=pool_tensor.device)
        target = torch.tensor(slots)
        if self.stream is None:
            self.tensor.index_copy_(2, target, pool_tensor.index_select(2, source))
            return
        with torch.cuda.stream(self.stream):
            staged = pool_tensor.index_select(2, source).to("cpu", non_blocking=True)
        self.stream.synchronize()
        self.tensor.index_copy_(2, target, staged)

    def load(self, slots: list[int], pool_tensor: torch.Tensor, block_ids: list[int]) -> None:
        """Copies host slots into pool blocks; the bytes are there when this returns."""
        target = torch.tensor(block_ids, device=pool_tensor.device)
        gathered = self.tensor.index_select(2, torch.tensor(slots))
        if self.stream is None:
            pool_tensor.index_copy_(2, target, gathered)
            return
        with torch.cuda.stream(self.stream):
            pool_tensor.index_copy_(2, target, gathered.pin_memory().to(pool_tensor.device, non_blocking=True))
        self.stream.synchronize()

    def read(self, slot: int) -> torch.Tensor:
        """One slot's bytes, copied out (for a write to disk)."""
        return self.tensor[:, :, slot].clone()
