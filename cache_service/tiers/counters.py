"""What each KV tier has done since start-up: hits, copies each way, bytes and seconds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TierCounters:
    hit_tokens: int = 0  # prompt tokens an allocate got from this tier (promoted)
    demotions: int = 0  # blocks copied into this tier
    promotions: int = 0  # blocks copied out of it into the device pool
    bytes_in: int = 0
    bytes_out: int = 0
    seconds_in: float = 0.0
    seconds_out: float = 0.0
    evictions: int = 0  # entries this tier dropped for room (to the next tier, or lost)
    errors: int = 0  # writes or reads that failed (disk full, a bad file): skipped, never a failed request
