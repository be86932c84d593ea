"""The bytes of the largest LoRA adapter a server allows, shared by the model service (its
adapter slots, told to the cache service at Attach) and the offline sizing calculator."""

from __future__ import annotations

# Larger ranks are not LoRA's use (a rank-1024 adapter over a 4096-wide projection is a
# quarter of its weights); the cap keeps a typo in the flag from sizing away the pool.
RANK_CEILING = 512


def largest_adapter_bytes(*, num_layers: int, hidden_size: int, intermediate_size: int, q_size: int,
                          kv_size: int, max_rank: int, element_bytes: int) -> int:
    """Rank max_rank on all seven projections of every layer: A is [r, in], B is [out, r]."""
    fans = ((hidden_size, q_size), (hidden_size, kv_size), (hidden_size, kv_size), (q_size, hidden_size),
            (hidden_size, intermediate_size), (hidden_size, intermediate_size), (intermediate_size, hidden_size))
    return num_layers * max_rank * sum(fan_in + fan_out for fan_in, fan_out in fans) * element_bytes
