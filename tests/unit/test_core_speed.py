"""``selfspec.core.speed``: the one speed model (expected tokens, round costs, the per-token gate)."""

from __future__ import annotations

import random

import pytest

from selfspec.core.speed import AcceptanceEstimate, CostModel, expected_tokens, next_draft_length, worth_drafting


@pytest.mark.parametrize(("acceptance", "num_draft"), [(0.0, 3), (0.5, 1), (0.5, 4), (0.8, 6), (0.95, 16)])
def test_expected_tokens_matches_a_simulation(acceptance: float, num_draft: int) -> None:
    """Accepted prefix of i.i.d. acceptances, plus the corrected or bonus token."""
    rng = random.Random(0)
    trials = 20_000
    total = 0
    for _ in range(trials):
        accepted = 0
        while accepted < num_draft and rng.random() < acceptance:
            accepted += 1
        total += accepted + 1
    assert expected_tokens(acceptance, num_draft) == pytest.approx(total / trials, rel=0.03)


def test_expected_tokens_is_bounded() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) <= 6.0  # clamped below 1: never divides by zero
    assert expected_tokens(-1.0, 5) == 1.0


def test_round_cost_uses_the_curve_and_extrapolates_linearly() -> None:
    costs = CostModel(0.1, {1: 1.1, 2: 1.2, 4: 1.6})
    assert costs.round_cost(0) == 1.0
    assert costs.round_cost(2) == pytest.approx(0.2 + 1.2)
    assert costs.round_cost(8) == pytest.approx(0.8 + 1.6 + (0.6 / 4) * 4)  # past the longest measured length
    assert CostModel(0.0).round_cost(3) == 1.0


def test_cost_model_reads_its_json_and_refuses_garbage() -> None:
    assert CostModel.from_json({"draft": 0.2, "verify": {"1": 1.1}}) == CostModel(0.2, {1: 1.1})
    for bad in (None, [], {"verify": {"x": 1}}, {"draft": "fast"}):
        assert CostModel.from_json(bad) is None


def test_worth_drafting_compares_marginal_and_average_rates() -> None:
    flat = CostModel(0.01, {k: 1.0 + 0.01 * k for k in range(1, 17)}).round_cost
    steep = CostModel(0.3, {k: 1.0 + 0.5 * k for k in range(1, 17)}).round_cost
    assert worth_drafting(0.5, 1.0, 0, flat)  # a nearly free token that is accepted half the time
    assert not worth_drafting(0.5, 1.0, 0, steep)  # costs 0.8 of a step for half a token
    assert not worth_drafting(0.0, 1.0, 0, flat)


def test_verify_cost_interpolates_between_measured_lengths_and_extrapolates_past_them() -> None:
    costs = CostModel(0.0, {1: 1.5, 3: 2.0, 8: 2.6})
    assert costs.verify_cost(0) == 1.0
    assert costs.verify_cost(3) == 2.0
    assert abs(costs.verify_cost(2) - 1.75) < 1e-9
    assert abs(costs.verify_cost(4) - (2.0 + 0.6 / 5)) < 1e-9
    assert abs(costs.verify_cost(16) - (2.6 + 1.6 / 8 * 8)) < 1e-9  # the slope of 8 drafts from a plain step


def test_a_cheaper_wider_verify_is_padded_to_and_predicted_as_such() -> None:
    """fp32 GEMMs on an AMD EPYC: 4 rows cost less than 2 or 3, so 1-2 drafts verify as 3."""
    costs = CostModel(0.0, {1: 1.67, 2: 2.07, 3: 1.50, 4: 1.77, 6: 1.98})
    assert [costs.padded(k) for k in range(7)] == [0, 3, 3, 3, 4, 5, 6]
    assert costs.verify_cost(1) == costs.verify_cost(2) == 1.50
    assert costs.round_cost(1) == 1.50
    assert CostModel(0.0, {1: 1.50, 3: 1.46}).padded(1) == 1  # within the margin: noise, not a kernel
    assert CostModel(0.0).padded(2) == 2
def test_next_draft_length_grows_only_where_the_curve_pays() -> None:
    steep = CostModel(0.0, {1: 1.07, 2: 1.14, 3: 1.9, 4: 2.2, 8: 3.0})  # a step past 2 drafts
    assert next_draft_length(2, 2, 2, 8, steep) == 2  # 3 tokens for 1.14 steps beat 5 for 2.2 and 4 for 1.9
    assert next_draft_length(1, 1, 1, 8, steep) == 2
    flat = CostModel(0.0, {1: 1.1, 2: 1.1, 4: 1.15, 8: 1.2, 16: 1.3, 32: 1.6})
    assert next_draft_length(4, 4, 4, 32, flat) == 8
    assert next_draft_length(16, 16, 16, 32, flat) == 32
    assert next_draft_length(4, 4, 4, 32) == 8  # no curve: always
    assert next_draft_length(8, 8, 1, 32, flat) == 2  # mostly rejected: what was accepted plus one
    assert next_draft_length(8, 8, 3, 32, flat) == 4  # at most half
    assert next_draft_length(32, 32, 3, 32, flat) == 4
    assert next_draft_length(8, 8, 4, 32, flat) == 8  # half accepted: kept
    assert next_draft_length(1, 1, 0, 32, flat) == 1
    assert next_draft_length(5, 0, 0, 32, flat) == 5  # nothing drafted: nothing learnt


def test_growth_weighs_the_running_acceptance_on_a_steep_curve() -> None:
    exact_bf16 = CostModel(0.0, {1: 1.33, 2: 1.6, 4: 1.92, 6: 2.82, 12: 4.51, 32: 10.13})  # row-exact verifies
    assert next_draft_length(4, 4, 4, 32, exact_bf16) == 8  # as if every draft landed: it would grow
    assert next_draft_length(4, 4, 4, 32, exact_bf16, acceptance=0.8) == 4  # 0.8 per token: 4 is best
    assert next_draft_length(2, 2, 2, 32, exact_bf16, acceptance=0.8) == 4
    flat = CostModel(0.0, {1: 1.1, 2: 1.1, 4: 1.15, 8: 1.2, 16: 1.3, 32: 1.6})
    assert next_draft_length(8, 8, 8, 32, flat, acceptance=0.95) == 16


def test_acceptance_estimate_counts_one_failure_per_rejected_round_and_follows_the_text() -> None:
    estimate = AcceptanceEstimate()
    assert estimate.rate is None
    estimate.update(0, 0)  # a plain step says nothing
    assert estimate.rate is None
    estimate.update(8, 8)
    assert estimate.rate == 1.0
    estimate.update(4, 1)  # one success, one failure
    assert abs(estimate.rate - (0.8 * 8 + 1) / (0.8 * 8 + 1 + 1)) < 1e-9
    for _ in range(30):
        estimate.update(4, 0)
    assert estimate.rate < 0.01
