"""The scheduler alone: pure Python, with a fake cache service answering its lease ops."""

from __future__ import annotations

import itertools
from collections import deque

import pytest

from model_service.sampling import SamplingOptions
from model_service.scheduler import LeaseLost, LeaseOutcome, Scheduler, SchedulerLimits, blocks_for
from model_service.sequence import Finish, Sequence, Status

BLOCK = 4


class FakeCache:
    """A block pool with just enough behaviour to answer lease ops like the real one."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.ids = itertools.count(1)
        self.calls = 0

    def answer(self, ops) -> tuple[list[LeaseOutcome], int]:
        self.calls += 1
        outcomes = []
        for release in ops.releases:
            self.free.extend(self.tables.pop(release.lease_id))
            outcomes.append(LeaseOutcome(ok=True))
        for seq, tokens in ops.extends:
            table = self.tables[seq.lease_id]
            more = blocks_for(tokens, BLOCK) - len(table)
            if more > len(self.free):
                outcomes.append(LeaseOutcome(ok=False, code="NO_FREE_BLOCKS"))
                continue
            new = [self.free.pop() for _ in range(more)]
            table.extend(new)
            outcomes.append(LeaseOutcome(ok=True, block_ids=tuple(new)))
        for seq in ops.allocations:
            need = blocks_for(len(seq.token_ids), BLOCK)
            if need > len(self.free):
                outcomes.append(LeaseOutcome(ok=False, code="NO_FREE_BLOCKS"))
                continue
            lease_id = next(self.ids)
            self.tables[lease_id] = [self.free.pop() for _ in range(need)]
            outcomes.append(LeaseOutcome(ok=True, lease_id=lease_id, block_ids=tuple(self.tables[lease_id])))
        return outcomes, len(self.free)


def make_seq(arrival: int, prompt_len: int, max_new: int = 8) -> Sequence:
    return Sequence(request_id=f"r{arrival}", token_ids=list(range(prompt_len)), prompt_len=prompt_len,
                    options=SamplingOptions(max_new_tokens=max_new), arrival=arrival)


def run_step(scheduler: Scheduler, cache: FakeCache, pending):
    """One engine iteration without a model: apply last step's answers, schedule, 'compute'."""
    if pending is not None:
        ops, answer = pending
        scheduler.apply(ops, *answer)
    step = scheduler.schedule()
    pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
    for seq, new_tokens in step.batch:
        assert seq.num_computed + new_tokens <= seq.capacity(BLOCK), "scheduled past the block table"
        seq.num_computed += new_tokens
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(7)  # the sampled token
            if seq.num_output >= seq.options.max_new_tokens:
                scheduler.finish(seq, Finish.LENGTH)
    return step, pending


def drive(scheduler, cache, max_steps=500):
    pending, steps = None, []
    for _ in range(max_steps):
        if not scheduler.has_work() and pending is None:
            return steps
        step, pending = run_step(scheduler, cache, pending)
        steps.append(step)
    raise AssertionError("the scheduler did not finish its work")


def test_lease_calls_only_when_a_block_boundary_is_crossed():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = FakeCache(100)
    seq = make_seq(0, prompt_len=6, max_new=12)
    scheduler.add(seq)
    steps = drive(scheduler, cache)
    decode_steps = [s for s in steps if s.batch and s.batch[0][1] == 1]
    with_ops = [s for s in decode_steps if s.lease_ops]
    # 6 prompt tokens + 12 new = 18 tokens; decodes write positions 6..16 and cross into
    # blocks 2, 3 and 4 (positions 8, 12, 16): one extend each, asked a step ahead.
    assert len(with_ops) == 3, [len(s.lease_ops) for s in decode_steps]
    assert all(len(s.lease_ops.extends) == 1 for s in with_ops)
    assert seq.status is Status.FINISHED and not cache.tables


def test_at_most_one_call_per_step_with_every_kind_of_op():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=16), 100)
    cache = FakeCache(100)
    for i in range(6):
        scheduler.add(make_seq(i, prompt_len=3 + 2 * i, max_new=5 + i))
    steps = drive(scheduler, cache)
    assert cache.calls <= len(steps)
    assert not cache.tables and len(cache.free) == 100


def test_full_pool_preempts_the_newest_and_everyone_finishes():
    # 10 blocks of 4 tokens: three sequences writing 16 positions need 12 blocks together.
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 10)
    cache = FakeCache(10)
    seqs = [make_seq(i, prompt_len=5, max_new=12) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, cache)
    assert scheduler.preemptions > 0
    assert all(s.status is Status.FINISHED and s.num_output == 12 for s in seqs)
    assert max(seqs, key=lambda s: s.preemptions) is seqs[-1], "the newest should be preempted first"
    assert not cache.tables and len(cache.free) == 10


def test_prefill_is_chunked_to_the_token_budget():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=8), 100)
    cache = FakeCache(100)
    scheduler.add(make_seq(0, prompt_len=20, max_new=1))
    steps = drive(scheduler, cache)
    chunks = [n for s in steps for _, n in s.batch]
    assert chunks == [8, 8, 4] and all(sum(n for _, n in s.batch) <= 8 for s in steps)


def test_cancel_while_allocating_releases_the_late_allocation():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = FakeCache(100)
    seq = make_seq(0, prompt_len=9)
    scheduler.add(seq)
    step = scheduler.schedule()
    assert step.lease_ops.allocations == [seq] and seq.status is Status.ALLOCATING
    answer = cache.answer(step.lease_ops)
    scheduler.finish(seq, Finish.ABORTED)  # the client left while the call was on the wire
    scheduler.apply(step.lease_ops, *answer)
    follow_up = scheduler.schedule()
    assert [r.lease_id for r in follow_up.lease_ops.releases] == list(cache.tables)
    cache.answer(follow_up.lease_ops)
    assert not cache.tables and not scheduler.has_work()


def test_cancel_of_a_running_sequence_releases_with_its_computed_prefix():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = FakeCache(100)
    seq = make_seq(0, prompt_len=9, max_new=50)
    scheduler.add(seq)
    pending = None
    for _ in range(4):
        _, pending = run_step(scheduler, cache, pending)
    if pending:
        scheduler.apply(pending[0], *pending[1])
    computed = seq.num_computed
    scheduler.finish(seq, Finish.ABORTED)
    releases = scheduler.schedule().lease_ops.releases
    assert len(releases) == 1 and len(releases[0].cached_token_ids) == computed


def test_waiting_request_is_admitted_when_blocks_free_up():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 4)
    cache = FakeCache(4)
    first, second = make_seq(0, prompt_len=12, max_new=2), make_seq(1, prompt_len=12, max_new=2)
    scheduler.add(first)
    scheduler.add(second)
    drive(scheduler, cache)
    assert first.status is second.status is Status.FINISHED


def test_an_unexpected_lease_failure_means_the_session_is_lost():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = FakeCache(100)
    seq = make_seq(0, prompt_len=3, max_new=10)
    scheduler.add(seq)
    drive_steps = 0
    pending = None
    while not pending or not pending[0].extends:
        _, pending = run_step(scheduler, cache, pending)
        drive_steps += 1
        assert drive_steps < 20
    ops = pending[0]
    with pytest.raises(LeaseLost, match="NOT_FOUND"):
        scheduler.apply(ops, [LeaseOutcome(ok=False, code="NOT_FOUND", message="gone")] * len(ops), 0)


def test_limits_validate():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerLimits(block_size=16, max_num_seqs=0, max_batch_tokens=8)


def test_a_refused_allocation_is_not_asked_again_every_step_when_nothing_runs():
    """The pool is held by another session: asking every step would be thousands of Lease
    calls a second. After a refusal the next ask waits, doubling up to a cap."""
    now = [0.0]
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64),
                          blocks_available=0, clock=lambda: now[0])
    cache = FakeCache(0)
    scheduler.add(make_seq(0, 6))
    step, pending = run_step(scheduler, cache, None)
    assert len(step.lease_ops.allocations) == 1  # nothing runs: it asks anyway
    asks = 1
    for _ in range(50):  # fifty steps within the same instant: no second ask
        step, pending = run_step(scheduler, cache, pending)
        asks += len(step.lease_ops.allocations)
    assert asks == 1
    waits = []
    for _ in range(8):
        before = now[0]
        while True:
            now[0] += 0.001
            step, pending = run_step(scheduler, cache, pending)
            if step.lease_ops.allocations:
                break
        waits.append(round(now[0] - before, 3))
    assert waits == sorted(waits) and 0.4 < waits[-1] < 0.6, waits
    cache.free = list(range(8))  # another session released blocks
    for _ in range(100):
        if not scheduler.has_work() and pending is None:
            break
        now[0] += 0.1
        step, pending = run_step(scheduler, cache, pending)
    assert scheduler.waiting == deque() and not scheduler.running and not scheduler.has_work()
