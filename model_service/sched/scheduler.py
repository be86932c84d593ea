"""Continuous batching: who runs this step, who is admitted, who is preempted.

Pure Python, no tensors and no gRPC. The engine calls, once per step:

    scheduler.apply(ops, answer)                       # the answer to last step's lease call
    step = scheduler.schedule()                        # this step's batch + next step's lease ops
    ...                                                # the runner executes it, the sampler samples
    finished = scheduler.update_from_output(step, output)

update_from_output is the one place where a step's results are written into its
sequences (tokens computed, forks, sampled tokens, EOS / stop token / length): only the
scheduler writes a Sequence. Requests that end for other reasons (a stop string, a
cancel, a deadline) are told with finish().

The lease ops of step t are sent while step t's forward pass runs, so they provide what
step t+1 needs: blocks for the next token of every sequence in this batch (only when it
crosses a block boundary), block tables for newly admitted sequences, and releases of
what finished, was cancelled or was preempted. The cache service is the authority on
free blocks; `blocks_available` from its last reply is only used to avoid asking for
what cannot be had.

A call that goes out anyway also leases decoding sequences `lookahead_tokens` ahead of
need, and a normally finished sequence's release may wait up to `release_hold_s` for such
a call (lease_ahead.py): about one call every block_size steps at 48 streams, instead of
nearly one a step.

Who is admitted, which prompts get chunks first and who is preempted is the policy's
choice (policy.py: `fcfs` or `priority`, tenants' shares of the pool, prompts held back
while another sequence computes their prefix); the scheduler carries its choices out.

A tenant with a compute budget (`tenant_budgets`, from --api-keys `max_tokens_per_s`) runs
only the tokens its bucket holds: past it, its sequences are skipped in a step, neither
preempted nor failed (tenant_budgets.py).

A request with n completions is admitted as its completion 0, holding seats for all n.
Once completion 0 has prefilled the prompt and sampled its first token (the engine
samples the others' first tokens from the same logits row), `fork` queues one fork op
per other completion: each shares the prompt's full blocks (ref counted) and gets a copy
of the partial last one, which the engine makes (`take_copies`) before the next forward
pass. A completion that cannot fork (no block, or completion 0 gone) is queued as an
ordinary sequence and recomputes its prompt; its own preemption works the same way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping

from model_service.sched.lease_ahead import PendingReleases, top_ups
from model_service.sched.lease_answers import LeaseAnswers
from model_service.sched.lease_ops import ForkRequest, LeaseOps, Release, blocks_for
from model_service.sched.limits import POLICIES, SchedulerLimits
from model_service.sched.policy import SchedulingPolicy
from model_service.sched.sequence import Finish, Sequence, Status
from model_service.sched.step import Finished, Step, StepOutput, append_token
from model_service.sched.spec_tails import truncation
from model_service.sched.tenant_blocks import TenantBlocks
from model_service.sched.tenant_budgets import ComputeBudget, TenantBudgets
from model_service.spec.speculator import Speculator


__all__ = ["POLICIES", "Scheduler", "SchedulerLimits"]


class Scheduler(LeaseAnswers):
    """The queues and one step's choices; how lease answers change them is LeaseAnswers'
    (lease_answers.py)."""

    def __init__(self, limits: SchedulerLimits, blocks_available: int, policy: str = "fcfs",
                 clock=time.monotonic, eos_token_ids: Collection[int] = (),
                 tenant_kv_blocks: Mapping[str, int] | None = None, speculator: Speculator | None = None,
                 tenant_budgets: Mapping[str, ComputeBudget] | None = None) -> None:
        self.limits = limits
        self.speculator = speculator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.allocating: int = 0  # allocate and fork ops in flight
        self._allocations: list[Sequence] = []  # the sequences of the allocate ops in flight
        self._allocating_children = 0  # completions that will fork from sequences allocating
        self.blocks_available = blocks_available
        self._releases = PendingReleases(limits.release_hold_s, clock)
        self._forks: list[ForkRequest] = []
        self._copies: list[tuple[int, int]] = []
        self._rejected: list[Sequence] = []  # speculating sequences whose last proposal was cut short
        self.preemptions = 0
        self.steps = 0  # schedule() calls so far: how long a prompt has waited (policy.prefill_order)
        self.tenant_blocks = TenantBlocks(tenant_kv_blocks)
        self.budgets = TenantBudgets(tenant_budgets, clock)
        # The same count by LoRA adapter name (no shares: for its metric only).
        self.adapter_blocks = TenantBlocks()
        self.policy = SchedulingPolicy(limits, policy, self.tenant_blocks, clock)  # policy.py

    # -- requests come and go -------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new request's first sequence; its fork_children wait to fork from it."""
        seq.status = Status.WAITING
        for child in seq.fork_children:
            child.status = Status.FORK_PENDING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: Finish) -> None:
        """Ends a sequence in any state; its blocks are released with the next lease call."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            # A cancel or an abort frees its blocks with the next step's call, as promised.
            self._release(seq, urgent=reason is Finish.ABORTED)
        # ALLOCATING, FORKING: released when the op's result arrives (see apply).
        # FORK_PENDING: holds nothing; a fork asked for it is dropped (see schedule).
        seq.status = Status.FINISHED
        if self.speculator is not None:
            self.speculator.finished(seq)
        seq.finish = reason

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._releases or self.allocating or self._forks)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Completion 0 sampled its first token (and its children theirs): fork its
        blocks for them with the next lease call."""
        parent.fork_children = []
        for child in children:
            if child.status is Status.FINISHED:
                continue
            if parent.lease_id is None:
                self._queue_unforked(child)
            else:
                self._forks.append(ForkRequest(parent.lease_id, parent.num_computed, child))

    def take_copies(self) -> list[tuple[int, int]]:
        """(src_block, dst_block) copies the last lease call's forks need, to make before
        the next forward pass writes into the copies."""
        copies, self._copies = self._copies, []
        return copies

    def _queue_unforked(self, child: Sequence) -> None:
        child.status = Status.WAITING
        self.waiting.appendleft(child)

    def seats_taken(self) -> int:
        """Sequences running or on their way, and the completions that will fork from them."""
        pending_children = sum(len(seq.fork_children) for seq in self.running) + self._allocating_children
        return len(self.running) + self.allocating + len(self._forks) + pending_children

    def _release(self, seq: Sequence, urgent: bool) -> None:
        if seq.lease_id is not None:
            self._releases.add(Release(seq.lease_id, tuple(seq.token_ids[: seq.num_computed]),
                                       len(seq.block_table)), urgent)
        self.tenant_blocks.drop(seq.tenant, seq.block_table)
        if seq.lora is not None:
            self.adapter_blocks.drop(seq.lora.name, seq.block_table)
        seq.drop_blocks()

    def preempt(self, seq: Sequence) -> None:
        """Gives a running sequence's blocks back and queues it first for recompute.

        Its computed tokens are released as prefix cache, so unless they are evicted in
        the meantime the recompute finds them and costs little.
        """
        self.running.remove(seq)
        self._release(seq, urgent=True)  # the pool is short: that is why it was preempted
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # -- a step's results -------------------------------------------------------------

    def update_from_output(self, step: Step, output: StepOutput) -> list[Finished]:
        """Writes a step's results into its sequences: the tokens the forward pass
        computed, the forks of completions whose first token was sampled, the sampled
        tokens, and the ends they made (their blocks go back with the next lease call).
        Returns the sequences that ended."""
        for seq, new_tokens in step.batch:
            self.budgets.charge(seq.tenant, new_tokens)
            start = seq.num_computed
            # A proposal's positions count as computed only as their tokens are kept (below).
            seq.num_computed = start + new_tokens - len(step.proposals.get(seq, ()))
            if start < seq.ever_computed:  # back over what a preemption gave away
                seq.recomputed_tokens += min(seq.num_computed, seq.ever_computed) - start
            seq.ever_computed = max(seq.ever_computed, seq.num_computed)
        for seq in output.prompt_logprobs_done:
            seq.reuse_prefix = True
        finished: list[Finished] = []
        for seq, proposal in step.proposals.items():
            if self.speculator is not None:
                kept = sum(1 for s, _ in output.sampled if s is seq)
                self.speculator.settle(seq, len(proposal), max(kept - 1, 0))
                if kept <= len(proposal):
                    self._rejected.append(seq)
        verified: set[Sequence] = set()
        for seq, token in output.sampled:
            if seq.status is Status.FINISHED:
                continue
            if seq.fork_children and seq.num_output == 0:
                # Before its token is appended: the children fork the prompt's blocks,
                # and each appends the first token it sampled from the same row.
                self.fork(seq, seq.fork_children)
            if seq in step.proposals:
                if seq in verified:
                    # A token after the first kept: the one before it was a proposal, whose
                    # K/V this step computed.
                    seq.num_computed += 1
                    seq.ever_computed = max(seq.ever_computed, seq.num_computed)
                verified.add(seq)
            ended = append_token(seq, token, self.eos_token_ids, self.limits.max_model_len)
            if ended is not None:
                self.finish(seq, ended.reason)
                finished.append(ended)
        return finished

    # -- one step ---------------------------------------------------------------------

    def _proposals(self, decodes: list[Sequence], budget: int) -> dict[Sequence, list[int]] | None:
        """What each decoding sequence proposes this step (Speculator.proposals), a tenant's
        spare tokens bounding its sequences' proposals; None when none were looked up."""
        if self.speculator is None or not self.speculator.looks_up(len(decodes)):
            return None
        return self.speculator.proposals(decodes, budget, lambda seq, most: self.budgets.spare(seq.tenant, most))

    def schedule(self) -> Step:
        block_size = self.limits.block_size
        preempted = self._relieve_starvation()
        truncates = self._truncate_rejected()

        budget = self.limits.max_batch_tokens
        batch: list[tuple[Sequence, int]] = []
        # Tenants past their compute budget (tenant_budgets.py) skip this step, keeping their blocks.
        self.budgets.open_step()
        decodes = [s for s in self.running
                   if s.num_uncomputed == 1 and not s.starved and s.capacity(block_size) > s.num_computed]
        proposals: dict[Sequence, list[int]] = {}
        decodes = [seq for seq in decodes[:budget] if self.budgets.grant(seq.tenant, 1)]
        budget -= len(decodes)
        speculating: list[tuple[Sequence, int]] = []
        wanted = self._proposals(decodes, budget)
        looked_up = wanted is not None
        for seq in decodes:
            proposal = wanted.get(seq, [])[:self.budgets.spare(seq.tenant, budget)] if looked_up else []
            if proposal:
                # After the plain decodes: the attention's decode rows lead the batch.
                proposals[seq] = proposal
                speculating.append((seq, 1 + len(proposal)))
                budget -= len(proposal)
                self.budgets.take(seq.tenant, len(proposal))
            else:
                batch.append((seq, 1))
        batch.extend(speculating)
        prefills = self.policy.prefill_order(self.running)
        if self.policy.prefill_capped(decoding=len(batch), prompts=len(prefills) + len(self.waiting)):
            budget = min(budget, self.limits.max_prefill_tokens_while_decoding)
        for seq in prefills:
            if budget <= 0:
                break
            chunk = self.budgets.grant(seq.tenant, min(seq.num_uncomputed, budget), least=block_size)
            if chunk:
                batch.append((seq, chunk))
                budget -= chunk
        self.steps += 1

        ops = LeaseOps(truncates=truncates)
        for fork in self._forks:
            if fork.child.status is Status.FINISHED:
                continue
            fork.child.status = Status.FORKING
            self.allocating += 1
            ops.forks.append(fork)
        self._forks = []
        in_batch = {id(seq) for seq, _ in batch}
        for seq, new_tokens in batch:
            # After this step, the next one writes position num_computed + new_tokens.
            needed = seq.num_computed + new_tokens + 1
            if needed > seq.capacity(block_size):
                ops.extends.append((seq, needed))
        for seq in self.running:
            # Starved, or forked with a table that ends where the prompt does.
            if seq.starved or (id(seq) not in in_batch and seq.capacity(block_size) < len(seq.token_ids)):
                ops.extends.append((seq, len(seq.token_ids)))
        # An estimate; the service's count comes with its reply.
        available = self.blocks_available + self._releases.blocks() - sum(
            blocks_for(tokens, block_size) - len(seq.block_table) for seq, tokens in ops.extends
        )
        available = self._admit(ops, available)
        if ops or not self._releases.may_wait(others_run=bool(self.running), someone_waits=bool(self.waiting)):
            ops.releases = self._releases.take()
        if ops:
            ops.commits = self._commits_due()
        if ops and self.limits.lookahead_tokens and not self.waiting:  # no blocks ahead while others wait
            ops.top_ups = top_ups(batch, ops.extends, available, block_size, self.limits.lookahead_tokens,
                                  self.limits.max_model_len)
        return Step(batch=batch, lease_ops=ops, preempted=preempted, proposals=proposals,
                    deferred=self.budgets.close_step(), looked_up=looked_up)

    def _truncate_rejected(self) -> list[tuple[Sequence, int]]:
        """Cuts the tables that rejected proposals left holding whole blocks past their
        need; returns the TruncateOps that give those blocks back (none when the cache
        service has no TruncateOp)."""
        rejected, self._rejected = self._rejected, []
        if not self.limits.truncate_tables:
            return []
        block_size = self.limits.block_size
        # The blocks ahead that top-ups would lease again at once stay (none while others wait).
        lookahead = 0 if self.waiting else self.limits.lookahead_tokens
        truncates = []
        for seq in rejected:
            if seq.status is not Status.RUNNING or seq.lease_id is None:
                continue
            tokens = truncation(seq, block_size, lookahead, self.limits.max_model_len)
            if tokens is not None:
                keep = blocks_for(tokens, block_size)
                self.tenant_blocks.drop(seq.tenant, seq.block_table[keep:])
                del seq.block_table[keep:]
                truncates.append((seq, tokens))
        return truncates

    def _others_hold_blocks(self) -> bool:
        """Whether this session holds blocks at the cache service that will come back: a
        sequence runs or is being given blocks, or a release waits to be sent."""
        return bool(self.running or self.allocating or self._releases)

    def _commits_due(self) -> list[tuple[Sequence, int]]:
        """Running sequences with full blocks computed since their last commit: committed in
        a call that goes out anyway, so that a request arriving while they run shares them.
        Computed means enqueued on the device: the engine waits for those writes to land
        before it sends a call that carries commits or releases (ModelRunner.wait_for_writes)."""
        block_size = self.limits.block_size
        due = []
        for seq in self.running:
            full = seq.num_computed - seq.num_computed % block_size
            if full > seq.committed_tokens:
                due.append((seq, full))
                seq.committed_tokens = full
        return due

    def _relieve_starvation(self) -> list[Sequence]:
        """A sequence with no block for its next token frees room by preempting the policy's victim."""
        preempted: list[Sequence] = []
        for seq in [s for s in self.running if s.starved]:
            if seq.status is not Status.RUNNING:
                continue  # preempted already, as someone's victim
            victim = self.policy.victim(self.running)
            self.preempt(victim)
            preempted.append(victim)
        return preempted

    def _admit(self, ops: LeaseOps, available: int) -> int:
        """Admits the waiting sequences the policy takes while seats and blocks last; returns
        the blocks left."""
        taken, available = self.policy.admit(self.waiting, self.running, self._allocations, self.seats_taken(),
                                             bool(self.running or self.allocating), available)
        for seq in taken:
            seq.status = Status.ALLOCATING
            self.allocating += 1
            self._allocating_children += len(seq.fork_children)
            ops.allocations.append(seq)
            self._allocations.append(seq)
        return available
