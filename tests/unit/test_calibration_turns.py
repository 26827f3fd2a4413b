"""The cost timings' turns: timings that settle end early without being called a budget cut; a budget that
ends the turns is reported as one."""

from __future__ import annotations

import time

from selfspec.calibration.measure import MIN_TURNS, QUIET_RUNS, _interleaved_fastest


def _variants() -> dict[str, object]:
    return {"a": lambda: None, "b": lambda: time.sleep(0.0005)}


def test_settled_timings_stop_early_and_are_not_a_cut() -> None:
    cuts: list[bool] = []
    turns: list[int] = []
    fastest = _interleaved_fastest(
        _variants(),
        50,
        until=time.perf_counter() + 60,
        on_turn=lambda d, _t: turns.append(d),
        on_cut=lambda: cuts.append(True),
    )
    assert set(fastest) == {"a", "b"}
    assert MIN_TURNS <= len(turns) < 50  # settled well before the 50 turns allowed
    assert QUIET_RUNS <= len(turns)
    assert not cuts


def test_a_budget_that_ends_the_turns_is_reported() -> None:
    cuts: list[bool] = []
    fastest = _interleaved_fastest(_variants(), 50, until=time.perf_counter() - 1, on_cut=lambda: cuts.append(True))
    assert set(fastest) == {"a", "b"}  # the warm-up's times: a tight budget's price
    assert cuts == [True]


def test_without_a_budget_nothing_is_cut() -> None:
    cuts: list[bool] = []
    _interleaved_fastest(_variants(), 4, on_cut=lambda: cuts.append(True))
    assert not cuts
