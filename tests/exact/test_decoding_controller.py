"""``auto`` never slower when sampling (sampled plan, online guard), and the calibration time budget (issue 27)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import make_model, reference_greedy

from selfspec import Draft, Drafter, SpeculativeEngine, register_drafter
from selfspec.calibration import calibrate
from selfspec.decoding.controller import WINDOW
from selfspec.drafting import DecodeState, unregister_drafter
from selfspec.drafting.auto import sampled_drafts_pay, sampled_plan_of
from selfspec.drafting.planning import DrafterCalibration
from selfspec.errors import ConfigurationError

PROMPT = list(range(10, 30))
COSTS = {"draft": 0.2, "verify": {"1": 1.1, "2": 1.2, "3": 1.3, "4": 1.4}}


class NeverRight(Drafter):
    """Proposes the token the target likes least (test only: it runs the target to find it)."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.model = engine.model

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        ids = list(state.token_ids)
        tokens = []
        with torch.inference_mode():
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([ids])).logits[0, -1]
                tokens.append(int(logits.argmin()))
                ids.append(tokens[-1])
        return Draft(tokens=tokens)


@pytest.fixture
def never_right():
    register_drafter("test_never_right", lambda engine, **_: NeverRight(engine), calibration=DrafterCalibration())
    yield "test_never_right"
    unregister_drafter("test_never_right")


def _plan(method: str) -> dict:
    return {"method": method, "settings": {"num_draft_tokens": 4}, "predicted_speedup": 1.5, "reason": "test"}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_auto_drafts_almost_nothing_where_drafts_never_land(never_right, temperature) -> None:
    model = make_model("llama", agreeing=False)
    engine = SpeculativeEngine(model, drafter="auto", calibration={"plan": _plan(never_right), "costs": COSTS})
    assert engine.plan is not None and engine.plan.method == never_right
    out = engine.generate_ids(PROMPT, max_new_tokens=150, temperature=temperature, seed=5)
    # one window of WINDOW rounds of 4 drafts (a probe), then a pause longer than the generation
    assert 0 < out.stats.num_drafted <= WINDOW * 4, out.stats
    assert out.stats.num_accepted <= 1
    if temperature == 0:
        assert out.token_ids == reference_greedy(model, PROMPT, 150)
    else:
        again = SpeculativeEngine(model, drafter="auto", calibration={"plan": _plan(never_right), "costs": COSTS})
        repeat = again.generate_ids(PROMPT, max_new_tokens=150, temperature=temperature, seed=5)
        assert repeat.token_ids == out.token_ids  # decisions from acceptance counts, not timing


def test_a_plain_sampled_plan_drafts_nothing_when_sampling_only(never_right) -> None:
    model = make_model("llama", agreeing=True)
    sampled = {"method": "none", "predicted_speedup": 0.8, "reason": "sampled drafts do not pay"}
    calibration = {"plan": _plan("early_exit") | {"settings": {"exit_layer": 2}}, "sampled_plan": sampled}
    assert not sampled_drafts_pay(calibration) and sampled_plan_of(calibration).method == "none"
    engine = SpeculativeEngine(model, drafter="auto", calibration=calibration)
    sampled_out = engine.generate_ids(PROMPT, max_new_tokens=40, temperature=0.7, seed=1)
    assert sampled_out.stats.num_drafted == 0
    greedy = engine.generate_ids(PROMPT, max_new_tokens=40)
    assert greedy.stats.num_drafted > 0 and greedy.token_ids == reference_greedy(model, PROMPT, 40)
    fixed = SpeculativeEngine(model, drafter="early_exit", exit_layer=2, calibration=calibration)
    assert fixed.generate_ids(PROMPT, max_new_tokens=40, temperature=0.7, seed=1).stats.num_drafted > 0  # named: kept


def test_calibration_saves_a_sampled_plan() -> None:
    model = make_model("llama", agreeing=True)
    engine = SpeculativeEngine(model, drafter="auto", calibration={})
    result = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3)
    assert result.sampled_plan is not None
    if result.plan.method != "none":  # replayed on sampled continuations
        assert "T=0.7" in result.sampled_plan.reason
    saved = result.to_json()
    assert saved["sampled_plan"]["method"] in ("none", result.plan.method) and saved["skipped"] == []
    engine.configure(saved)
    out = engine.generate_ids(PROMPT, max_new_tokens=20, temperature=0.7, seed=2)
    assert len(out.token_ids) == 20


def test_a_tiny_budget_stops_early_saves_a_usable_plan_and_says_what_it_skipped(caplog) -> None:
    model = make_model("llama", agreeing=True)
    engine = SpeculativeEngine(model, drafter="auto", calibration={})
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        result = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3, budget=1e-6)
    assert "layer_skip" in result.skipped and result.calibration_budget == 1e-6
    assert result.plan.method in ("none", "prompt_lookup", "early_exit", "hybrid")  # measured without extras
    saved = result.to_json()
    assert saved["skipped"] == result.skipped and saved["calibration_budget"] == 1e-6
    assert any("skipping layer_skip" in r.getMessage() for r in caplog.records)
    engine.configure(saved)
    assert engine.generate_ids(PROMPT, max_new_tokens=16).token_ids == reference_greedy(model, PROMPT, 16)
    unbounded = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3)
    assert unbounded.skipped == [] and unbounded.calibration_budget is None


@pytest.mark.parametrize("bad", [0, -1.0, "300", True])
def test_a_bad_calibration_budget_is_refused_before_loading(bad) -> None:
    with pytest.raises(ConfigurationError, match="calibration_budget"):
        SpeculativeEngine.from_pretrained("no/such-model", calibration_budget=bad)


def test_the_cli_reads_the_calibration_budget() -> None:
    from selfspec.cli.main import build_parser

    parser = build_parser()
    for verb in (["generate", "hi"], ["chat"], ["bench"], ["demo"], ["serve", "-m", "x"]):
        assert parser.parse_args([*verb, "--calibration-budget", "12.5"]).calibration_budget == 12.5
        assert parser.parse_args([*verb, "--calibration-budget", "none"]).calibration_budget is None
        assert parser.parse_args(verb).calibration_budget == 300.0
    assert parser.parse_args(["calibrate", "-m", "x", "--calibration-budget", "60"]).calibration_budget == 60.0
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--calibration-budget", "-3"])
