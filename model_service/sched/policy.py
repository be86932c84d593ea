"""The scheduling policy: who is admitted next and when admission stops for a step, which
prompts get their chunks first, and who is preempted when a sequence has no block.

Policies: `fcfs` admits by arrival and preempts the newest; `priority` admits by
(priority, arrival) and preempts the lowest priority (largest number), newest first.
Under either, tenants with a share of the pool (`tenant_kv_blocks`, from --api-keys
`kv_blocks`) may hold more while there is room, but a tenant past its share is preempted
before any other, and its waiting sequences that would put it past its share are
admitted only after every other tenant's that can be (tenant_blocks.py keeps the counts).

A waiting prompt whose leading full blocks another sequence is still computing is held
back until they are committed (`prefix_hold_min_tokens`, inflight_prefixes.py): admitted
then, it finds them cached instead of computing them beside that sequence.

Admission stops at the first sequence that does not fit: in the seats (--max-num-seqs, a
request's n completions counted together), in the blocks the scheduler counts free, or in
the step's prompt tokens. When nothing else runs it asks for the blocks anyway (cached
blocks may be evictable), but after a refusal not again until a wait has passed.

Apart from Scheduler (scheduler.py) because it decides and the scheduler carries out: this
orders and picks sequences, the scheduler moves them between its queues, sets their
states and writes the lease ops. The one thing of the scheduler's it changes is `waiting`,
from which `admit` takes the sequences it admits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from model_service.sched.inflight_prefixes import BlockChains, InflightPrefixes
from model_service.sched.lease_ops import blocks_for
from model_service.sched.limits import POLICIES, SchedulerLimits
from model_service.sched.sequence import Sequence
from model_service.sched.tenant_blocks import TenantBlocks

# When nothing runs, an allocation the service refused is asked again only after this
# wait, doubling up to the cap: the blocks it lacks come back only when another
# session releases some, and asking every step would send thousands of calls a second.
RETRY_REFUSED_MIN_S = 0.01
RETRY_REFUSED_MAX_S = 0.5


class SchedulingPolicy:
    def __init__(self, limits: SchedulerLimits, name: str, tenant_blocks: TenantBlocks,
                 clock: Callable[[], float]) -> None:
        if name not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.limits = limits
        self.name = name
        self.tenant_blocks = tenant_blocks  # the scheduler's: read for the shares, never written
        self._clock = clock
        self._retry_refused_at = 0.0
        self._quota_retry_at = 0.0  # no allocation asked before this, after one past the session's quota
        self._retry_refused_wait = 0.0
        self._block_chains = BlockChains(limits.block_size)  # what InflightPrefixes hashed, kept

    def _order(self, seq: Sequence) -> tuple[int, int, int]:
        """Who goes first: admission takes the smallest, preemption the largest."""
        if self.name == "priority":
            return (seq.priority, seq.arrival, seq.index)
        return (0, seq.arrival, seq.index)

    def _victim_order(self, seq: Sequence) -> tuple[bool, int, int, int]:
        """Preemption takes the largest: a tenant past its share first."""
        return (self.tenant_blocks.over_share(seq.tenant), *self._order(seq))

    def victim(self, running: list[Sequence]) -> Sequence:
        """The running sequence to preempt for room."""
        return max(running, key=self._victim_order)

    def prefill_order(self, running: list[Sequence]) -> list[Sequence]:
        """Running sequences with prompt tokens to compute, in the order they get chunks:
        fewest tokens left first, which brings the most first tokens soonest (TTFT), less
        `prefill_aging_tokens` for each step a prompt has waited since it was ready, so a
        later prompt overtakes one only if it is that much shorter, and none waits forever.
        Under the priority policy, by priority first. First come, first chunked gave later
        median first tokens under steady load, and shortest first unaged later last ones
        in a burst (bench/engine/sched_sim.py compares the orders).
        """
        aging = self.limits.prefill_aging_tokens
        prefills = [seq for seq in running if seq.num_uncomputed > 1]
        return sorted(prefills, key=lambda seq: (seq.priority if self.name == "priority" else 0,
                                                 seq.num_uncomputed + aging * seq.ready_step,
                                                 seq.arrival, seq.index))

    def prefill_capped(self, decoding: int, prompts: int) -> bool:
        """Whether a step's prompt tokens stay within max_prefill_tokens_while_decoding. The
        cap shortens the steps that `decoding` streams each wait for; while more prompts
        wait for their first token, a long step holds up fewer streams than it brings first
        tokens to, so the step takes its whole budget. Streams started in one burst then end
        together, and the next burst of prompts is computed before they decode, as vLLM's
        batches run, rather than a cap's chunk at a time beside the few still decoding
        (docs/benchmark-log.md, "The prefill cap in a burst")."""
        return bool(decoding and self.limits.max_prefill_tokens_while_decoding and prompts <= decoding)

    def _next_waiting(self, waiting: deque[Sequence], admitted: dict[str, int],
                      prefixes: InflightPrefixes) -> Sequence | None:
        """The waiting sequence to admit next, None when every one waits for a prefix
        another sequence is computing (`prefixes`). With tenant shares, one whose tenant
        would pass its share (counting `admitted`, the blocks it was given this step) goes
        after every other tenant's."""
        if not self.tenant_blocks.shares and self.name == "fcfs":
            return next((seq for seq in waiting if not prefixes.holds(seq)), None)
        waiting = [seq for seq in waiting if not prefixes.holds(seq)]
        if not waiting:
            return None
        if not self.tenant_blocks.shares:
            return min(waiting, key=self._order)
        block_size = self.limits.block_size
        over_share = self.tenant_blocks.over_share

        def deferred(seq: Sequence) -> bool:
            return over_share(seq.tenant, admitted.get(seq.tenant, 0) + blocks_for(len(seq.token_ids), block_size))

        if self.name == "fcfs":  # the queue's order: preempted sequences are at its front
            return next((seq for seq in waiting if not deferred(seq)), waiting[0])
        return min(waiting, key=lambda seq: (deferred(seq), *self._order(seq)))

    def admit(self, waiting: deque[Sequence], running: list[Sequence], allocating: list[Sequence],
              seats: int, busy: bool, available: int) -> tuple[list[Sequence], int]:
        """Takes the sequences to admit off `waiting` while seats and blocks last; returns
        them, in order, and the blocks left of `available`. `seats`: those taken already;
        `busy`: whether a sequence runs or is being given blocks (`allocating`: the
        allocations in flight)."""
        block_size = self.limits.block_size
        prompt_tokens = 0
        taken: list[Sequence] = []
        admitted: dict[str, int] = {}  # blocks given to each tenant's sequences in this call
        prefixes = InflightPrefixes(self._block_chains, self.limits.prefix_hold_min_tokens)
        if waiting:
            prefixes.track(running)
            prefixes.track(allocating)
        while waiting:
            seq = self._next_waiting(waiting, admitted, prefixes)
            if seq is None:
                break
            wanted = 1 + len(seq.fork_children)
            # An n-request bigger than --max-num-seqs runs alone rather than never.
            if seats + wanted > self.limits.max_num_seqs and (busy or seats):
                break
            needed = blocks_for(len(seq.token_ids), block_size)
            # When nothing else runs, ask anyway: cached blocks may be evictable, and the
            # service's reply corrects our count; but not again right after a refusal.
            if needed > available and (busy or self._clock() < self._retry_refused_at):
                break
            if busy and self._clock() < self._quota_retry_at:
                break
            if prompt_tokens and prompt_tokens + len(seq.token_ids) > self.limits.max_batch_tokens:
                break
            waiting.remove(seq)
            taken.append(seq)
            busy = True  # it is being given blocks now
            seats += wanted
            prefixes.track((seq,))
            available -= needed
            admitted[seq.tenant] = admitted.get(seq.tenant, 0) + needed
            prompt_tokens += len(seq.token_ids)
        return taken, available

    def granted(self) -> None:
        """An allocation was granted: the next refusal waits the least again."""
        self._retry_refused_wait = 0.0

    def refused(self, past_quota: bool) -> None:
        """An allocation was refused, for want of blocks or past the session's quota: no
        allocation is asked again before a wait, doubling up to RETRY_REFUSED_MAX_S."""
        self._retry_refused_wait = min(max(2 * self._retry_refused_wait, RETRY_REFUSED_MIN_S), RETRY_REFUSED_MAX_S)
        self._retry_refused_at = self._clock() + self._retry_refused_wait
        if past_quota:
            # The pool's count says nothing of the quota: wait as after a refusal.
            self._quota_retry_at = self._retry_refused_at
