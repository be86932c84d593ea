"""What one forward pass needs to know about where K/V live in the paged pool.

The engine builds one AttentionMetadata per step; every layer reuses it. Sequences are
ordered decode first (one new token each), then prefill chunks (any number of new
tokens, possibly after a prefix already in the pool). The tokens of the step are
flattened in that same order: q/k/v are [num_tokens, heads, head_dim].

Pool layout (docs/architecture.md): kv_pool is [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]; a layer's slice kv_pool[layer] is [2, num_blocks, block_size, kv_heads, head_dim]
with K at index 0 and V at index 1. Slot s of block b holds token position
b * block_size + s of the sequence whose table lists b.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    # Where each new token's K/V is written: block_id * block_size + offset. int64 [num_tokens].
    slot_mapping: torch.Tensor
    # One row per sequence (decode first), padded with 0 past each sequence's last block.
    # int32 [num_seqs, max_blocks_per_seq]. Padding keeps shapes stable across steps.
    block_tables: torch.Tensor
    # Tokens in the pool for each sequence after this step's writes (cached prefix +
    # earlier tokens + this step's new ones). int32 [num_seqs].
    context_lens: torch.Tensor
    # New tokens of each sequence in this step, host-side so the prefill loop never syncs.
    query_lens: tuple[int, ...]
    # Same as context_lens, host-side.
    context_lens_host: tuple[int, ...]
    # The first num_decode_seqs sequences have exactly one new token each.
    num_decode_seqs: int
    block_size: int
    # Derived tensors that every layer of this step shares (decode plans, per sliding
    # window), filled by the attention path on first use. Give a fresh dict per step, and
    # None (no sharing) for metadata whose tensors are refilled in place between steps, as
    # captured decode graphs do: a memo would keep serving the first step's plan.
    step_memo: dict | None = None

    def shared(self, key: Any, build: Callable[[], Any]) -> Any:
        """step_memo[key], built by `build` on first use (every call without a memo)."""
        if self.step_memo is None:
            return build()
        if key not in self.step_memo:
            self.step_memo[key] = build()
        return self.step_memo[key]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)
