"""``selfspec.decoding.controller``: the draft length follows acceptance; speculation that does not pay pauses."""

from __future__ import annotations

from selfspec.core.speed import CostModel
from selfspec.decoding.controller import FALLBACK_ROUNDS, MAX_FALLBACK_ROUNDS, WINDOW, DraftController


def test_a_fixed_controller_never_adapts() -> None:
    controller = DraftController(4)
    for _ in range(50):
        controller.record(4, 0, 1, 1.0)
    assert controller.budget() == 4 and controller.fallbacks == 0


def test_the_length_doubles_on_full_acceptance_and_halves_on_rejection() -> None:
    controller = DraftController(2, adaptive=True, timed=False, max_draft_tokens=16)
    for expected in (4, 8, 16, 16):  # doubles, capped
        drafted = controller.budget()
        controller.record(drafted, drafted, drafted + 1, 0.0)
        assert controller.budget() == expected
    controller.record(16, 7, 8, 0.0)  # 7 of 16: down to what was accepted plus one
    assert controller.budget() == 8
    controller.record(8, 5, 6, 0.0)  # more than half accepted: unchanged
    assert controller.budget() == 8
    controller.record(8, 0, 1, 0.0)
    assert controller.budget() == 1
    controller.record(1, 1, 2, 0.0)
    controller.start_call()  # a new call: the calibrated length, a fresh acceptance estimate
    assert controller.budget() == 2 and controller.acceptance.rate is None


def test_the_longest_draft_follows_the_calibrated_curve() -> None:
    flat = CostModel(0.0, {1: 1.0, 2: 1.0, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.5})
    assert DraftController(4, adaptive=True, timed=False, costs=flat).max_draft_tokens == 32
    assert DraftController(4, adaptive=True, timed=False).max_draft_tokens == 8  # no curve: the default


def test_untimed_with_costs_pauses_where_drafts_do_not_pay_and_probes_again() -> None:
    costs = CostModel(0.5, {k: 1.0 + 0.2 * k for k in range(1, 9)})  # a rejected draft of 4 costs 3.8 steps
    controller = DraftController(4, adaptive=True, timed=False, costs=costs)
    for _ in range(WINDOW):
        controller.record(controller.budget(), 1, 2, 0.0)  # one draft lands a round: 1.9 steps a token
    assert controller.fallbacks == 1 and controller.budget() == 0
    for _ in range(FALLBACK_ROUNDS):
        assert controller.budget() == 0
        controller.record(0, 0, 1, 0.0)
    assert controller.budget() > 0  # the pause is over: speculation is probed again


def test_timed_measures_a_plain_step_first_and_falls_back_when_slower() -> None:
    controller = DraftController(2, adaptive=True, timed=True)
    assert controller.budget() == 0  # no plain measurement yet
    controller.record(0, 0, 1, 1.0)  # a plain step: 1 s per token
    for _ in range(WINDOW):
        assert controller.budget() > 0
        controller.record(2, 0, 1, 1.5)  # 1.5 s per token speculating
    assert controller.fallbacks == 1 and controller.budget() == 0


def test_sampling_gets_a_fresh_untimed_controller_with_the_same_costs() -> None:
    costs = CostModel(0.1, {1: 1.1})
    shared = DraftController(3, adaptive=True, costs=costs)
    shared.record(0, 0, 1, 1.0)
    fresh = shared.for_sampling()
    assert not fresh.timed and fresh.costs == costs and fresh.rounds == 0 and fresh.budget() == 3


def test_no_draft_landing_in_a_window_pauses_longest_at_once() -> None:
    controller = DraftController(4, adaptive=True, timed=False, costs=CostModel(0.5, {4: 1.8}))
    for _ in range(WINDOW):
        controller.record(controller.budget(), 0, 1, 0.0)
    assert controller.fallback_left == MAX_FALLBACK_ROUNDS


def test_sampling_drafts_nothing_where_calibration_found_sampled_drafts_do_not_pay() -> None:
    shared = DraftController(3, adaptive=True, costs=CostModel(0.1, {1: 1.1}), sampling_drafts=False)
    fresh = shared.for_sampling()
    assert fresh.budget() == 0 and not fresh.adaptive
    shared.record(0, 0, 1, 1.0)  # greedy calls: a plain step measured, then drafts
    assert shared.budget() == 3


def test_a_pause_for_drafts_that_did_not_pay_ends_with_its_call() -> None:
    controller = DraftController(4, adaptive=True, timed=False, costs=CostModel(0.5, {4: 1.5}))
    while controller.budget() > 0:
        controller.record(4, 1, 2, seconds=0.0)  # one draft lands a round: 1.75 steps a token
    assert controller.fallback_left == FALLBACK_ROUNDS
    controller.start_call()  # another text: speculation is judged afresh
    assert controller.fallback_left == 0 and controller.budget() == 4
    while controller.budget() > 0:
        controller.record(4, 1, 2, seconds=0.0)
    assert controller.fallback_left == 2 * FALLBACK_ROUNDS  # the doubled pause carried over


def test_a_pause_for_drafts_that_never_land_carries_over_to_the_next_call() -> None:
    controller = DraftController(4, adaptive=True, timed=False, costs=CostModel(0.5, {4: 1.8}))
    for _ in range(WINDOW):
        controller.record(controller.budget(), 0, 1, 0.0)
    controller.start_call()
    assert controller.fallback_left == MAX_FALLBACK_ROUNDS and controller.budget() == 0
