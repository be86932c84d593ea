"""What one Lease call carries and what comes back, as the scheduler sees it.

Plain data, no protobuf: cache/client.py maps `LeaseOps` to a `LeaseRequest` and each
result back to a `LeaseOutcome`. The order of the lists is the order the cache service
applies them in, which is what makes one call per step safe: forks before releases (a
parent released in the same call still has its blocks when its children fork), extends
the next step needs before new sequences' allocations, commits of running sequences'
full blocks before allocations too (a new sequence then shares a prefix computed a step
ago, not only one released), and last the blocks leased ahead
of need (`top_ups`), which may be refused without harm and so never take a block that a
needed op in the same call could have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_service.sched.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Release:
    lease_id: int
    # Tokens whose K/V are in the released blocks: their full blocks become prefix cache.
    cached_token_ids: tuple[int, ...]
    # Blocks in the released table: an estimate of what the release frees.
    num_blocks: int = 0


@dataclass(frozen=True, slots=True)
class ForkRequest:
    # The parent's lease and how many tokens of it are written, taken when the fork was
    # asked for: the parent may finish (and be released, after the fork, in the same call).
    parent_lease_id: int
    parent_tokens: int
    child: Sequence


@dataclass(slots=True)
class LeaseOps:
    """One lease call's ops, in the order the cache service applies them."""

    forks: list[ForkRequest] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    extends: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to hold)
    # (sequence, tokens): register its full blocks holding its first `tokens` tokens in the
    # prefix cache now (CommitOp); only ever added to a call that goes out anyway.
    commits: list[tuple[Sequence, int]] = field(default_factory=list)
    allocations: list[Sequence] = field(default_factory=list)
    # Extends ahead of need, (sequence, tokens to hold): only ever added to a call that
    # goes out anyway, and a refusal just leaves the sequence to ask when it needs to.
    top_ups: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.forks or self.releases or self.extends or self.commits or self.allocations or self.top_ups)

    def __len__(self) -> int:
        return (len(self.forks) + len(self.releases) + len(self.extends) + len(self.commits)
                + len(self.allocations) + len(self.top_ups))


@dataclass(frozen=True, slots=True)
class LeaseOutcome:
    """The cache service's answer to one op, stripped of protobuf."""

    ok: bool
    code: str = "OK"  # OK, NO_FREE_BLOCKS, NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT
    message: str = ""
    lease_id: int = 0
    block_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    cached_tokens_tiers: tuple[int, int] = (0, 0)  # of cached_tokens: promoted from the host, the disk tier
    copy: tuple[int, int] | None = None  # fork: (src_block, dst_block) to copy


class LeaseLost(RuntimeError):
    """The cache service no longer knows our session or a sequence: re-attach."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
