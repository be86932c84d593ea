"""The cache service in process, for scheduler tests: the real Ledger behind the real
mapping of lease ops, without the channel.

A step's LeaseOps go through model_service.cache.client's `to_proto_ops`, each op through
what the servicer's Lease does with it (`apply_proto_op`: cache_service/api/wire.py's
mappings around core/lease_ops.py's `apply_op` on a `Ledger`), each result back through
`answer_from_proto`: what the engine's Lease call does, less gRPC. What the adapter keeps
itself is only what tests count (calls, forks, top-ups, commits, the session's live
leases) and "another session" that holds or takes blocks.

    cache = LedgerCache(num_blocks=10)
    answer = cache.answer(step.lease_ops)
"""

from __future__ import annotations

from cache_service.api import wire
from cache_service.core.lease_ops import apply_op
from cache_service.core.ledger import Ledger, SessionLimits
from model_service.cache.client import answer_from_proto, to_proto_ops
from model_service.sched.lease_ops import LeaseAnswer, LeaseOps
from pagedkv.cache.v1 import cache_pb2

BLOCK = 4
OWNER = "engine#1"  # the scheduler's session
OTHER = "other#2"  # another session on the same pool
FINGERPRINT = "test-model"


def apply_proto_op(ledger: Ledger, owner: str, op: cache_pb2.LeaseOp, fingerprint: str = "") -> cache_pb2.LeaseResult:
    """One LeaseOp as the servicer's Lease applies it: decoded, applied, its outcome encoded."""
    return wire.lease_result(apply_op(ledger, owner, wire.lease_op(op), fingerprint))


class LedgerCache:
    def __init__(self, num_blocks: int, session_max_blocks: int = 0, held_by_another: int = 0) -> None:
        """A pool of `num_blocks` (the first `held_by_another` leased to another session);
        `session_max_blocks`: the scheduler's session's quota (--max-session-blocks; 0: none)."""
        limits = SessionLimits(max_blocks=session_max_blocks) if session_max_blocks else SessionLimits()
        self.ledger = Ledger(num_blocks, BLOCK, limits=limits)
        self.leases: set[int] = set()  # the scheduler's session's live sequences
        self.calls = 0
        self.forks = 0
        self.top_ups = 0
        self.refuse_top_ups = False  # another session takes every free block before top-ups
        self.commits: list[tuple[str, int]] = []  # (request id, tokens) of each commit op
        self._others: list[int] = []
        if held_by_another:
            self._others.append(self.ledger.allocate(OTHER, held_by_another * BLOCK, (), (FINGERPRINT, "")).sequence_id)

    def answer(self, ops: LeaseOps) -> LeaseAnswer:
        self.calls += 1
        self.commits += [(seq.request_id, tokens) for seq, tokens in ops.commits]
        proto_ops = to_proto_ops(ops)
        needed = len(proto_ops) - len(ops.top_ups)
        results = [self._apply(op) for op in proto_ops[:needed]]
        if ops.top_ups:
            self.top_ups += len(ops.top_ups)
            if self.refuse_top_ups:
                self._take_everything()
            results += [self._apply(op) for op in proto_ops[needed:]]
            if self.refuse_top_ups:
                self.release_others()
        self.ledger.check_invariants()
        return answer_from_proto(ops, proto_ops, results, self.ledger.blocks_available())

    def _apply(self, op: cache_pb2.LeaseOp) -> cache_pb2.LeaseResult:
        result = apply_proto_op(self.ledger, OWNER, op, FINGERPRINT)
        kind = op.WhichOneof("op")
        if result.status == cache_pb2.LEASE_STATUS_OK:
            if kind in ("allocate", "fork"):
                self.leases.add(result.sequence_id)
                self.forks += kind == "fork"
            elif kind == "release":
                self.leases.discard(result.sequence_id)
        return result

    def available(self) -> int:
        """Blocks free or evictable (cached): what an allocation could take now."""
        return self.ledger.blocks_available()

    def leased(self) -> int:
        """Blocks leased by any session, a shared block once."""
        return self.ledger.stats().blocks_leased

    def _take_everything(self) -> None:
        available = self.ledger.blocks_available()
        if available:
            self._others.append(self.ledger.allocate(OTHER, available * BLOCK, (), (FINGERPRINT, "")).sequence_id)

    def release_others(self) -> None:
        """Another session gives back every block it holds."""
        for sequence_id in self._others:
            self.ledger.release(OTHER, sequence_id)
        self._others = []
