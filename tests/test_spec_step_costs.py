"""When verifying proposals pays (spec/step_costs.py): measured step seconds by rows against
the share of proposed tokens kept."""

from __future__ import annotations

import pytest

from model_service.spec.step_costs import PRIOR_ACCEPTANCE, StepCosts


def costs_of(seconds_by_rows: dict[int, float], kept: tuple[int, int] | None = None) -> StepCosts:
    costs = StepCosts()
    for rows, seconds in seconds_by_rows.items():
        costs.record(rows, seconds)
    if kept is not None:
        costs.settle(*kept)
    return costs


def test_where_reading_the_weights_sets_the_time_every_proposal_is_worth_verifying():
    costs = costs_of({1: 0.020, 4: 0.021, 8: 0.022, 32: 0.024}, kept=(10, 5))
    assert costs.allowance(1, 3) == 3
    assert costs.allowance(8, 24) == 24


def test_where_the_products_set_the_time_no_proposal_is_verified():
    # Seconds in step with rows: a rejected row costs as much as a kept one.
    costs = costs_of({rows: 0.001 * rows for rows in (8, 16, 24, 32)}, kept=(10, 6))
    assert costs.allowance(8, 24) == 0


def test_a_mixed_curve_takes_the_count_that_appends_the_most_tokens_a_second():
    # Flat up to 16 rows, then in step with rows: 8 decodes gain up to 8 proposed rows.
    costs = costs_of({8: 0.010, 16: 0.010, 32: 0.020, 64: 0.040}, kept=(10, 5))
    assert costs.allowance(8, 56) == 8


def test_a_row_count_never_measured_is_tried_so_that_it_gets_measured():
    costs = costs_of({8: 0.010})
    assert costs.allowance(8, 24) == 1  # the first count past what is known
    assert costs_of({}).allowance(4, 12) == 12  # nothing known: speculate, and measure
    costs.record(9, 0.010)
    costs.record(32, 0.040)
    assert costs.allowance(8, 24) == 1  # between 9 and 32 rows, read off the line between them


def test_estimates_read_between_measured_counts_and_follow_new_measurements():
    costs = costs_of({4: 0.010, 12: 0.030})
    assert costs.estimate(8) == pytest.approx(0.020)
    assert costs.estimate(2) == 0.010  # fewer rows than any measured: no cheaper than the least
    assert costs.estimate(13) is None
    costs.record(4, 0.050)
    assert 0.010 < costs.estimate(4) < 0.050  # a moving average, not the last step alone


def test_the_kept_share_starts_at_the_prior_and_follows_verifications():
    costs = StepCosts()
    assert costs.acceptance == PRIOR_ACCEPTANCE
    costs.settle(10, 1)
    assert costs.acceptance == pytest.approx((1 + 1) / (10 + 2))  # the prior weighs two proposed tokens
    for _ in range(200):
        costs.settle(10, 9)
    assert 0.85 < costs.acceptance <= 0.9


def test_a_server_whose_first_proposals_all_failed_still_finds_rows_worth_verifying():
    costs = StepCosts()
    for rows in range(1, 40):
        costs.record(rows, 0.010)  # every count measured: no row is verified only to be timed
    for _ in range(3):
        costs.settle(3, 0)
    assert 0 < costs.acceptance < 0.1 and 0 < costs.continuation < 0.5
    assert costs.allowance(1, 3) > 0  # a row that costs nothing is still worth its small chance
