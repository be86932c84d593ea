"""What the ledger (ledger.py) answers and refuses with: its errors, each naming the status
it maps to, the per-session limits, and the records its calls return."""

from __future__ import annotations

from dataclasses import dataclass


class LeaseError(Exception):
    """A request the ledger refuses; ``code`` is the gRPC status code name to return."""

    code = "UNKNOWN"


class NoFreeBlocks(LeaseError):
    code = "NO_FREE_BLOCKS"


class UnknownSequence(LeaseError):
    code = "NOT_FOUND"


class NotOwner(LeaseError):
    code = "PERMISSION_DENIED"


class InvalidLease(LeaseError):
    code = "INVALID_ARGUMENT"


class LimitExceeded(LeaseError):
    code = "LIMIT_EXCEEDED"


DEFAULT_MAX_SESSION_SEQUENCES = 16384
DEFAULT_MAX_SESSION_BLOCKS = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """What one owner may hold at once. The defaults are far beyond what an engine
    asks for (it runs tens to hundreds of sequences) but bound the ledger's memory: a
    sequence costs a few hundred bytes, a block-table entry eight."""

    max_sequences: int = DEFAULT_MAX_SESSION_SEQUENCES
    # Block-table entries (block references): a fork's shared blocks count again, since
    # its table holds them again.
    max_blocks: int = DEFAULT_MAX_SESSION_BLOCKS

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ValueError(f"--max-session-sequences must be at least 1, got {self.max_sequences}")
        if self.max_blocks < 1:
            raise ValueError(f"--max-session-blocks must be at least 1, got {self.max_blocks}")


@dataclass(frozen=True, slots=True)
class Allocation:
    sequence_id: int
    block_ids: list[int]
    cached_tokens: int  # leading prompt tokens whose K/V the reused blocks already hold
    # The parts of cached_tokens promoted from the host, disk and remote tiers (copied in before the reply).
    cached_tokens_host: int = 0
    cached_tokens_disk: int = 0
    cached_tokens_remote: int = 0


@dataclass(frozen=True, slots=True)
class Fork:
    sequence_id: int
    block_ids: list[int]
    copy: tuple[int, int] | None  # (src_block, dst_block): copy the parent's partial last block


@dataclass(frozen=True, slots=True)
class LedgerStats:
    blocks_total: int
    blocks_free: int
    blocks_leased: int
    blocks_cached: int
    sequences: int
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # prompt tokens found cached
    blocks_truncated: int = 0  # blocks given back by truncate since start-up


@dataclass(slots=True)
class ModelUsage:
    """What the sequences of one model (the fingerprint of their namespace) hold now, and
    what its allocations asked of the prefix cache since start-up."""

    sequences: int = 0
    # Distinct blocks: sequences share a block (prefix hits, forks) only within their
    # namespace, so no block is counted for two models.
    blocks_leased: int = 0
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # prompt tokens found cached
