"""What one Lease call carries and what comes back, as the scheduler sees it.

Plain data, no protobuf: cache/client.py maps `LeaseOps` to a `LeaseRequest` and the
reply back to a `LeaseAnswer`, a typed outcome per op (`Refused`, or the kind's own
record: `Forked`, `Released`, `Extended`, `Committed`, `Allocated`). The order of the
lists (KINDS) is the order the cache service applies them in, which is what makes one
call per step safe: forks before releases (a
parent released in the same call still has its blocks when its children fork), extends
the next step needs before new sequences' allocations, commits of running sequences'
full blocks before allocations too (a new sequence then shares a prefix computed a step
ago, not only one released), and last the blocks leased ahead
of need (`top_ups`), which may be refused without harm and so never take a block that a
needed op in the same call could have had.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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
    # (sequence, tokens to hold): its table cut to them (TruncateOp), its blocks past them
    # holding only a rejected proposal's tokens (spec_tails.py); before the extends, which
    # then count from the cut table.
    truncates: list[tuple[Sequence, int]] = field(default_factory=list)
    extends: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to hold)
    # (sequence, tokens): register its full blocks holding its first `tokens` tokens in the
    # prefix cache now (CommitOp); only ever added to a call that goes out anyway.
    commits: list[tuple[Sequence, int]] = field(default_factory=list)
    allocations: list[Sequence] = field(default_factory=list)
    # Extends ahead of need, (sequence, tokens to hold): only ever added to a call that
    # goes out anyway, and a refusal just leaves the sequence to ask when it needs to.
    top_ups: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.forks or self.releases or self.truncates or self.extends or self.commits or self.allocations
                    or self.top_ups)

    def __len__(self) -> int:
        return sum(len(getattr(self, kind)) for kind in KINDS)


# The kinds of op in the order the cache service applies them: LeaseOps's lists, the
# LeaseRequest's ops (cache/client.py) and LeaseAnswer's outcomes all follow it.
KINDS = ("forks", "releases", "truncates", "extends", "commits", "allocations", "top_ups")


@dataclass(frozen=True, slots=True)
class Refused:
    """An op the cache service refused; the others of its call went on."""

    code: str  # NO_FREE_BLOCKS, NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT, LIMIT_EXCEEDED
    message: str = ""


@dataclass(frozen=True, slots=True)
class Forked:
    lease_id: int  # the child's
    block_ids: tuple[int, ...]
    copy: tuple[int, int] | None = None  # (src_block, dst_block): the parent's partial last block to copy


@dataclass(frozen=True, slots=True)
class Released:
    pass


@dataclass(frozen=True, slots=True)
class Extended:
    block_ids: tuple[int, ...] = ()  # only the blocks appended (an extend or a top-up)


@dataclass(frozen=True, slots=True)
class Committed:
    pass


@dataclass(frozen=True, slots=True)
class Allocated:
    lease_id: int
    block_ids: tuple[int, ...]
    cached_tokens: int = 0  # leading prompt tokens the prefix cache already holds
    # Of cached_tokens: promoted from the host, the disk, the remote tier.
    cached_tokens_tiers: tuple[int, int, int] = (0, 0, 0)


# What each kind of op is answered with when it succeeds (Refused when it does not).
OUTCOME_TYPES = {"forks": Forked, "releases": Released, "truncates": Released, "extends": Extended,
                 "commits": Committed, "allocations": Allocated, "top_ups": Extended}


@dataclass(frozen=True, slots=True)
class LeaseAnswer:
    """The cache service's answer to one LeaseOps: each kind's outcomes in its ops' order,
    stripped of protobuf. `check` pairs it with the ops it answers."""

    forks: tuple[Forked | Refused, ...] = ()
    releases: tuple[Released | Refused, ...] = ()
    truncates: tuple[Released | Refused, ...] = ()
    extends: tuple[Extended | Refused, ...] = ()
    commits: tuple[Committed | Refused, ...] = ()
    allocations: tuple[Allocated | Refused, ...] = ()
    top_ups: tuple[Extended | Refused, ...] = ()
    blocks_available: int = 0

    @classmethod
    def of(cls, ops: LeaseOps, outcomes: Iterable[object], blocks_available: int) -> LeaseAnswer:
        """The answer whose outcomes, in KINDS order, are `outcomes`; LeaseLost unless they fit `ops`."""
        outcomes = list(outcomes)
        if len(outcomes) != len(ops):
            raise LeaseLost(f"the cache service answered {len(outcomes)} ops of {len(ops)}")
        by_kind, start = {}, 0
        for kind in KINDS:
            end = start + len(getattr(ops, kind))
            by_kind[kind] = tuple(outcomes[start:end])
            start = end
        answer = cls(**by_kind, blocks_available=blocks_available)
        answer.check(ops)
        return answer

    def check(self, ops: LeaseOps) -> None:
        """LeaseLost unless each kind has one outcome per op, each of the kind's type or Refused."""
        for kind in KINDS:
            outcomes, expected = getattr(self, kind), OUTCOME_TYPES[kind]
            if len(outcomes) != len(getattr(ops, kind)):
                raise LeaseLost(f"the cache service answered {len(outcomes)} {kind} ops of {len(getattr(ops, kind))}")
            for outcome in outcomes:
                if type(outcome) is not expected and type(outcome) is not Refused:
                    raise LeaseLost(f"one of the {kind} ops was answered with {type(outcome).__name__}, "
                                    f"not {expected.__name__} or Refused")

    def outcomes(self) -> Iterator[object]:
        """Every outcome, in KINDS order."""
        for kind in KINDS:
            yield from getattr(self, kind)


class LeaseLost(RuntimeError):
    """The cache service no longer knows our session or a sequence: re-attach."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
