"""Calibration and drafter='auto': the plan, the saved file's version and machine, the online guard."""

from __future__ import annotations

import json

import torch
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.calibration import CALIBRATION_VERSION, CostModel, DraftController, load_calibration, save_calibration
from selfspec.calibration.measure import Continuations, choose_plan, replay


def test_plan_is_plain_when_no_draft_is_ever_accepted() -> None:
    data = Continuations([list(range(40))], [8])  # nothing repeats: lookup has nothing to copy
    misses = {1: [[False] * 32], 2: [[False] * 32]}
    plan, candidates, _ = choose_plan(data, misses, {1: 0.2, 2: 0.3}, {1: 1.1, 2: 1.2, 3: 1.3})
    assert plan.method == "none" and "no method beats plain" in plan.reason
    assert candidates["none"] == 1.0 and all(v <= 1.0 for v in candidates.values())


def test_plan_copies_where_the_text_repeats_and_drafts_where_the_exit_agrees() -> None:
    span = list(range(10, 30))
    data = Continuations([[*span, 1, *span]], [21])  # the answer copies the prompt
    plan, _, _ = choose_plan(data, {1: [[False] * 20]}, {1: 0.2}, {1: 1.05, 2: 1.1, 3: 1.15, 4: 1.2})
    assert plan.method == "prompt_lookup" and plan.predicted_speedup > 1.5
    fresh = Continuations([list(range(60))], [10])
    plan, _, (layer, _, speed) = choose_plan(fresh, {2: [[True] * 50]}, {2: 0.1}, {1: 1.05, 2: 1.1, 3: 1.15})
    assert plan.method in ("early_exit", "hybrid") and plan.settings["exit_layer"] == layer == 2 and speed > 1.5


def test_replay_of_plain_decoding_costs_one_step_per_token() -> None:
    data = Continuations([list(range(30))], [10])
    result = replay(data, CostModel(0.0, {1: 1.1}), 2)
    assert result.tokens == 20 and result.speedup == 1.0


def test_old_or_foreign_calibration_is_measured_again(tmp_path) -> None:
    save_calibration(tmp_path, {"exit_layer": 2})
    assert load_calibration(tmp_path)["version"] == CALIBRATION_VERSION
    data = json.loads((tmp_path / "selfspec.json").read_text())
    (tmp_path / "selfspec.json").write_text(json.dumps({**data, "machine": "another machine"}))
    assert load_calibration(tmp_path) is None
    (tmp_path / "selfspec.json").write_text(json.dumps({**data, "version": 1}))
    assert load_calibration(tmp_path) is None
    (tmp_path / "selfspec.json").write_text("{not json")
    assert load_calibration(tmp_path) is None


def test_guard_pauses_sampling_where_drafts_do_not_pay() -> None:
    model = make_model("llama", agreeing=False)
    costs = {"draft": 1.5, "verify": {"1": 1.1, "2": 1.2, "3": 1.3, "4": 1.4}}  # a draft costs more than it saves
    engine = SpeculativeEngine(model, exit_layer=2, calibration={"costs": costs})  # adaptive early exit
    prompt = list(range(10, 30))
    out = engine.generate_ids(prompt, max_new_tokens=120, temperature=1.0, seed=3)
    rounds = out.stats.target_forwards - 1
    assert out.stats.num_drafted < rounds  # most rounds decoded plainly after the guard fired
    again = engine.generate_ids(prompt, max_new_tokens=120, temperature=1.0, seed=3)
    assert again.token_ids == out.token_ids  # decisions from acceptance, not timing: reproducible


def test_guard_pauses_double_and_reset() -> None:
    controller = DraftController(4, adaptive=True, timed=False, costs=CostModel(0.5, {4: 1.5}))
    pauses = []
    for _ in range(3):
        while controller.budget() > 0:
            controller.record(4, 0, 1, seconds=0.0)
        pauses.append(controller.fallback_left)
        while controller.budget() == 0:
            controller.record(0, 0, 1, seconds=0.0)
    assert pauses == [32, 64, 128]


def test_auto_drafter_is_exact_and_shows_its_plan(tmp_path) -> None:
    model = make_model("llama", agreeing=True)
    engine = SpeculativeEngine(model, drafter="auto")
    assert engine.plan is not None and not engine.plan.calibrated and "plan=" in repr(engine)
    from selfspec.calibration import calibrate

    result = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3)
    engine.configure(result.to_json())
    assert engine.plan is not None and engine.plan.calibrated and engine.plan.method == result.plan.method
    prompt = list(range(10, 30))
    assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == reference_greedy(model, prompt, 24)
    torch.manual_seed(0)


# ----------------------------------------------------------------------------- EAGLE heads as a candidate


def _speed(candidates: dict[str, float], prefix: str) -> float:
    (speed,) = [v for k, v in candidates.items() if k.startswith(prefix)]
    return speed


def _eagle_figures(folder: str, accepted: list[int], draft_cost: float = 0.05) -> dict:
    return {"head": folder, "num_draft_tokens": 3, "draft_cost": draft_cost, "accepted_per_round": accepted}


def test_calibration_measures_a_fitting_eagle_head_and_the_plan_considers_it(tmp_path) -> None:
    from selfspec.calibration import calibrate
    from selfspec.drafting.eagle.head import EagleHead

    model = make_model("llama", agreeing=True)
    torch.manual_seed(0)
    folder = str(EagleHead(model).save(tmp_path / "head"))  # a random head (its layer a copy of the last)
    engine = SpeculativeEngine(model, drafter="auto")
    result = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3, eagle_head=folder)
    eagle = result.figures["eagle"]
    assert eagle["head"] == folder and eagle["draft_cost"] > 0 and eagle["num_draft_tokens"] == 3
    assert eagle["accepted_per_round"] and all(0 <= n <= 3 for n in eagle["accepted_per_round"])
    assert any(name.startswith("eagle(k=") for name in result.candidates)
    assert any(name.startswith("eagle_hybrid(k=") for name in result.candidates)
    saved = result.to_json()
    assert saved["eagle"]["head"] == folder
    if result.plan.method.startswith("eagle"):  # its cost model is the head's
        assert saved["costs"]["draft"] == eagle["draft_cost"]
    skipped = calibrate(engine, save=False, progress=False, max_new_tokens=8, max_draft_tokens=2, eagle_head=False)
    assert skipped.figures["eagle"] == {} and not any(name.startswith("eagle") for name in skipped.candidates)


def test_plan_picks_the_eagle_head_when_it_is_better_and_never_when_it_loses(tmp_path) -> None:
    data = Continuations([list(range(60))], [10])  # nothing to copy
    misses = {1: [[False] * 50]}
    verify = {1: 1.05, 2: 1.1, 3: 1.15}
    good = _eagle_figures("h", [3] * 30)
    plan, candidates, _ = choose_plan(data, misses, {1: 0.2}, verify, figures={"eagle": good})
    assert plan.method == "eagle" and plan.settings["eagle_head"] == "h" and plan.predicted_speedup > 2.0
    assert round(candidates["eagle(k=3)"], 3) == plan.predicted_speedup
    bad = _eagle_figures("h", [0] * 30, draft_cost=0.3)  # never accepted: plain decoding
    plan, candidates, _ = choose_plan(data, misses, {1: 0.2}, verify, figures={"eagle": bad})
    assert plan.method == "none" and _speed(candidates, "eagle(") < 1.0
    # where the text repeats, copy-only rounds beat the head alone
    span = list(range(10, 30))
    copying = Continuations([[*span, 1, *span, *range(40, 60)]], [21])
    half = _eagle_figures("h", [1, 2] * 15)
    plan, candidates, _ = choose_plan(copying, {1: [[False] * 40]}, {1: 0.2}, verify, figures={"eagle": half})
    assert _speed(candidates, "eagle_hybrid(") > _speed(candidates, "eagle(")
    # forced: only the head (and plain decoding) may be chosen
    plan, _, _ = choose_plan(
        copying, {1: [[False] * 40]}, {1: 0.2}, verify, figures={"eagle": half}, methods=("eagle",)
    )
    assert plan.method in ("eagle", "none")


def test_auto_runs_a_planned_eagle_head_exactly(tmp_path, caplog) -> None:
    from selfspec.calibration import Plan
    from selfspec.drafting.eagle.drafter import EagleDrafter
    from selfspec.drafting.eagle.head import EagleHead

    model = make_model("llama", agreeing=True)
    torch.manual_seed(0)
    folder = str(EagleHead(model).save(tmp_path / "head"))
    prompt = list(range(10, 30))
    expected = reference_greedy(model, prompt, 24)
    for method in ("eagle", "eagle_hybrid"):
        plan = Plan(method, {"num_draft_tokens": 3, "eagle_head": folder}, predicted_speedup=1.5)
        costs = {"draft": 0.1, "verify": {"1": 1.05, "2": 1.1, "3": 1.15}}
        engine = SpeculativeEngine(model, drafter="auto", calibration={"plan": plan.to_json(), "costs": costs})
        assert isinstance(engine.drafter, EagleDrafter) and (engine.drafter.lookup is not None) == (
            method == "eagle_hybrid"
        )
        assert "EAGLE head" in repr(engine)
        assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == expected
        sampled = engine.generate_ids(prompt, max_new_tokens=16, temperature=1.0, seed=1)
        assert sampled.token_ids == engine.generate_ids(prompt, max_new_tokens=16, temperature=1.0, seed=1).token_ids
    gone = Plan("eagle", {"num_draft_tokens": 3, "eagle_head": str(tmp_path / "no-such-head")})
    with caplog.at_level("WARNING"):
        engine = SpeculativeEngine(model, drafter="auto", calibration={"plan": gone.to_json()})
    assert "not usable" in caplog.text and engine.drafter.name == "prompt_lookup"
    assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == expected


def test_plans_saved_flat_by_older_versions_are_read_as_method_and_settings() -> None:
    from selfspec.calibration import Plan, plan_methods, plan_of
    from selfspec.modeling.loading import demo_model_path

    shipped = json.loads((demo_model_path() / "selfspec.json").read_text())  # the flat form, version 3
    plan = plan_of(shipped)
    assert plan is not None and plan.method == "hybrid" and plan.num_draft_tokens == 3
    assert plan.settings == {"exit_layer": 2, "num_draft_tokens": 3, "min_ngram": 2, "exit_adapter": False}
    assert plan.summary().startswith("prompt lookup where the text repeats, else early exit at layer 2, k=3: ")
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan  # the new form round-trips
    assert set(plan_methods()) >= {"none", "prompt_lookup", "early_exit", "hybrid", "layer_skip", "eagle"}
    assert plan_of({"plan": {"method": "hybrid", "settings": {}}}) is None  # an early exit needs its layer
    assert plan_of({"plan": {"method": "no_such_drafter", "settings": {}}}) is None
