"""The calibration budget bounds every phase, the costs included, and the plan it leaves is usable (issues 44, 45)."""

from __future__ import annotations

import logging
import time

import pytest

from selfspec import SpeculativeEngine
from selfspec.calibration.measure import calibrate

#: What a budget may be exceeded by: one prompt's continuation, one timing round or one drafter's
#: measurement past the deadline (well under a second each for the demo model, a few on SmolLM2).
HEADROOM = 5.0


def _plain_greedy(engine: SpeculativeEngine, prompt: str, tokens: int) -> list[int]:
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none", calibration={})
    return plain.generate_ids(engine.encode_prompt(prompt), max_new_tokens=tokens).token_ids


def _check_bounded(engine: SpeculativeEngine, budget: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        started = time.perf_counter()
        result = calibrate(engine, max_new_tokens=32, max_draft_tokens=6, save=False, progress="lines", budget=budget)
        wall = time.perf_counter() - started
    assert wall <= budget + HEADROOM, (wall, result.phase_seconds, result.skipped)
    said = [r.getMessage() for r in caplog.records]
    # every phase said what it does and about how long it takes, the cuts were said and recorded
    assert any(line.startswith("calibrating (1/5): the model's own greedy continuations of ") for line in said), said
    assert any(line.startswith("calibrating (3/5): draft and verify costs (") for line in said), said
    assert result.skipped and all(any(what in line for line in said) for what in result.skipped)
    assert set(result.phase_seconds) >= {"continuations", "acceptance", "costs"}
    saved = result.to_json()
    assert saved["skipped"] == result.skipped and saved["calibration_budget"] == budget
    assert saved["verify_cost"] and saved["plan"]["method"]
    # the plan is usable: configured from what was saved, it decodes exactly what plain decoding does
    engine.configure(saved)
    prompt = "The quick brown fox"
    assert engine.generate_ids(engine.encode_prompt(prompt), max_new_tokens=24).token_ids == _plain_greedy(
        engine, prompt, 24
    )


def test_a_tight_budget_bounds_the_demo_models_calibration(caplog) -> None:
    engine = SpeculativeEngine.from_pretrained("selfspec-demo", calibrate=False, threads=1)
    unbounded = calibrate(engine, max_new_tokens=32, max_draft_tokens=6, save=False, progress=False)
    budget = 1.0
    assert unbounded.seconds > 2 * budget  # the budget below does cut something
    _check_bounded(engine, budget, caplog)


@pytest.mark.slow
def test_a_15_second_budget_bounds_smollm2s_calibration(smollm2_path, caplog) -> None:
    engine = SpeculativeEngine.from_pretrained(str(smollm2_path), dtype="float32", calibrate=False, threads=1)
    _check_bounded(engine, 15.0, caplog)
