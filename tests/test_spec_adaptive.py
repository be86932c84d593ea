"""Adaptive proposal lengths (--speculative-max-tokens, spec/adaptive.py): a sequence's
length follows what it keeps, and a step verifies the proposed positions likeliest to be
kept, as many as its measured cost says pay."""

from __future__ import annotations

import pytest

from model_service.sample.params import SamplingOptions
from model_service.sched.sequence import Sequence
from model_service.spec.adaptive import GROW, ProposalState, row_chances
from model_service.spec.settings import MAX_SPECULATIVE_TOKENS, SpeculativeSettings
from model_service.spec.speculator import Speculator
from model_service.spec.step_costs import StepCosts

COPIED = list(range(1, 21)) + [1]  # the lookup proposes what followed the first 1: up to 20 tokens


def sequence(name: str, tokens: list[int] = COPIED, blocks: int = 16) -> Sequence:
    seq = Sequence(name, list(tokens), prompt_len=len(tokens) - 1, arrival=0,
                   options=SamplingOptions(max_new_tokens=1000))
    seq.block_table = list(range(blocks))
    seq.num_computed = len(tokens) - 1
    return seq


def adaptive(max_tokens: int = 12, k: int = 3, **fields) -> Speculator:
    settings = SpeculativeSettings(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                                   max_speculative_tokens=max_tokens, **fields)
    return Speculator(settings, block_size=4, max_model_len=0)


def test_the_length_grows_after_whole_proposals_kept_and_shrinks_after_cut_ones():
    state = ProposalState(length=3)
    state.settle(3, 3, longest=8)
    assert state.length == 3 + GROW
    state.settle(5, 5, longest=8)
    state.settle(7, 7, longest=8)
    assert state.length == 8  # never past the longest
    state.settle(8, 2, longest=8)
    assert state.length == 7
    for _ in range(20):
        state.settle(state.length, 0, longest=8)
    assert state.length == 1  # never below one token


def test_the_continuation_chance_counts_kept_tokens_against_cut_proposals():
    state = ProposalState(length=3)
    assert state.continuation(0.6) == pytest.approx(0.6)  # nothing seen: the server's
    for _ in range(50):
        state.settle(4, 3, longest=8)  # three kept, then one cut: q = 3 / 4
    assert state.continuation(0.0) == pytest.approx(150 / 200 * 200 / 202)
    assert 0.74 < state.continuation(0.6) < 0.76


def test_rows_come_likeliest_first_and_each_proposal_in_order():
    a, b = sequence("a"), sequence("b")
    rows = row_chances({a: [7, 7, 7], b: [8, 8]}, {a: 0.9, b: 0.5})
    assert [(seq.request_id, i) for _, seq, i in rows] == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]
    assert rows[1][0] == pytest.approx(0.81)
    sure = row_chances({a: [7, 7], b: [8, 8]}, {a: 1.0, b: 1.0})
    assert [i for _, _, i in sure] == [1, 1, 2, 2]  # ties keep positions in order


def test_a_position_past_a_fork_the_proposer_saw_ranks_below_a_sure_one():
    a, b = sequence("a"), sequence("b")
    # Both sequences keep 90 % of their tokens; a's proposer saw its second token follow
    # only half of the time, b's saw one way on.
    rows = row_chances({a: [7, 7, 7], b: [8, 8]}, {a: 0.9, b: 0.9}, {a: [1.0, 0.5, 0.5]})
    assert [(seq.request_id, i) for _, seq, i in rows] == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("a", 3)]
    assert rows[3][0] == pytest.approx(0.81 * 0.5)


def test_an_adaptive_sequence_proposes_more_as_its_proposals_are_kept():
    speculator = adaptive(max_tokens=12, k=3)
    seq = sequence("s")
    assert speculator.propose(seq, 99) == [2, 3, 4]  # starts at --num-speculative-tokens
    speculator.settle(seq, 3, 3)
    assert speculator.propose(seq, 99) == [2, 3, 4, 5, 6]
    speculator.settle(seq, 5, 5)
    speculator.settle(seq, 7, 7)
    speculator.settle(seq, 9, 9)
    assert len(speculator.propose(seq, 99)) == 11
    speculator.settle(seq, 11, 0)
    assert len(speculator.propose(seq, 99)) == 10
    # Without --speculative-max-tokens the length stays K whatever is kept.
    fixed = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
                       block_size=4, max_model_len=0)
    fixed.settle(seq, 3, 3)
    assert fixed.propose(seq, 99) == [2, 3, 4]


def test_long_proposals_with_their_heads_kept_do_not_turn_speculation_off():
    # An eighth of what is proposed is kept (under the fixed-length rule's fifth), but each
    # token after a kept one is kept with chance 2/3: worth proposing, a token or two.
    speculator = adaptive(max_tokens=16)
    seq = sequence("s")
    for _ in range(10):
        speculator.settle(seq, 16, 2)
    assert not seq.spec_off
    for _ in range(100):
        speculator.settle(seq, 1, 0)
    assert seq.spec_off


def test_a_step_verifies_the_likeliest_positions_its_cost_pays_for():
    speculator = adaptive(max_tokens=8)
    sure, unsure = sequence("sure"), sequence("unsure")
    for _ in range(20):
        speculator.settle(sure, 4, 4)
        speculator.settle(unsure, 4, 0)
    proposals = {unsure: [2, 3, 4, 5], sure: [2, 3, 4, 5]}
    # Flat up to 6 rows, then a row costs a whole step: two decodes take 4 proposed rows,
    # and they go to the sequence whose tokens are kept.
    for rows, seconds in ((1, 0.01), (2, 0.01), (6, 0.01), (7, 0.02), (10, 0.05)):
        speculator.step_took(rows, seconds)
    assert speculator.trim(2, 64, proposals) == {sure: [2, 3, 4, 5]}
    assert speculator.trim(2, 3, proposals) == {sure: [2, 3, 4]}  # the step's token budget
    always = adaptive(max_tokens=8, always=True)
    assert always.trim(2, 6, proposals) == {unsure: [2, 3, 4], sure: [2, 3, 4]}  # nothing known: the prior


def test_rows_worth_weighs_each_row_by_its_own_chance():
    costs = StepCosts()
    for rows, seconds in ((1, 0.010), (2, 0.011), (3, 0.012), (4, 0.013), (5, 0.014)):
        costs.record(rows, seconds)
    # Each row costs a tenth of a step: a row kept with chance 0.5 pays, one at 0.05 does not.
    assert costs.rows_worth(1, [0.9, 0.5, 0.05, 0.01]) == 2
    assert costs.rows_worth(1, [0.9, 0.8, 0.7, 0.6]) == 4
    assert costs.rows_worth(1, []) == 0


@pytest.mark.parametrize("fields, phrase", [
    ({"max_speculative_tokens": 2}, "--speculative-max-tokens must be 0 \\(a fixed length\\) or from "
                                    "--num-speculative-tokens \\(3\\) to 16, got 2"),
    ({"max_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "--speculative-max-tokens must be 0"),
    ({"max_speculative_tokens": -1}, "--speculative-max-tokens must be 0"),
])
def test_bad_max_tokens_say_which_flag(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        SpeculativeSettings(method="ngram", **fields)


def test_the_max_tokens_default_keeps_a_fixed_length():
    assert not SpeculativeSettings(method="ngram").adaptive
    assert SpeculativeSettings(method="ngram").longest == 3
    assert SpeculativeSettings(method="ngram", max_speculative_tokens=16).longest == 16


def test_a_fresh_server_whose_first_proposal_failed_goes_on_proposing():
    speculator = adaptive(max_tokens=8)
    for rows in range(1, 20):
        speculator.step_took(rows, 0.01)  # every count measured, all as cheap as one row
    first = sequence("first")
    assert speculator.proposals([first], 64, lambda seq, most: most) == {first: [2, 3, 4]}
    speculator.settle(first, 3, 0)  # the server's only verification so far kept nothing
    later = sequence("later")
    assert speculator.proposals([first, later], 64, lambda seq, most: most) != {}
