"""The drafters' pilot: a drafter whose acceptance cannot pay is measured no further; a clear winner always is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from selfspec.calibration import CostModel
from selfspec.calibration.measure import (
    DROP_SLACK,
    PILOT_TOKENS,
    Continuations,
    MeasureContext,
    measure_drafters,
    pick,
    pilot_context,
    rank_candidates,
)
from selfspec.drafting import NoDrafter, register_drafter, unregister_drafter
from selfspec.drafting.planning import Candidate, DrafterCalibration

NEW_TOKENS = 32
VERIFY = {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4}  # a CPU-like verify curve
METHODS = ["pilot_test", "prompt_lookup", "early_exit", "hybrid"]  # (the others need a model)


class _Fixed(DrafterCalibration):
    """A drafter whose tokens are accepted at ``hits`` (per position); it records what it measured on."""

    figures_key = "pilot_test"

    def __init__(self) -> None:
        self.accepts = True
        self.estimate: float | None = 0.5  # what it is expected to do before measuring (None: unknown)
        self.measured_on: list[int] = []

    def expected_speedup(self, name: str, context: Any) -> float | None:
        return self.estimate

    def measure(self, name: str, context: Any) -> dict[str, Any]:
        self.measured_on.append(context.max_new_tokens)
        return {"hits": [[self.accepts] * (len(s) - start) for s, start in zip(*_rows(context.data), strict=True)]}

    def candidates(self, name: str, context: Any, figures: Any) -> list[Candidate]:
        speed = context.replay(CostModel(0.1, context.verify_cost), 4, matches=figures["hits"]).speedup
        return [Candidate(name, {"num_draft_tokens": 4}, speed, name, 0.1)]


def _rows(data: Continuations) -> tuple[list[list[int]], list[int]]:
    return data.sequences, data.starts


@pytest.fixture
def fixed() -> Iterator[_Fixed]:
    calibration = _Fixed()
    register_drafter("pilot_test", lambda engine, **options: NoDrafter(), calibration=calibration)
    try:
        yield calibration
    finally:
        unregister_drafter("pilot_test")


def _context() -> MeasureContext:
    # nothing repeats (prompt lookup copies nothing) and the early exit never agrees: the bar is plain's margin
    sequences = [list(range(100 * i, 100 * i + 8 + NEW_TOKENS)) for i in range(3)]
    data = Continuations(sequences, [8, 8, 8])
    misses = {1: [[False] * NEW_TOKENS for _ in sequences]}
    return MeasureContext(data, misses, {1: 0.2}, VERIFY, max_new_tokens=NEW_TOKENS, max_draft_tokens=4)


def test_the_pilot_is_the_start_of_every_continuation() -> None:
    context = _context()
    pilot = pilot_context(context)
    assert pilot is not None and pilot.max_new_tokens == PILOT_TOKENS
    assert [len(s) - start for s, start in zip(*_rows(pilot.data), strict=True)] == [PILOT_TOKENS] * 3
    assert all(len(hits) == PILOT_TOKENS for hits in pilot.matches[1])
    short = MeasureContext(context.data, context.matches, {1: 0.2}, VERIFY, max_new_tokens=2 * PILOT_TOKENS - 1)
    assert pilot_context(short) is None  # too short for a pilot to save anything


def test_a_drafter_whose_acceptance_cannot_pay_is_dropped_after_its_pilot(fixed) -> None:
    fixed.accepts = False
    context = _context()
    dropped: list[str] = []
    figures = measure_drafters(context, METHODS, dropped=dropped)
    assert dropped == ["pilot_test"] and fixed.measured_on == [PILOT_TOKENS]  # never measured on everything
    assert figures["pilot_test"]["hits"]  # what the pilot measured is kept (saved, so not measured at every load)
    assert all(c.method != "pilot_test" for c in rank_candidates(context, figures, dropped))


def test_a_clear_winner_is_always_measured_in_full_and_wins_even_when_expected_to_lose(fixed) -> None:
    fixed.accepts = True  # and expected at 0.5x: the pilot runs, and shows it pays
    context = _context()
    dropped: list[str] = []
    figures = measure_drafters(context, METHODS, dropped=dropped)
    assert dropped == [] and fixed.measured_on == [PILOT_TOKENS, NEW_TOKENS]
    plan, chosen = pick(rank_candidates(context, figures, dropped), METHODS)
    assert plan.method == "pilot_test" and chosen is not None and chosen.speedup > 2
    alone = _Fixed()  # the same speed as measuring without a pilot
    assert chosen.speedup == alone.candidates("pilot_test", context, alone.measure("", context))[0].speedup


@pytest.mark.parametrize("estimate", [None, 2.0])
def test_no_pilot_for_a_drafter_of_unknown_or_good_prospects(fixed, estimate) -> None:
    fixed.accepts = False
    fixed.estimate = estimate  # a learned head (unknown) or one expected to pay: measured in full at once
    dropped: list[str] = []
    measure_drafters(_context(), METHODS, dropped=dropped)
    assert fixed.measured_on == [NEW_TOKENS] and dropped == []


def test_without_a_dropped_list_there_is_no_pilot(fixed) -> None:
    fixed.accepts = False
    figures = measure_drafters(_context(), METHODS, dropped=None)
    assert fixed.measured_on == [NEW_TOKENS] and figures["pilot_test"]["hits"]


def test_the_slack_keeps_a_drafter_near_the_bar(fixed) -> None:
    fixed.accepts = False
    context = _context()
    pilot = pilot_context(context)
    assert pilot is not None
    slow = fixed.candidates("pilot_test", pilot, fixed.measure("pilot_test", pilot))[0].speedup
    assert slow * DROP_SLACK < 1.05  # what the drop test above relies on: well under plain's margin
    fixed.accepts = True
    fast = fixed.candidates("pilot_test", pilot, fixed.measure("pilot_test", pilot))[0].speedup
    assert fast > 1.05 * DROP_SLACK
