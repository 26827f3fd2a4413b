"""``threads="auto"`` on a real (tiny) engine: an int count, said in the plan and ``repr``; the text unchanged."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_calibration_saving import save_tiny_model
from tiny_models import reference_greedy

from selfspec import SpeculativeEngine
from selfspec.calibration.threads import candidate_counts, measure_choice, plain_step, usable_cores

AUTO = re.compile(r"threads=(\d+) \(auto: ")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A tiny Llama folder, a fresh cache, ``$SELFSPEC_THREADS`` unset (the suite fixes it to 1); one thread after."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SELFSPEC_THREADS", raising=False)
    yield save_tiny_model(tmp_path / "tiny")
    torch.set_num_threads(1)


def test_auto_chooses_an_int_and_says_so_in_the_plan_and_repr(folder: Path) -> None:
    engine = SpeculativeEngine.from_pretrained(folder, threads="auto", calibrate=False)
    choice = engine.thread_choice
    assert isinstance(choice.threads, int) and choice.threads == torch.get_num_threads()
    assert choice.threads in candidate_counts(usable_cores())
    assert engine.plan is not None
    for text in (engine.plan.summary(), repr(engine)):
        found = AUTO.search(text)
        assert found is not None and int(found.group(1)) == choice.threads, text
    if usable_cores() > 1:  # every count was timed (the chosen one to the end)
        assert set(choice.step_ms) == set(candidate_counts(usable_cores())) and choice.load is not None
        assert "ms/step" in repr(engine)
    prompt = [5, 9, 14, 3, 7, 11]
    expected = reference_greedy(engine.model, prompt, 12)
    assert engine.generate_ids(prompt, max_new_tokens=12).token_ids == expected


def test_a_given_count_is_set_and_none_leaves_torch_alone(folder: Path) -> None:
    given = SpeculativeEngine.from_pretrained(folder, threads=1, calibrate=False, drafter="none")
    assert torch.get_num_threads() == 1 and given.thread_choice.summary() == "threads=1 (given)"
    assert "threads=1 (given)" in repr(given)
    torch.set_num_threads(2)
    untouched = SpeculativeEngine.from_pretrained(folder, threads=None, calibrate=False, drafter="none")
    assert torch.get_num_threads() == 2 and untouched.thread_choice is None and "threads=" not in repr(untouched)


@pytest.mark.parametrize("slowed", [1, 2])
def test_the_choice_follows_the_real_step_when_one_count_is_made_slower(folder: Path, slowed: int) -> None:
    if usable_cores() < 2:
        pytest.skip("one usable core: there is no choice to make")
    engine = SpeculativeEngine.from_pretrained(folder, threads=1, calibrate=False, drafter="none")
    step = plain_step(engine.runner)  # the step "auto" times: one token through every layer, a KV cache

    def made_slower() -> None:  # as when the count meets a core another process holds
        step()
        if torch.get_num_threads() == slowed:
            time.sleep(0.05)

    choice = measure_choice(made_slower, cores=2)
    assert choice.threads == 3 - slowed == torch.get_num_threads(), choice.summary()
    assert choice.step_ms[slowed] > 50 > choice.step_ms[3 - slowed], choice.summary()
