"""How a lease call's answer changes the scheduler's sequences: blocks given (allocations,
forks, extends, top-ups) join their tables and the tenant counts; refusals requeue, starve
or fail a sequence, and a refused allocation is asked again only after the policy's
backoff (policy.py).

A part of Scheduler (scheduler.py), in a file of its own because it is the one place
where the cache service's answers enter the scheduler's state: `LeaseAnswers` reads and
writes the queues and counts that Scheduler.__init__ sets up, tells its policy of the
allocations granted and refused, and touches nothing else.
"""

from __future__ import annotations

from model_service.sched.lease_ops import (
    Allocated, Extended, Forked, ForkRequest, LeaseAnswer, LeaseLost, LeaseOps, Refused, Release,
)
from model_service.sched.sequence import Sequence, Status


class LeaseAnswers:
    def apply(self, ops: LeaseOps, answer: LeaseAnswer) -> list[tuple[Sequence, str]]:
        """Applies a lease call's answer; returns sequences that can never be served.
        Releases and commits need nothing: a release of a lease the service already
        reclaimed is harmless, and a refused commit's blocks are registered at release."""
        answer.check(ops)
        self.blocks_available = answer.blocks_available
        failed: list[tuple[Sequence, str]] = []
        for fork, outcome in zip(ops.forks, answer.forks):
            self._forked(fork, outcome)
        for (seq, _), outcome in zip(ops.truncates, answer.truncates):
            if type(outcome) is Refused:  # its table here is already cut: the two no longer agree
                raise LeaseLost(f"truncate of request {seq.request_id} failed: {outcome.code} {outcome.message}")
        for (seq, _), outcome in zip(ops.extends, answer.extends):
            self._extended(seq, outcome, failed)
        requeue: list[Sequence] = []
        for seq, outcome in zip(ops.allocations, answer.allocations):
            self._allocated(seq, outcome, failed, requeue)
        for (seq, _), outcome in zip(ops.top_ups, answer.top_ups):
            # Refused: the sequence asks again when it needs the block; ended meanwhile:
            # its lease's release gives it back.
            if type(outcome) is Extended and seq.status is Status.RUNNING:
                seq.block_table.extend(outcome.block_ids)
                self._grew(seq, outcome.block_ids)
        # Back to the front, in their original order: first come, first served.
        self.waiting.extendleft(reversed(requeue))
        return failed

    def _forked(self, fork: ForkRequest, outcome: Forked | Refused) -> None:
        self.allocating -= 1
        child = fork.child
        if type(outcome) is Forked:
            if outcome.copy is not None:
                self._copies.append(outcome.copy)
            if child.status is Status.FINISHED:  # ended while its fork was in flight
                self._releases.add(Release(outcome.lease_id, ()), urgent=True)
                return
            child.lease_id = outcome.lease_id
            child.block_table = list(outcome.block_ids)
            child.num_computed = fork.parent_tokens
            child.ever_computed = max(child.ever_computed, fork.parent_tokens)
            self._grew(child, outcome.block_ids)
            child.admitted_once = True
            child.ready_step = self.steps
            child.status = Status.RUNNING
            self.running.append(child)
        elif child.status is not Status.FINISHED:
            # No block for the copy, or the parent's lease is gone: recompute instead.
            self._queue_unforked(child)

    def _extended(self, seq: Sequence, outcome: Extended | Refused, failed: list[tuple[Sequence, str]]) -> None:
        if type(outcome) is Extended:
            if seq.status is not Status.RUNNING:
                return  # ended since the call went out: its lease's release gives these back too
            seq.block_table.extend(outcome.block_ids)
            seq.starved = False
            self._grew(seq, outcome.block_ids)
        elif outcome.code == "NO_FREE_BLOCKS":
            seq.starved = True
        elif outcome.code == "LIMIT_EXCEEDED":
            # The session's block quota, not the pool: room is made by preempting
            # another of this session's sequences, and when none holds blocks this one
            # alone is past the quota and can never finish.
            if any(other is not seq for other in self.running):
                seq.starved = True
            else:
                failed.append((seq, f"{outcome.code}: {outcome.message}"))
        else:
            raise LeaseLost(f"extend of request {seq.request_id} failed: {outcome.code} {outcome.message}")

    def _allocated(self, seq: Sequence, outcome: Allocated | Refused, failed: list[tuple[Sequence, str]],
                   requeue: list[Sequence]) -> None:
        self.allocating -= 1
        self._allocations.remove(seq)
        self._allocating_children -= len(seq.fork_children)
        if type(outcome) is Allocated:
            seq.lease_id = outcome.lease_id
            if seq.status is Status.FINISHED:  # cancelled while its allocation was in flight
                self._releases.add(Release(outcome.lease_id, ()), urgent=True)
                seq.lease_id = None
                return
            seq.block_table = list(outcome.block_ids)
            seq.num_computed = outcome.cached_tokens
            seq.ever_computed = max(seq.ever_computed, outcome.cached_tokens)
            self._grew(seq, outcome.block_ids)
            seq.committed_tokens = outcome.cached_tokens - outcome.cached_tokens % self.limits.block_size
            if not seq.admitted_once:
                seq.cached_tokens = outcome.cached_tokens
                seq.cached_tokens_tiers = outcome.cached_tokens_tiers
                seq.admitted_once = True
            seq.ready_step = self.steps
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.policy.granted()
        elif seq.status is Status.FINISHED:
            return
        elif outcome.code == "NO_FREE_BLOCKS" or (outcome.code == "LIMIT_EXCEEDED" and self._others_hold_blocks()):
            # Past the session's quota only while others hold blocks: wait for them.
            seq.status = Status.WAITING
            requeue.append(seq)
            self.policy.refused(past_quota=outcome.code == "LIMIT_EXCEEDED")
        else:
            failed.append((seq, f"{outcome.code}: {outcome.message}"))

    def _grew(self, seq: Sequence, block_ids: tuple[int, ...]) -> None:
        """A lease call's answer gave `seq` these blocks (now in its table)."""
        if len(seq.block_table) > seq.peak_blocks:
            seq.peak_blocks = len(seq.block_table)
        self.tenant_blocks.hold(seq.tenant, block_ids)
        if seq.lora is not None:
            self.adapter_blocks.hold(seq.lora.name, block_ids)
