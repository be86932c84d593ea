"""Tenants' compute budgets (--api-keys max_tokens_per_s, sched/tenant_budgets.py): the
token bucket alone, then in the scheduler with the real Ledger behind it
(tests/ledger_cache.py) and a clock the test moves, so nothing here depends on time.
"""

from __future__ import annotations

from ledger_cache import BLOCK, LedgerCache
from test_scheduler import drive, run_step, tenant_seq

from model_service.sched.scheduler import Scheduler, SchedulerLimits
from model_service.sched.sequence import Status
from model_service.sched.tenant_budgets import ComputeBudget, TenantBudgets
from fake_clock import Clock


def test_the_bucket_starts_full_grants_what_it_holds_and_refills_at_its_rate_up_to_its_burst():
    clock = Clock()
    budgets = TenantBudgets({"a": ComputeBudget(tokens_per_s=10, burst_tokens=20)}, clock)
    budgets.open_step()
    assert budgets.grant("a", 15) == 15
    assert budgets.grant("a", 15) == 5, "the rest of the bucket"
    assert budgets.grant("a", 1) == 0
    assert budgets.grant("b", 1000) == 1000, "no budget: no limit"
    assert budgets.close_step() == {"a": 10 + 1}
    budgets.charge("a", 20)
    clock.now += 0.5
    budgets.open_step()
    assert budgets.tokens("a") == 5 and budgets.tokens("b") is None
    assert budgets.grant("a", 8, least=6) == 0, "a chunk waits for `least` tokens"
    assert budgets.grant("a", 3, least=6) == 3, "or for the rest of the prompt, if fewer"
    assert budgets.close_step() == {"a": 8}
    clock.now += 60  # refills to its burst, no further
    budgets.open_step()
    assert budgets.tokens("a") == 20 and budgets.close_step() == {}


def test_one_second_s_worth_is_the_default_burst_and_a_least_past_the_burst_still_runs():
    clock = Clock()
    budgets = TenantBudgets({"a": ComputeBudget(tokens_per_s=3)}, clock)
    budgets.open_step()
    assert budgets.tokens("a") == 3
    assert budgets.grant("a", 100, least=16) == 3, "a bucket of 3 can never hold 16: 3 are enough"


def test_a_step_scheduled_again_before_it_runs_is_charged_once():
    # The engine schedules a second time when it admitted while others ran (engine/loop.py):
    # only the step that runs comes out of the bucket.
    clock = Clock()
    budgets = TenantBudgets({"a": ComputeBudget(tokens_per_s=10)}, clock)
    for _ in range(2):
        budgets.open_step()
        assert budgets.grant("a", 8) == 8
        budgets.close_step()
    budgets.charge("a", 8)
    budgets.open_step()
    assert budgets.tokens("a") == 2


def scheduler_with(budgets: dict, clock: Clock, max_batch_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=8, max_batch_tokens=max_batch_tokens), 100,
                     clock=clock, tenant_budgets=budgets)


def test_a_tenant_past_its_budget_is_skipped_not_preempted_while_the_other_runs_to_the_end():
    clock = Clock()  # stands still: a's bucket never refills
    scheduler = scheduler_with({"a": ComputeBudget(tokens_per_s=10, burst_tokens=10)}, clock)
    cache = LedgerCache(100)
    a, b = tenant_seq("a", 0, 40, 4), tenant_seq("b", 1, 30, 6)
    scheduler.add(a)
    scheduler.add(b)
    steps = drive_until(scheduler, cache, lambda: b.status is Status.FINISHED)
    computed = {"a": 0, "b": 0}
    for step in steps:
        for seq, tokens in step.batch:
            computed[seq.tenant] += tokens
    assert computed == {"a": 10, "b": 30 + 6 - 1}, "a ran what its bucket held; b all its prompt and decodes"
    assert sum(step.deferred.get("a", 0) for step in steps) > 0 and not any("b" in step.deferred for step in steps)
    assert a.status is Status.RUNNING and a.preemptions == 0 and a.block_table, "skipped, keeping its blocks"
    assert a.num_computed == 10
    # Once time passes, a finishes: slower, never failed.
    pending = None
    for _ in range(200):
        if a.status is Status.FINISHED:
            break
        clock.now += 0.5
        _, pending = run_step(scheduler, cache, pending)
    assert a.status is Status.FINISHED and a.num_output == 4 and a.preemptions == 0


def test_over_any_time_a_tenant_computes_at_most_its_burst_and_its_rate_and_others_are_not_held_back():
    clock = Clock()
    rate, burst = 40, 16
    scheduler = scheduler_with({"a": ComputeBudget(tokens_per_s=rate, burst_tokens=burst)}, clock)
    cache = LedgerCache(100)
    seqs = [tenant_seq("a", 0, 30, 20), tenant_seq("a", 1, 25, 20), tenant_seq("b", 2, 30, 20)]
    for seq in seqs:
        scheduler.add(seq)
    computed_a, started, b_steps = 0, clock.now, []
    pending = None
    for index in range(2000):
        if all(seq.status is Status.FINISHED for seq in seqs):
            break
        step, pending = run_step(scheduler, cache, pending)
        computed_a += sum(tokens for seq, tokens in step.batch if seq.tenant == "a")
        b_steps += [index for seq, _ in step.batch if seq.tenant == "b"]
        assert computed_a <= burst + rate * (clock.now - started) + 1e-9
        assert "b" not in step.deferred
        clock.now += 0.01
    assert all(seq.status is Status.FINISHED and seq.preemptions == 0 for seq in seqs)
    assert computed_a == 30 + 25 + 2 * (20 - 1)
    # b's prompt in one step, then a decode in each step after it: never waiting on a.
    assert b_steps == list(range(b_steps[0], b_steps[0] + 20)), b_steps


def test_a_prompt_under_a_small_budget_goes_in_chunks_of_a_block_not_a_token_a_step():
    clock = Clock()
    scheduler = scheduler_with({"a": ComputeBudget(tokens_per_s=100, burst_tokens=20)}, clock)
    cache = LedgerCache(100)
    a = tenant_seq("a", 0, 60, 2)
    scheduler.add(a)
    drive_until(scheduler, cache, lambda: a.num_computed > 0)  # its burst's 20, then an empty bucket
    assert a.num_computed == 20
    chunks = []
    pending = None
    while a.num_output == 0:
        clock.now += 0.01  # a token a step
        step, pending = run_step(scheduler, cache, pending)
        chunks += [tokens for seq, tokens in step.batch if seq is a]
    assert chunks and all(tokens >= BLOCK for tokens in chunks[:-1]), chunks


def test_without_budgets_the_steps_are_those_of_before():
    def batches(budgets) -> list:
        clock = Clock()
        scheduler = scheduler_with(budgets, clock, max_batch_tokens=16)
        cache = LedgerCache(100)
        for seq in (tenant_seq("a", 0, 40, 5), tenant_seq("b", 1, 30, 6), tenant_seq("a", 2, 7, 3)):
            scheduler.add(seq)
        steps = drive(scheduler, cache)
        assert not any(step.deferred for step in steps)
        return [[(seq.request_id, tokens) for seq, tokens in step.batch] for step in steps]

    # A budget that the clock standing still never lets run short is as none.
    assert batches(None) == batches({"a": ComputeBudget(tokens_per_s=1000, burst_tokens=1000)})


def drive_until(scheduler, cache, done, max_steps=500) -> list:
    pending, steps = None, []
    for _ in range(max_steps):
        if done():
            return steps
        step, pending = run_step(scheduler, cache, pending)
        steps.append(step)
    raise AssertionError("never done")


def test_a_speculating_sequence_proposes_only_what_its_tenant_s_bucket_still_holds():
    from model_service.sample.params import SamplingOptions
    from model_service.sched.sequence import Sequence
    from model_service.sched.step import StepOutput
    from model_service.spec.settings import SpeculativeSettings
    from model_service.spec.speculator import Speculator

    clock = Clock()
    speculator = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1),
                            BLOCK, max_model_len=0)
    scheduler = Scheduler(SchedulerLimits(block_size=BLOCK, max_num_seqs=4, max_batch_tokens=64), 100, clock=clock,
                          speculator=speculator, tenant_budgets={"a": ComputeBudget(tokens_per_s=40, burst_tokens=8)})
    cache = LedgerCache(100)
    prompt = [1, 2, 3, 4, 5, 6] * 2 + [1]  # the lookup proposes the cycle's next tokens
    seq = Sequence(request_id="r0", token_ids=prompt, prompt_len=len(prompt),
                   options=SamplingOptions(max_new_tokens=30), arrival=0, tenant="a")
    scheduler.add(seq)
    pending, proposed = None, []
    for _ in range(500):
        if pending is not None:
            assert not scheduler.apply(*pending)
        if not scheduler.has_work() and pending is None:
            break
        step = scheduler.schedule()
        held = scheduler.budgets.tokens("a")  # refilled for this step, not yet charged
        assert sum(tokens for _, tokens in step.batch) <= held
        pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
        sampled = []
        for s, new_tokens in step.batch:
            proposal = step.proposals.get(s, [])
            proposed.append(len(proposal))
            if s.num_computed + new_tokens == len(s.token_ids) + len(proposal):
                # Every proposal kept: the cycle's tokens, the one after them sampled.
                tokens = [*proposal, (proposal[-1] if proposal else s.token_ids[-1]) % 6 + 1]
                sampled += [(s, token) for token in tokens[: s.options.max_new_tokens - s.num_output]]
        scheduler.update_from_output(step, StepOutput(sampled=sampled))
        clock.now += 0.1  # 4 tokens a step
    else:
        raise AssertionError("the scheduler did not finish its work")
    assert seq.num_output == 30 and max(proposed) > 0
    assert max(proposed) < 6, "a proposal as long as the speculator's 6 would pass the bucket's 4 a step"


def test_a_reload_keeps_what_each_tenant_has_used_and_starts_new_ones_full():
    clock = Clock()
    budgets = TenantBudgets({"a": ComputeBudget(tokens_per_s=10, burst_tokens=20),
                             "b": ComputeBudget(tokens_per_s=10)}, clock)
    budgets.open_step()
    budgets.charge("a", 18)  # a holds 2 of 20: it has used 18
    budgets.charge("b", 4)  # b holds 6 of 10
    clock.now += 0.5  # five more tokens each, at the old rates
    budgets.update({"a": ComputeBudget(tokens_per_s=100, burst_tokens=200), "c": ComputeBudget(tokens_per_s=5)})
    assert budgets.tokens("a") == 200 - 13, "its use carries over to the larger bucket"
    assert budgets.tokens("b") is None and budgets.grant("b", 1000) == 1000, "taken out: no limit"
    assert budgets.tokens("c") == 5, "new: full, as at start-up"
    budgets.update({"a": ComputeBudget(tokens_per_s=1, burst_tokens=10)})
    assert budgets.tokens("a") == 0, "more used than the new bucket holds: empty, not negative"
    clock.now += 2
    budgets.open_step()
    assert budgets.tokens("a") == 2, "and it refills at the new rate"
