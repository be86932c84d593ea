"""The host-memory tier's storage: a block-slot tensor laid out as the pool, outside its budget.

Shape ``[num_layers, 2, num_slots, block_size, num_kv_heads, head_dim]``, the pool's with
slots for blocks. Blocks are copied one ``copy_`` each: on CPU, 16 bfloat16 blocks of
SmolLM2 took 8.5 ms that way and 199 ms through ``index_select``/``index_copy_`` (one
thread, this shared machine). On CUDA the slots are pinned and copies run on a stream of
the tier's own, waited on before the ledger relies on them; on CPU it is plain memory of
the cache service, apart from the shared pool file. Both run in a worker thread (torch
releases the GIL while it copies).
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
        if self.stream is None:
            for block_id, slot in zip(block_ids, slots):
                self.tensor[:, :, slot].copy_(pool_tensor[:, :, block_id])
            return
        with torch.cuda.stream(self.stream):
            for block_id, slot in zip(block_ids, slots):
                self.tensor[:, :, slot].copy_(pool_tensor[:, :, block_id], non_blocking=True)
        self.stream.synchronize()

    def load(self, slots: list[int], pool_tensor: torch.Tensor, block_ids: list[int]) -> None:
        """Copies host slots into pool blocks; the bytes are there when this returns."""
        if self.stream is None:
            for slot, block_id in zip(slots, block_ids):
                pool_tensor[:, :, block_id].copy_(self.tensor[:, :, slot])
            return
        with torch.cuda.stream(self.stream):
            for slot, block_id in zip(slots, block_ids):
                pool_tensor[:, :, block_id].copy_(self.tensor[:, :, slot], non_blocking=True)
        self.stream.synchronize()

    def read(self, slot: int) -> torch.Tensor:
        """One slot's bytes, copied out (for a write to disk)."""
        return self.tensor[:, :, slot].clone()
