"""The scheduler alone: pure Python, its lease ops answered by the real Ledger in process
(tests/ledger_cache.py: the engine's mapping of ops and the servicer's, without gRPC)."""

from __future__ import annotations

import itertools
from collections import deque

import pytest
from ledger_cache import BLOCK, LedgerCache

from model_service.sample.params import SamplingOptions
from model_service.sched.lease_ops import LeaseAnswer, LeaseLost, Refused, blocks_for
from model_service.sched.scheduler import Scheduler, SchedulerLimits
from model_service.sched.step import Finished, StepOutput
from model_service.sched.sequence import Finish, Sequence, Status



def make_seq(arrival: int, prompt_len: int, max_new: int = 8, priority: int = 0, index: int = 0) -> Sequence:
    """A request's sequence; prompts of different arrivals share no token, so no prefix."""
    prompt = [1000 * arrival + i for i in range(prompt_len)]
    return Sequence(request_id=f"r{arrival}", token_ids=prompt, prompt_len=prompt_len,
                    options=SamplingOptions(max_new_tokens=max_new), arrival=arrival, priority=priority, index=index)


def make_family(arrival: int, prompt_len: int, n: int, max_new: int = 8) -> list[Sequence]:
    """The n completions of one request, as the engine makes them: completion 0 prefills."""
    family = [make_seq(arrival, prompt_len, max_new, index=i) for i in range(n)]
    for child in family[1:]:
        child.status = Status.FORK_PENDING
    family[0].fork_children = family[1:]
    return family


def run_step(scheduler: Scheduler, cache: LedgerCache, pending, observe=None):
    """One engine iteration without a model: apply last step's answers, schedule, 'compute'.
    `observe(step)` sees each step as scheduled, before the fake cache answers its call."""
    if pending is not None:
        ops, answer = pending
        for seq, _reason in scheduler.apply(ops, answer):  # never served: the engine ends them
            scheduler.finish(seq, Finish.ABORTED)
    step = scheduler.schedule()
    if observe is not None:
        observe(step)
    pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
    scheduler.take_copies()
    sampled = []
    for seq, new_tokens in step.batch:
        assert seq.num_computed + new_tokens <= seq.capacity(BLOCK), "scheduled past the block table"
        if seq.num_computed + new_tokens == len(seq.token_ids):  # its next token is due
            sampled.append((seq, 7))  # the sampled token
            if seq.fork_children and seq.num_output == 0:  # the engine samples them from this row
                sampled += [(child, 7) for child in seq.fork_children]
    scheduler.update_from_output(step, StepOutput(sampled=sampled))
    return step, pending


def drive(scheduler, cache, max_steps=500, observe=None):
    pending, steps = None, []
    for _ in range(max_steps):
        if not scheduler.has_work() and pending is None:
            return steps
        step, pending = run_step(scheduler, cache, pending, observe)
        steps.append(step)
    raise AssertionError("the scheduler did not finish its work")


def test_lease_calls_only_when_a_block_boundary_is_crossed():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    seq = make_seq(0, prompt_len=6, max_new=12)
    scheduler.add(seq)
    steps = drive(scheduler, cache)
    decode_steps = [s for s in steps if s.batch and s.batch[0][1] == 1]
    with_ops = [s for s in decode_steps if s.lease_ops]
    # 6 prompt tokens + 12 new = 18 tokens; decodes write positions 6..16 and cross into
    # blocks 2, 3 and 4 (positions 8, 12, 16): one extend each, asked a step ahead.
    assert len(with_ops) == 3, [len(s.lease_ops) for s in decode_steps]
    assert all(len(s.lease_ops.extends) == 1 for s in with_ops)
    assert seq.status is Status.FINISHED and not cache.leases


def test_at_most_one_call_per_step_with_every_kind_of_op():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=16), 100)
    cache = LedgerCache(100)
    for i in range(6):
        scheduler.add(make_seq(i, prompt_len=3 + 2 * i, max_new=5 + i))
    steps = drive(scheduler, cache)
    assert cache.calls <= len(steps)
    assert not cache.leases and cache.available() == 100


def test_full_pool_preempts_the_newest_and_everyone_finishes():
    # 10 blocks of 4 tokens: three sequences writing 16 positions need 12 blocks together.
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 10)
    cache = LedgerCache(10)
    seqs = [make_seq(i, prompt_len=5, max_new=12) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, cache)
    assert scheduler.preemptions > 0
    assert all(s.status is Status.FINISHED and s.num_output == 12 for s in seqs)
    assert max(seqs, key=lambda s: s.preemptions) is seqs[-1], "the newest should be preempted first"
    assert not cache.leases and cache.available() == 10


@pytest.mark.parametrize("reuse_prefix", [False, True])
def test_each_sequence_keeps_its_peak_blocks_and_what_preemption_made_it_compute_again(reuse_prefix):
    # As above: the pool forces preemptions. A sequence writes K/V at 5 + 11 = 16
    # positions (4 blocks) and may be leased the block of its 17th. One that is preempted
    # computes again what it had computed, less, when it may reuse cached blocks (as
    # without prompt logprobs), what the prefix cache gave back of it.
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 10)
    cache = LedgerCache(10)
    seqs = [make_seq(i, prompt_len=5, max_new=12) for i in range(3)]
    computed_when_preempted = {id(seq): 0 for seq in seqs}

    def observe(step) -> None:
        for victim in step.preempted:
            computed_when_preempted[id(victim)] += victim.ever_computed

    for seq in seqs:
        seq.reuse_prefix = reuse_prefix
        scheduler.add(seq)
    drive(scheduler, cache, observe=observe)
    assert scheduler.preemptions > 0
    for seq in seqs:
        assert 4 <= seq.peak_blocks <= 5
        assert seq.recomputed_tokens <= computed_when_preempted[id(seq)]
        if not reuse_prefix:
            assert seq.recomputed_tokens == computed_when_preempted[id(seq)]
            assert (seq.recomputed_tokens > 0) == (seq.preemptions > 0)


def test_each_tenant_s_blocks_are_its_sequences_distinct_blocks_at_every_step():
    # Two tenants in a pool that forces preemptions, one with n = 3 completions sharing
    # their prompt's blocks: the count is of distinct blocks, and nothing stays counted
    # (a sequence that ends while its extend is on the wire gives those blocks back too).
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 14)
    cache = LedgerCache(14)
    # 17 tokens each: the extend for a 5th block goes out in the step that samples the last.
    family = make_family(0, prompt_len=9, n=3, max_new=8)
    others = [make_seq(1, prompt_len=6, max_new=11), make_seq(2, prompt_len=3, max_new=14)]
    for seq in family:
        seq.tenant = "a"
    for seq in others:
        seq.tenant = "b"
    counted = []

    def observe(step) -> None:
        for tenant, seqs in (("a", family), ("b", others)):
            distinct = {block for seq in seqs if seq.status is Status.RUNNING for block in seq.block_table}
            assert scheduler.tenant_blocks.held(tenant) == len(distinct), tenant
            counted.append(len(distinct))

    scheduler.add(family[0])
    for seq in others:
        scheduler.add(seq)
    drive(scheduler, cache, observe=observe)
    assert scheduler.preemptions > 0 and max(counted) > 0
    assert all(s.status is Status.FINISHED for s in family + others)
    assert scheduler.tenant_blocks.held("a") == scheduler.tenant_blocks.held("b") == 0
    assert scheduler.tenant_blocks.take_changed() == {"a": 0, "b": 0}


def test_prefill_is_chunked_to_the_token_budget():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=8), 100)
    cache = LedgerCache(100)
    scheduler.add(make_seq(0, prompt_len=20, max_new=1))
    steps = drive(scheduler, cache)
    chunks = [n for s in steps for _, n in s.batch]
    assert chunks == [8, 8, 4] and all(sum(n for _, n in s.batch) <= 8 for s in steps)


def prefill_chunks(step) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in step.batch if n > 1]


def decode_until_running(scheduler, cache, seq, pending=None):
    """Steps until `seq` has sampled its first token and decodes."""
    scheduler.add(seq)
    for _ in range(20):
        _, pending = run_step(scheduler, cache, pending)
        if seq.num_output:
            return pending
    raise AssertionError(f"{seq.request_id} never decoded")


def steps_until(scheduler, cache, pending, done, each=lambda step: None, max_steps=50):
    """Steps until done(); returns (the steps, the lease call in flight)."""
    steps = []
    while not done():
        assert len(steps) < max_steps, "the scheduler did not get there"
        step, pending = run_step(scheduler, cache, pending)
        steps.append(step)
        each(step)
    return steps, pending


def test_while_sequences_decode_a_step_carries_at_most_the_prefill_cap():
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64, max_prefill_tokens_while_decoding=8)
    scheduler, cache = Scheduler(limits, 100), LedgerCache(100)
    decoding = make_seq(0, prompt_len=6, max_new=30)
    pending = decode_until_running(scheduler, cache, decoding)
    prompt = make_seq(1, prompt_len=40, max_new=2)
    scheduler.add(prompt)
    steps, _ = steps_until(scheduler, cache, pending, lambda: prompt.num_output > 0)
    # The decoding stream runs in every step, each beside one chunk of at most 8 tokens,
    # not beside the whole 40-token prompt that the 64-token budget would take.
    assert [chunk for step in steps for chunk in prefill_chunks(step)] == [("r1", 8)] * 5
    assert all(any(seq is decoding for seq, _ in step.batch) for step in steps)


def test_with_nothing_decoding_a_prompt_takes_the_whole_step_budget():
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64, max_prefill_tokens_while_decoding=8)
    scheduler, cache = Scheduler(limits, 100), LedgerCache(100)
    scheduler.add(make_seq(0, prompt_len=40, max_new=1))
    assert [chunk for step in drive(scheduler, cache) for chunk in prefill_chunks(step)] == [("r0", 40)]


def test_while_more_prompts_wait_than_sequences_decode_a_step_takes_its_whole_budget():
    """A burst: two prompts beside one decoding sequence go in one step, not 8 tokens a step
    (the decoding stream waits once, two first tokens come sooner); once the prompts are
    no more than the sequences decoding, the cap holds again."""
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64, max_prefill_tokens_while_decoding=8)
    scheduler, cache = Scheduler(limits, 100), LedgerCache(100)
    pending = decode_until_running(scheduler, cache, make_seq(0, prompt_len=6, max_new=60))
    burst = [make_seq(1, prompt_len=24, max_new=60), make_seq(2, prompt_len=20, max_new=60)]
    for seq in burst:
        scheduler.add(seq)
    steps, pending = steps_until(scheduler, cache, pending, lambda: all(seq.num_output for seq in burst))
    assert [chunk for step in steps for chunk in prefill_chunks(step)] == [("r2", 20), ("r1", 24)]
    late = make_seq(3, prompt_len=24, max_new=2)
    scheduler.add(late)
    steps, _ = steps_until(scheduler, cache, pending, lambda: late.num_output > 0)
    assert [chunk for step in steps for chunk in prefill_chunks(step)] == [("r3", 8)] * 3


def test_no_prefill_cap_leaves_the_step_budget_to_prompts_beside_decodes():
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64)
    scheduler, cache = Scheduler(limits, 100), LedgerCache(100)
    pending = decode_until_running(scheduler, cache, make_seq(0, prompt_len=6, max_new=30))
    prompt = make_seq(1, prompt_len=40, max_new=2)
    scheduler.add(prompt)
    steps, _ = steps_until(scheduler, cache, pending, lambda: prompt.num_output > 0)
    assert [chunk for step in steps for chunk in prefill_chunks(step)] == [("r1", 40)]


def streams_decoding(scheduler, cache, count: int, max_new: int = 30, priority: int = 0):
    """Starts `count` sequences (arrivals 100 on) and steps until each decodes: as many as
    the prompts a test then sends, so that its steps keep the prefill cap (a step takes its
    whole budget while more prompts wait than sequences decode)."""
    pending = None
    for arrival in range(100, 100 + count):
        pending = decode_until_running(scheduler, cache, make_seq(arrival, prompt_len=6, max_new=max_new,
                                                                  priority=priority), pending)
    return pending


def capped(policy: str = "fcfs", **limits) -> tuple[Scheduler, LedgerCache]:
    """A scheduler whose steps carry 8 prompt tokens beside decodes, and its cache."""
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64,
                             max_prefill_tokens_while_decoding=8, **limits)
    return Scheduler(limits, 200, policy=policy), LedgerCache(200)


@pytest.mark.parametrize(("policy", "first"), [("fcfs", "r2"), ("priority", "r1")])
def test_prompts_ready_together_are_chunked_shortest_first_or_by_priority(policy, first):
    scheduler, cache = capped(policy)
    pending = streams_decoding(scheduler, cache, 2, priority=5)
    long_prompt, short_prompt = make_seq(1, prompt_len=32, max_new=2), make_seq(2, prompt_len=8, max_new=2, priority=5)
    scheduler.add(long_prompt)
    scheduler.add(short_prompt)
    steps, _ = steps_until(scheduler, cache, pending,
                           lambda: long_prompt.num_output > 0 and short_prompt.num_output > 0)
    chunks = [chunk for step in steps for chunk in prefill_chunks(step)]
    # The short prompt's one chunk first brings a first token 4 steps sooner and the long
    # one's a step later; under the priority policy the urgent long prompt goes first.
    expected = [("r2", 8)] + [("r1", 8)] * 4 if first == "r2" else [("r1", 8)] * 4 + [("r2", 8)]
    assert chunks == expected


@pytest.mark.parametrize(("aging", "order"), [(2, ["r1", "r1", "r2", "r1", "r1"]), (8, ["r1"] * 4 + ["r2"])])
def test_a_later_prompt_overtakes_one_being_computed_only_if_shorter_by_its_wait(aging, order):
    """The long prompt has 24 tokens left when the short one (8) is ready 2 steps after it:
    each step waited counts as `aging` of its tokens done, 4 or 16 in all."""
    scheduler, cache = capped(prefill_aging_tokens=aging)
    pending = streams_decoding(scheduler, cache, 2)
    long_prompt, short_prompt = make_seq(1, prompt_len=32, max_new=2), make_seq(2, prompt_len=8, max_new=2)
    scheduler.add(long_prompt)
    chunks = []

    def arrive(step) -> None:
        chunks.extend(prefill_chunks(step))
        if chunks == [("r1", 8)]:  # the long prompt is being computed: the short one arrives
            scheduler.add(short_prompt)

    steps_until(scheduler, cache, pending, lambda: long_prompt.num_output > 0 and short_prompt.num_output > 0, arrive)
    assert [request_id for request_id, _ in chunks] == order


@pytest.mark.parametrize("aging", [0, 2])
def test_shorter_prompts_arriving_every_step_delay_a_long_one_only_while_it_is_young(aging):
    """An 8-token prompt arrives every step, each filling a step's prefill budget alone:
    shortest first without aging computes none of the long prompt; with aging 2 it goes
    first once it has waited (40 - 8) / 2 = 16 steps more than the newest. (Eight sequences
    decode: the short prompts that pile up meanwhile never outnumber them, so the cap holds.)"""
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=16, max_batch_tokens=64,
                             max_prefill_tokens_while_decoding=8, prefill_aging_tokens=aging)
    scheduler, cache = Scheduler(limits, 400), LedgerCache(400)
    pending = streams_decoding(scheduler, cache, 8, max_new=200)
    long_prompt = make_seq(1, prompt_len=40, max_new=1)
    scheduler.add(long_prompt)
    steps = []
    for arrival in range(2, 42):
        scheduler.add(make_seq(arrival, prompt_len=8, max_new=1))
        step, pending = run_step(scheduler, cache, pending)
        steps.append(step)
    long_chunks = [i for i, step in enumerate(steps) if ("r1", 8) in prefill_chunks(step)]
    if aging == 0:
        assert long_chunks == [] and long_prompt.num_computed == 0
    else:
        # Ready at step 1 with the first short prompt; the 16 ready in steps 1-16 go first.
        assert long_chunks == [17, 18, 19, 20, 21] and long_prompt.num_output == 1
        assert [len(prefill_chunks(step)) for step in steps[1:17]] == [1] * 16


def test_cancel_while_allocating_releases_the_late_allocation():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    seq = make_seq(0, prompt_len=9)
    scheduler.add(seq)
    step = scheduler.schedule()
    assert step.lease_ops.allocations == [seq] and seq.status is Status.ALLOCATING
    answer = cache.answer(step.lease_ops)
    scheduler.finish(seq, Finish.ABORTED)  # the client left while the call was on the wire
    scheduler.apply(step.lease_ops, answer)
    follow_up = scheduler.schedule()
    assert [r.lease_id for r in follow_up.lease_ops.releases] == sorted(cache.leases)
    cache.answer(follow_up.lease_ops)
    assert not cache.leases and not scheduler.has_work()


def test_cancel_of_a_running_sequence_releases_with_its_computed_prefix():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    seq = make_seq(0, prompt_len=9, max_new=50)
    scheduler.add(seq)
    pending = None
    for _ in range(4):
        _, pending = run_step(scheduler, cache, pending)
    if pending:
        scheduler.apply(*pending)
    computed = seq.num_computed
    scheduler.finish(seq, Finish.ABORTED)
    releases = scheduler.schedule().lease_ops.releases
    assert len(releases) == 1 and len(releases[0].cached_token_ids) == computed


def test_waiting_request_is_admitted_when_blocks_free_up():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 4)
    cache = LedgerCache(4)
    first, second = make_seq(0, prompt_len=12, max_new=2), make_seq(1, prompt_len=12, max_new=2)
    scheduler.add(first)
    scheduler.add(second)
    drive(scheduler, cache)
    assert first.status is second.status is Status.FINISHED


def test_an_unexpected_lease_failure_means_the_session_is_lost():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
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
        scheduler.apply(ops, LeaseAnswer.of(ops, [Refused("NOT_FOUND", "gone")] * len(ops), 0))


# --- leasing ahead of need, and releases that wait for a call that goes out anyway -----


def ahead_limits(lookahead: int, hold_s: float = 0.0, max_num_seqs: int = 8, max_model_len: int = 0) -> SchedulerLimits:
    return SchedulerLimits(block_size=BLOCK, max_num_seqs=max_num_seqs, max_batch_tokens=64,
                           lookahead_tokens=lookahead, max_model_len=max_model_len, release_hold_s=hold_s)


def test_leasing_ahead_cuts_the_lease_calls_of_many_decoding_streams():
    calls = {}
    for lookahead in (0, 2 * BLOCK):
        scheduler = Scheduler(ahead_limits(lookahead), 400)
        cache = LedgerCache(400)
        seqs = [make_seq(i, prompt_len=3 + i, max_new=40) for i in range(8)]  # boundaries staggered
        for seq in seqs:
            scheduler.add(seq)
        drive(scheduler, cache)  # run_step fails any step that writes past its table
        assert all(s.status is Status.FINISHED and s.num_output == 40 for s in seqs)
        assert not cache.leases and cache.available() == 400
        calls[lookahead] = cache.calls
        assert (cache.top_ups > 0) == (lookahead > 0)
    # Without: someone crosses a block boundary nearly every step. With: a call is due
    # only when the first of them runs out of what it was leased ahead.
    assert calls[2 * BLOCK] * 3 < calls[0], calls


def test_top_ups_never_reach_past_what_a_sequence_can_grow_to():
    scheduler = Scheduler(ahead_limits(10 * BLOCK, max_model_len=14), 100)
    cache = LedgerCache(100)
    short, capped = make_seq(0, prompt_len=5, max_new=6), make_seq(1, prompt_len=6, max_new=30)
    scheduler.add(short)
    scheduler.add(capped)
    targets: dict[str, int] = {}
    for step in drive(scheduler, cache):
        for seq, tokens in step.lease_ops.top_ups:
            targets[seq.request_id] = max(tokens, targets.get(seq.request_id, 0))
    assert targets == {"r0": 11, "r1": 14}, targets  # prompt + max_new; max_model_len


def test_no_top_ups_while_a_sequence_waits_for_a_seat():
    scheduler = Scheduler(ahead_limits(4 * BLOCK, max_num_seqs=1), 100)
    cache = LedgerCache(100)
    first, second = make_seq(0, prompt_len=5, max_new=20), make_seq(1, prompt_len=5, max_new=20)
    scheduler.add(first)
    scheduler.add(second)
    with_top_ups = []  # the second's status at each call that leases ahead

    def observe(step) -> None:
        if step.lease_ops.top_ups:
            with_top_ups.append(second.status)

    drive(scheduler, cache, observe=observe)
    assert with_top_ups and Status.WAITING not in with_top_ups
    assert first.status is second.status is Status.FINISHED


def test_top_ups_take_at_most_half_of_the_free_blocks():
    scheduler = Scheduler(ahead_limits(8 * BLOCK), 12)
    cache = LedgerCache(12)
    seq = make_seq(0, prompt_len=5, max_new=40)  # could grow to all 12 blocks
    scheduler.add(seq)
    asked = []

    def observe(step) -> None:
        ops = step.lease_ops
        needed = {id(s): blocks_for(tokens, BLOCK) for s, tokens in ops.extends}
        free = cache.available() - sum(needed[id(s)] - len(s.block_table) for s, _ in ops.extends)
        for topped, tokens in ops.top_ups:
            asked.append((blocks_for(tokens, BLOCK) - needed.get(id(topped), len(topped.block_table)), free))

    drive(scheduler, cache, observe=observe)
    assert asked and all(more <= free // 2 for more, free in asked), asked
    assert seq.status is Status.FINISHED and seq.num_output == 40 and cache.available() == 12


def test_a_refused_top_up_leaves_the_sequence_to_ask_when_it_needs_the_block():
    scheduler = Scheduler(ahead_limits(2 * BLOCK), 100)
    cache = LedgerCache(100)
    cache.refuse_top_ups = True  # another session took the blocks meanwhile
    seqs = [make_seq(i, prompt_len=3 + i, max_new=20) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, cache)
    assert cache.top_ups > 0 and scheduler.preemptions == 0
    assert all(s.status is Status.FINISHED and s.num_output == 20 for s in seqs)
    assert not cache.leases


def held_release_run(finish_reason: Finish, advance_s: float):
    """A short sequence finishes while a long one decodes; returns the steps after that."""
    now = [0.0]
    scheduler = Scheduler(ahead_limits(0, hold_s=0.1), 100, clock=lambda: now[0])
    cache = LedgerCache(100)
    short, long = make_seq(0, prompt_len=4, max_new=50), make_seq(1, prompt_len=6, max_new=40)
    scheduler.add(short)
    scheduler.add(long)
    pending = None
    while short.num_output < 3:
        _, pending = run_step(scheduler, cache, pending)
    scheduler.finish(short, finish_reason)
    steps = []
    for _ in range(200):
        if not scheduler.has_work() and pending is None:
            break
        now[0] += advance_s
        step, pending = run_step(scheduler, cache, pending)
        steps.append(step)
    assert not cache.leases and long.status is Status.FINISHED
    return steps, short


def test_a_finished_sequence_s_release_waits_for_a_call_that_goes_out_anyway():
    steps, short = held_release_run(Finish.LENGTH, advance_s=0.0)  # the clock stands still
    carrying = [i for i, step in enumerate(steps) if step.lease_ops.releases]
    first = steps[carrying[0]].lease_ops
    assert [r.lease_id for r in first.releases] and first.extends, "it rode on the other's extend"
    assert carrying[0] > 0, "not a call of its own in the next step"


def test_a_held_release_goes_alone_once_its_hold_has_passed():
    steps, _ = held_release_run(Finish.LENGTH, advance_s=0.06)  # the second step is past 0.1 s
    carrying = [i for i, step in enumerate(steps) if step.lease_ops.releases]
    assert carrying[0] == 1 and not steps[1].lease_ops.extends


def test_a_cancelled_sequence_s_blocks_go_back_with_the_next_step_s_call():
    steps, _ = held_release_run(Finish.ABORTED, advance_s=0.0)
    assert steps[0].lease_ops.releases


def test_limits_validate():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerLimits(block_size=16, max_num_seqs=0, max_batch_tokens=8)
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerLimits(block_size=16, max_num_seqs=1, max_batch_tokens=8, max_prefill_tokens_while_decoding=-1)


def test_a_refused_allocation_is_not_asked_again_every_step_when_nothing_runs():
    """The pool is held by another session: asking every step would be thousands of Lease
    calls a second. After a refusal the next ask waits, doubling up to a cap."""
    now = [0.0]
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64),
                          blocks_available=0, clock=lambda: now[0])
    cache = LedgerCache(8, held_by_another=8)
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
    cache.release_others()  # another session released its blocks
    for _ in range(100):
        if not scheduler.has_work() and pending is None:
            break
        now[0] += 0.1
        step, pending = run_step(scheduler, cache, pending)
    assert scheduler.waiting == deque() and not scheduler.running and not scheduler.has_work()


# --- priority policy ------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=1, max_batch_tokens=64), 100,
                          policy="priority")
    cache = LedgerCache(100)
    seqs = [make_seq(0, 5, 2, priority=5), make_seq(1, 5, 2, priority=-1), make_seq(2, 5, 2, priority=5),
            make_seq(3, 5, 2, priority=0)]
    for seq in seqs:
        scheduler.add(seq)
    admitted = [s.lease_ops.allocations[0].arrival for s in drive(scheduler, cache) if s.lease_ops.allocations]
    assert admitted == [1, 3, 0, 2]


def test_fcfs_policy_ignores_priority():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=1, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    for arrival, priority in enumerate([5, -1, 0]):
        scheduler.add(make_seq(arrival, 5, 2, priority=priority))
    admitted = [s.lease_ops.allocations[0].arrival for s in drive(scheduler, cache) if s.lease_ops.allocations]
    assert admitted == [0, 1, 2]


def test_priority_policy_preempts_the_lowest_priority_newest_first():
    # 12 blocks of 4: four sequences writing 17 positions need 20; the victims must be the
    # priority-9 ones, newest first, never the priority-0 ones that arrived later.
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 12,
                          policy="priority")
    cache = LedgerCache(12)
    seqs = [make_seq(0, 5, 12, priority=9), make_seq(1, 5, 12, priority=9), make_seq(2, 5, 12, priority=0),
            make_seq(3, 5, 12, priority=0)]
    for seq in seqs:
        scheduler.add(seq)
    victims = [v.arrival for step in drive(scheduler, cache) for v in step.preempted]
    assert victims and victims[0] == 1, victims
    assert seqs[2].preemptions == seqs[3].preemptions == 0
    assert all(s.status is Status.FINISHED and s.num_output == 12 for s in seqs)
    assert not cache.leases and cache.available() == 12


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=1, max_batch_tokens=8), 10, policy="lifo")


# --- tenants' shares of the pool (--api-keys kv_blocks) -----------------------------------


def tenant_seq(tenant: str, arrival: int, prompt_len: int, max_new: int, priority: int = 0) -> Sequence:
    seq = make_seq(arrival, prompt_len, max_new, priority=priority)
    seq.tenant = tenant
    return seq


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_tenant_past_its_share_is_preempted_before_a_newer_sequence_of_another(policy):
    # 10 blocks of 4: two sequences writing 5 + 12 positions need 10 together, and a third
    # more. Without shares the newest (b's) is preempted; a holds more than its 2 blocks.
    victims = {}
    for shares in ({}, {"a": 2}):
        scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 10,
                              policy=policy, tenant_kv_blocks=shares)
        cache = LedgerCache(10)
        seqs = [tenant_seq("a", 0, 5, 12), tenant_seq("a", 1, 5, 12), tenant_seq("b", 2, 5, 12)]
        for seq in seqs:
            scheduler.add(seq)
        steps = drive(scheduler, cache)
        assert all(s.status is Status.FINISHED and s.num_output == 12 for s in seqs)
        victims[bool(shares)] = [victim.tenant for step in steps for victim in step.preempted]
    assert victims[False][0] == "b", victims
    assert victims[True] and set(victims[True]) == {"a"}, victims


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_tenant_past_its_share_waits_while_another_tenant_s_request_is_admitted(policy):
    # Two seats, both a's, within its share of 4 blocks when admitted (2 each). Then a's
    # third request and b's arrive, in that order. a's short first request ends while its
    # long second one, grown past the share, runs: the seat goes to the next in line, a's
    # third (arrived first, and more urgent under the priority policy), unless a is past
    # its share; then to b's. a's third still runs once nobody else waits: a share gives
    # way, it does not refuse.
    admitted = {}
    for shares in ({}, {"a": 4}):
        scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=2, max_batch_tokens=64), 100,
                              policy=policy, tenant_kv_blocks=shares)
        cache = LedgerCache(100)
        seqs = [tenant_seq("a", 0, 5, 12), tenant_seq("a", 1, 5, 30), tenant_seq("a", 2, 5, 3, priority=0),
                tenant_seq("b", 3, 5, 3, priority=5)]
        scheduler.add(seqs[0])
        scheduler.add(seqs[1])

        def observe(step) -> None:
            if step.batch and seqs[2].status is Status.WAITING and seqs[2] not in scheduler.waiting:
                scheduler.add(seqs[2])  # while the first two run
                scheduler.add(seqs[3])

        steps = drive(scheduler, cache, observe=observe)
        assert all(s.status is Status.FINISHED for s in seqs) and not cache.leases
        admitted[bool(shares)] = [seq.arrival for step in steps for seq in step.lease_ops.allocations]
    assert admitted[False] == [0, 1, 2, 3], admitted
    assert admitted[True] == [0, 1, 3, 2], admitted


def test_only_the_tenant_past_its_share_waits_and_its_blocks_count_once_for_all_its_sequences():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100,
                          tenant_kv_blocks={"a": 6, "b": 0})
    blocks = scheduler.tenant_blocks
    blocks.hold("a", [1, 2, 3])
    blocks.hold("a", [1, 2, 4])  # a fork: the shared blocks count once
    assert blocks.held("a") == 4 and not blocks.over_share("a") and not blocks.over_share("a", 2)
    assert blocks.over_share("a", 3)
    assert not blocks.over_share("b", 1000) and not blocks.over_share("", 1000), "no share: no limit"
    blocks.drop("a", [1, 2, 3])
    assert blocks.held("a") == 3


# --- n completions on forked blocks ----------------------------------------------------


def test_n_completions_fork_the_prompt_once_and_each_finishes_on_its_own():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    family = make_family(0, prompt_len=10, n=4, max_new=6)
    family[2].options = SamplingOptions(max_new_tokens=2)  # finishes before its siblings
    scheduler.add(family[0])
    steps = drive(scheduler, cache)
    assert cache.forks == 3
    assert sum(len(s.lease_ops.allocations) for s in steps) == 1, "the prompt is allocated once"
    assert [s.num_output for s in family] == [6, 6, 2, 6]
    assert all(s.status is Status.FINISHED for s in family)
    assert not cache.leases and cache.available() == 100 and cache.leased() == 0


def test_n_completions_hold_seats_for_all_of_them():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    family = make_family(0, prompt_len=6, n=4, max_new=5)
    other = make_seq(1, prompt_len=6, max_new=5)
    scheduler.add(family[0])
    scheduler.add(other)
    steps = drive(scheduler, cache)
    admitted_at = {seq.arrival: i for i, step in enumerate(steps) for seq in step.lease_ops.allocations}
    # Without seats held for the forks, the other request is admitted with completion 0
    # and five sequences run at once.
    assert admitted_at[1] > admitted_at[0] and all(len(step.batch) <= 4 for step in steps)
    assert other.status is Status.FINISHED and not cache.leases


@pytest.mark.parametrize("num_blocks", [9, 12])
def test_n_completions_under_a_small_pool_preempt_and_leave_nothing_leased(num_blocks):
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), num_blocks)
    cache = LedgerCache(num_blocks)
    family = make_family(0, prompt_len=9, n=4, max_new=10)
    scheduler.add(family[0])
    drive(scheduler, cache)
    assert scheduler.preemptions > 0
    assert all(s.status is Status.FINISHED and s.num_output == 10 for s in family)
    assert not cache.leases and cache.available() == num_blocks and cache.leased() == 0


def test_finishing_the_parent_at_its_first_token_still_forks_the_children():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    family = make_family(0, prompt_len=6, n=3, max_new=4)
    family[0].options = SamplingOptions(max_new_tokens=1)
    scheduler.add(family[0])
    steps = drive(scheduler, cache)
    assert cache.forks == 2, "the parent's release comes after the forks in the same call"
    assert sum(len(s.lease_ops.allocations) for s in steps) == 1
    assert [s.num_output for s in family] == [1, 4, 4]
    assert not cache.leases and cache.available() == 100


def test_cancelling_every_completion_mid_flight_leaves_nothing_leased():
    for cancel_at in range(1, 8):
        scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100)
        cache = LedgerCache(100)
        family = make_family(0, prompt_len=6, n=4, max_new=20)
        scheduler.add(family[0])
        pending = None
        for _ in range(cancel_at):
            _, pending = run_step(scheduler, cache, pending)
        for seq in family:
            scheduler.finish(seq, Finish.ABORTED)
        while scheduler.has_work() or pending is not None:
            _, pending = run_step(scheduler, cache, pending)
        assert not cache.leases and cache.available() == 100, f"leaked after a cancel at step {cancel_at}"


# --- update_from_output: the one writer of a step's results ------------------------------


def one_step(scheduler: Scheduler, cache: LedgerCache, seqs: list[Sequence]):
    """Admits `seqs` and runs their prefill step; returns that step."""
    for seq in seqs:
        scheduler.add(seq)
    step = scheduler.schedule()
    scheduler.apply(step.lease_ops, cache.answer(step.lease_ops))
    return scheduler.schedule()


def test_update_from_output_applies_eos_stop_tokens_and_length():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64, max_model_len=7),
                          100, eos_token_ids=[2])
    cache = LedgerCache(100)
    eos, ignoring, stop, length, running = (make_seq(i, prompt_len=5, max_new=8) for i in range(5))
    model_len = make_seq(5, prompt_len=6, max_new=8)
    ignoring.options = SamplingOptions(max_new_tokens=8, ignore_eos=True)
    stop.options = SamplingOptions(max_new_tokens=8, stop_token_ids=frozenset({3}))
    length.options = SamplingOptions(max_new_tokens=1)
    step = one_step(scheduler, cache, [eos, ignoring, stop, length, running, model_len])
    assert sorted(n for _, n in step.batch) == [5] * 5 + [6]
    finished = scheduler.update_from_output(step, StepOutput(sampled=[
        (eos, 2), (ignoring, 2), (stop, 3), (length, 9), (running, 9), (model_len, 9)]))
    assert finished == [Finished(eos, Finish.EOS), Finished(stop, Finish.STOP, 3), Finished(length, Finish.LENGTH),
                        Finished(model_len, Finish.LENGTH)]  # 7 tokens: max_model_len
    assert ignoring.num_computed == running.num_computed == 5  # the others gave their blocks up
    assert [seq.token_ids[5:] for seq in (eos, ignoring, stop, length, running)] == [[2], [2], [3], [9], [9]]
    assert {seq.status for seq in (eos, stop, length, model_len)} == {Status.FINISHED}
    assert ignoring.status is running.status is Status.RUNNING
    step = scheduler.schedule()
    assert {seq for seq, _ in step.batch} == {ignoring, running}
    assert len(step.lease_ops.releases) == 4  # the finished ones' blocks go back with this call
    finished = scheduler.update_from_output(step, StepOutput(sampled=[(ignoring, 4), (running, 4)]))
    assert finished == [Finished(ignoring, Finish.LENGTH), Finished(running, Finish.LENGTH)]


def test_update_from_output_forks_at_the_first_token_and_skips_the_finished():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    parent, child, gone = make_family(0, prompt_len=6, n=3)
    step = one_step(scheduler, cache, [parent])
    assert child.status is Status.FORK_PENDING and gone.status is Status.FORK_PENDING
    scheduler.finish(gone, Finish.ABORTED)
    finished = scheduler.update_from_output(step, StepOutput(sampled=[(parent, 11), (child, 12), (gone, 13)]))
    assert finished == []
    assert parent.token_ids[6:] == [11] and child.token_ids[6:] == [12] and gone.token_ids[6:] == []
    assert parent.fork_children == []
    forks = scheduler.schedule().lease_ops.forks
    assert [fork.child for fork in forks] == [child] and forks[0].parent_tokens == 6


def test_update_from_output_marks_prompt_logprobs_done():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64), 100)
    seq = make_seq(0, prompt_len=6)
    seq.reuse_prefix = False
    step = one_step(scheduler, LedgerCache(100), [seq])
    scheduler.update_from_output(step, StepOutput(prompt_logprobs_done=[seq]))
    assert seq.reuse_prefix and seq.num_computed == 6 and seq.num_output == 0


# --- commits: full blocks shared while their sequence runs ------------------------------


def test_full_blocks_are_committed_in_calls_that_go_out_anyway():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100)
    cache = LedgerCache(100)
    seq = make_seq(0, prompt_len=10, max_new=12)
    late = make_seq(1, prompt_len=3, max_new=2)
    calls = []

    def observe(step):
        if step.lease_ops:
            calls.append([(s.request_id, t) for s, t in step.lease_ops.commits])
        if len(calls) == 2 and late.status is Status.WAITING and late not in scheduler.waiting:
            scheduler.add(late)  # arrives while r0 decodes: its allocation makes a call go out

    scheduler.add(seq)
    drive(scheduler, cache, observe=observe)
    # The prompt's 2 full blocks (8 of 10 tokens) go with the first call after the prefill,
    # then each block as it fills, never a block twice and never past what was computed.
    committed = [tokens for request_id, tokens in cache.commits if request_id == "r0"]
    assert committed and committed[0] == 8 and committed == sorted(set(committed))
    assert all(tokens % BLOCK == 0 and tokens <= 21 for tokens in committed)
    assert sum(len(c) for c in calls) == len(cache.commits)  # only in calls that went out anyway


# --- prompts held while another sequence computes their prefix ----------------------------


def shared_prefix_seqs(count: int, prefix_len: int, suffix_len: int, salts=None) -> list[Sequence]:
    """`count` requests whose prompts are one prefix + a suffix of their own."""
    seqs = []
    for arrival in range(count):
        prompt = list(range(1, prefix_len + 1)) + [1000 * (arrival + 1) + i for i in range(suffix_len)]
        seqs.append(Sequence(request_id=f"r{arrival}", token_ids=prompt, prompt_len=len(prompt),
                             options=SamplingOptions(max_new_tokens=4), arrival=arrival,
                             cache_salt=salts[arrival] if salts else ""))
    return seqs


@pytest.mark.parametrize("hold", [0, 8])
def test_a_prompt_waits_for_a_prefix_being_computed_and_finds_it_cached(hold):
    """Three prompts sharing 24 tokens (6 blocks) arrive together; with a step of 8 tokens
    the first takes three steps to compute the prefix. Held (prefix_hold_min_tokens
    8), the others are admitted once it is computed and get it from the prefix cache; not
    held, each computes it again."""
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=8, prefix_hold_min_tokens=hold)
    scheduler = Scheduler(limits, 100)
    cache = LedgerCache(100)
    seqs = shared_prefix_seqs(3, prefix_len=24, suffix_len=3)
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, cache)
    assert all(seq.status is Status.FINISHED and seq.num_output == 4 for seq in seqs)
    if hold:
        assert [seq.cached_tokens for seq in seqs] == [0, 24, 24]
    else:  # the second is admitted beside the first and computes the prefix again
        assert seqs[1].cached_tokens == 0 and seqs[2].cached_tokens < 24
    assert not cache.leases and cache.available() == 100


def test_a_prefix_too_short_to_hold_for_or_of_another_salt_holds_no_one():
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64, prefix_hold_min_tokens=32)
    scheduler = Scheduler(limits, 100)
    short = shared_prefix_seqs(2, prefix_len=24, suffix_len=3)  # 24 shared tokens < 32
    for seq in short:
        scheduler.add(seq)
    first_step = scheduler.schedule()
    assert first_step.lease_ops.allocations == short
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=64, prefix_hold_min_tokens=8)
    scheduler = Scheduler(limits, 100)
    salted = shared_prefix_seqs(2, prefix_len=24, suffix_len=3, salts=["a", "b"])
    for seq in salted:
        scheduler.add(seq)
    assert scheduler.schedule().lease_ops.allocations == salted  # another salt never finds the blocks


def test_held_prompts_behind_a_preempted_one_all_finish():
    """Twelve prompts on one prefix in a pool that forces preemptions: whoever is held is
    held only while someone computes the prefix, so everyone finishes and every block
    comes back."""
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=6, max_batch_tokens=12, prefix_hold_min_tokens=8)
    scheduler = Scheduler(limits, 30)
    cache = LedgerCache(30)
    seqs = shared_prefix_seqs(12, prefix_len=20, suffix_len=5)
    for seq in seqs:
        scheduler.add(seq)
    drive(scheduler, cache, max_steps=2000)
    assert all(seq.status is Status.FINISHED and seq.num_output == 4 for seq in seqs)
    assert sum(seq.cached_tokens for seq in seqs) >= 20 * 8
    assert not cache.leases and cache.available() == 30


# --- the session's block quota (--max-session-blocks) -----------------------------------


def test_a_sequence_past_the_session_quota_fails_alone_and_the_others_finish():
    """A quota refusal is the session's, not a lost lease: another sequence of the session
    is preempted to make room, one that alone needs more than the quota ends, and nothing
    raises LeaseLost (which would end every stream of the engine)."""
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100,
                          clock=itertools.count().__next__)
    cache = LedgerCache(100, session_max_blocks=6)
    long = make_seq(0, prompt_len=8, max_new=40)  # 48 tokens: 12 blocks, twice the quota
    bystander = make_seq(1, prompt_len=4, max_new=8)  # 12 tokens: 3 blocks
    failures = []
    original_apply = scheduler.apply

    def apply(ops, answer):
        failed = original_apply(ops, answer)
        failures.extend(seq for seq, _ in failed)
        return failed

    scheduler.apply = apply
    scheduler.add(long)
    scheduler.add(bystander)
    drive(scheduler, cache)
    assert failures == [long] and long.num_output < 40
    assert bystander.num_output == 8 and bystander.status is Status.FINISHED
    assert cache.ledger.sequences.owner_usage("engine#1") == (0, 0)  # every block back


def test_an_allocation_past_the_quota_waits_while_others_hold_blocks():
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100,
                          clock=itertools.count().__next__)
    cache = LedgerCache(100, session_max_blocks=5)
    first = make_seq(0, prompt_len=8, max_new=4)  # 3 blocks at most
    second = make_seq(1, prompt_len=8, max_new=4)  # fits only once the first is gone
    scheduler.add(first)
    scheduler.add(second)
    drive(scheduler, cache)
    assert first.num_output == 4 and second.num_output == 4


@pytest.mark.parametrize("truncate_tables", [True, False], ids=["truncating", "old-cache-service"])
def test_a_rejected_proposals_blocks_go_back_in_a_truncate(truncate_tables):
    from model_service.spec.settings import SpeculativeSettings
    from model_service.spec.speculator import Speculator

    speculator = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1),
                            BLOCK, max_model_len=0)
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64, truncate_tables=truncate_tables)
    scheduler = Scheduler(limits, 100, speculator=speculator)
    cache = LedgerCache(100)
    prompt = [1, 2, 3, 4, 5, 6] * 2 + [1]  # the lookup proposes the cycle's next tokens
    seq = Sequence(request_id="r0", token_ids=prompt, prompt_len=len(prompt),
                   options=SamplingOptions(max_new_tokens=30), arrival=0)
    scheduler.add(seq)
    pending, truncates, speculated = None, [], 0
    for _ in range(100):
        if pending is not None:
            assert not scheduler.apply(*pending)
            if seq.lease_id in cache.leases:  # the ledger's table and the scheduler's agree
                assert cache.ledger.sequences.sequence_blocks(seq.lease_id) == seq.block_table
        if not scheduler.has_work() and pending is None:
            break
        step = scheduler.schedule()
        for truncated, tokens in step.lease_ops.truncates:
            assert truncated is seq and len(seq.block_table) == blocks_for(tokens, BLOCK)
            assert tokens == seq.num_computed + 2  # the next token's slot and the one after
        truncates += step.lease_ops.truncates
        pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
        sampled = []
        for s, new_tokens in step.batch:
            proposal = step.proposals.get(s, [])
            speculated += bool(proposal)
            if s.num_computed + new_tokens == len(s.token_ids) + len(proposal):
                # The cycle's next token, and it alone: each proposal is cut after its first token.
                sampled.append((s, s.token_ids[-1] % 6 + 1))
        scheduler.update_from_output(step, StepOutput(sampled=sampled))
    else:
        raise AssertionError("the scheduler did not finish its work")
    assert speculated > 0
    assert bool(truncates) is truncate_tables
    assert (cache.ledger.stats().blocks_truncated > 0) is truncate_tables
    assert cache.leased() == 0 and seq.num_output == 30


@pytest.mark.parametrize(("fixed_s", "seconds_a_row", "speculates"), [(0.010, 0.0, True), (0.0, 0.001, False)],
                         ids=["weights-bound", "compute-bound"])
def test_proposals_are_verified_where_measured_steps_say_they_add_tokens_a_second(fixed_s, seconds_a_row, speculates):
    from model_service.spec.settings import SpeculativeSettings
    from model_service.spec.speculator import Speculator

    speculator = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1),
                            BLOCK, max_model_len=0)
    for rows in (1, 4, 16, 28, 64):  # a step's seconds by its rows, as the engine records them
        speculator.step_took(rows, fixed_s + seconds_a_row * rows)
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100,
                          speculator=speculator)
    cache = LedgerCache(100)
    prompt = [1, 2, 3, 4, 5, 6] * 2 + [1]  # the lookup proposes the cycle's next tokens
    for arrival in range(4):
        scheduler.add(Sequence(request_id=f"r{arrival}", token_ids=list(prompt), prompt_len=len(prompt),
                               options=SamplingOptions(max_new_tokens=30), arrival=arrival))
    pending = None
    for _ in range(10):  # past the prompts, to the first step of four decodes
        if pending is not None:
            assert not scheduler.apply(*pending)
        step = scheduler.schedule()
        pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
        if len(step.batch) == 4 and all(s.num_uncomputed == 1 for s, _ in step.batch):
            break
        scheduler.update_from_output(step, StepOutput(sampled=[(s, s.token_ids[-1] % 6 + 1) for s, n in step.batch
                                                                if s.num_computed + n == len(s.token_ids)]))
    else:
        raise AssertionError("no step of four decodes")
    # Each proposes the cycle's next tokens; where a row costs as much as a kept token
    # (half are kept, by the prior), none is worth verifying.
    assert bool(step.proposals) is speculates
