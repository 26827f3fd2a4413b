"""``threads="auto"``: the chooser, the candidate counts, the re-check policy and the summary (no model)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from selfspec.calibration.threads import (
    LOAD_CHANGE,
    RECHECK_SECONDS,
    ROUNDS,
    STEPS_PER_ROUND,
    WARMUP_STEPS,
    AutoThreads,
    ThreadChoice,
    candidate_counts,
    choose_thread_count,
    load_average,
    measure_choice,
    recheck_counts,
    recheck_due,
    threads_from_environment,
    time_thread_counts,
)
from selfspec.errors import ConfigurationError


@pytest.fixture(autouse=True)
def one_thread_after() -> Iterator[None]:
    """The tests set torch's thread count; the suite runs at one."""
    yield
    torch.set_num_threads(1)


def test_the_chooser_keeps_the_fastest_count() -> None:
    assert choose_thread_count({1: 9.8, 2: 31.0}) == 1  # a loaded 2-core machine
    assert choose_thread_count({1: 20.0, 2: 11.0, 3: 12.5, 4: 14.0}) == 2
    assert choose_thread_count({1: 20.0, 2: 11.0, 4: 10.0}) == 4


def test_a_tie_goes_to_fewer_threads() -> None:
    assert choose_thread_count({1: 10.0, 2: 10.0}) == 1
    assert choose_thread_count({1: 10.3, 2: 10.0}) == 1  # within 5%: one thread leaves a core free
    assert choose_thread_count({1: 10.6, 2: 10.0}) == 2
    assert choose_thread_count({1: 10.3, 2: 10.0}, tolerance=0.0) == 2


def test_one_count_and_no_counts() -> None:
    assert choose_thread_count({1: 12.0}) == 1
    with pytest.raises(ValueError, match="no thread timings"):
        choose_thread_count({})


def test_the_candidates_are_every_count_up_to_eight_then_a_few_to_the_cores() -> None:
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [1, 2]
    assert candidate_counts(8) == list(range(1, 9))
    assert candidate_counts(20) == [*range(1, 9), 12, 16, 20]


def test_a_recheck_needs_a_big_load_change_and_an_old_choice() -> None:
    old = RECHECK_SECONDS + 1
    assert recheck_due(1.0, 1.0 + LOAD_CHANGE, old)
    assert recheck_due(3.0, 3.0 - LOAD_CHANGE, old)
    assert not recheck_due(1.0, 1.0 + LOAD_CHANGE / 2, old)
    assert not recheck_due(1.0, 5.0, RECHECK_SECONDS / 2)  # at most one per RECHECK_SECONDS
    assert not recheck_due(None, 5.0, old) and not recheck_due(1.0, None, old)  # no load average here


def test_a_recheck_times_the_current_count_and_one_neighbour() -> None:
    assert recheck_counts(2, 2, load_rose=True) == [1, 2]
    assert recheck_counts(1, 2, load_rose=False) == [1, 2]
    assert recheck_counts(1, 2, load_rose=True) == [1]
    assert recheck_counts(8, 16, load_rose=True) == [4, 8]
    assert recheck_counts(16, 16, load_rose=False) == [16]


def test_the_environment_fixes_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_THREADS", "3")
    assert threads_from_environment() == 3
    monkeypatch.setenv("SELFSPEC_THREADS", "")
    assert threads_from_environment() is None
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("SELFSPEC_THREADS", bad)
        with pytest.raises(ConfigurationError, match=r"\$SELFSPEC_THREADS must be an int >= 1"):
            threads_from_environment()


def test_the_summary_says_the_count_the_timings_and_the_load() -> None:
    measured = ThreadChoice(1, "auto", {1: 9.8, 2: 31.0}, load=3.2, cores=2)
    assert measured.summary() == "threads=1 (auto: 1 thread 9.8 ms/step, 2 threads 31 ms/step, load 3.2)"
    assert ThreadChoice(2, "given").summary() == "threads=2 (given)"
    assert ThreadChoice(1, "environment").summary() == "threads=1 (auto: $SELFSPEC_THREADS=1)"
    assert ThreadChoice(1, "one core", load=0.5).summary() == "threads=1 (auto: one core, load 0.5)"


def _slower_with_more_threads() -> None:
    """A step that, like a decode step on a busy machine, takes longer at more threads."""
    time.sleep(0.002 * torch.get_num_threads() ** 2)


def test_the_timing_is_per_count_and_the_choice_sets_torch() -> None:
    timed = time_thread_counts(_slower_with_more_threads, [1, 2], rounds=2, steps=2)
    assert set(timed) == {1, 2} and timed[1] < timed[2]
    choice = measure_choice(_slower_with_more_threads, cores=2)
    assert (choice.threads, choice.how, sorted(choice.step_ms)) == (1, "auto", [1, 2])
    assert torch.get_num_threads() == 1


def _step_taking(ms: dict[int, float], others: float) -> Callable[[], None]:
    """A step that takes ``ms[count]`` milliseconds at ``count`` threads and ``others`` at any other count.

    A count made slower stands for one that meets a busy core. The gaps are tens of milliseconds:
    far more than a sleep's jitter on a loaded machine.
    """

    def step() -> None:
        time.sleep(ms.get(torch.get_num_threads(), others) / 1000)

    return step


@pytest.mark.parametrize("slowed", [1, 2])
def test_the_choice_is_the_count_not_made_slower(slowed: int) -> None:
    choice = measure_choice(_step_taking({slowed: 35.0}, 3.0), cores=2)
    other = 3 - slowed
    assert (choice.threads, torch.get_num_threads()) == (other, other), choice.summary()
    assert choice.step_ms[slowed] > choice.step_ms[other] + 20


def test_with_more_cores_the_fastest_count_wins_not_the_fewest_nor_the_most() -> None:
    choice = measure_choice(_step_taking({2: 2.0}, 20.0), cores=4)
    assert choice.threads == 2 and set(choice.step_ms) == {1, 2, 3, 4}, choice.summary()
    assert measure_choice(_step_taking({4: 2.0}, 20.0), cores=4).threads == 4


def test_a_count_far_slower_is_timed_no_more() -> None:
    steps: Counter[int] = Counter()
    made_slower = _step_taking({2: 35.0}, 3.0)

    def step() -> None:
        steps[torch.get_num_threads()] += 1
        made_slower()

    timed = time_thread_counts(step, [1, 2])
    assert choose_thread_count(timed) == 1
    assert steps[1] == WARMUP_STEPS + ROUNDS * STEPS_PER_ROUND
    assert steps[2] == WARMUP_STEPS + STEPS_PER_ROUND  # dropped after the first round


def test_a_load_change_has_the_choice_timed_again() -> None:
    here = load_average()
    if here is None:
        pytest.skip("no load average on this platform")
    torch.set_num_threads(2)
    stale = ThreadChoice(2, "auto", {1: 50.0, 2: 10.0}, load=here - 10 * LOAD_CHANGE, cores=2)
    tuner = AutoThreads(stale, _slower_with_more_threads)
    assert not tuner.on_request()  # a choice younger than RECHECK_SECONDS stands
    assert tuner.on_request(now=time.monotonic() + RECHECK_SECONDS + 1)
    assert (tuner.choice.threads, tuner.choice.rechecks, torch.get_num_threads()) == (1, 1, 1)
    assert tuner.choice.load is not None and abs(tuner.choice.load - here) < LOAD_CHANGE
    assert not AutoThreads(ThreadChoice(2, "given")).on_request(now=time.monotonic() + 10 * RECHECK_SECONDS)


def test_each_call_sets_its_engines_count() -> None:
    torch.set_num_threads(2)  # another engine's call, or the application
    assert not AutoThreads(ThreadChoice(1, "given")).on_request()
    assert torch.get_num_threads() == 1


def test_the_flag_is_in_serve_help() -> None:
    from selfspec.cli.main import build_parser

    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    assert "--threads THREADS torch CPU threads: 'auto' (default;" in text
