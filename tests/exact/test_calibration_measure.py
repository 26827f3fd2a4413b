"""Calibration and drafter='auto': the plan, the saved file's version and machine, the online guard."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.calibration import CALIBRATION_VERSION, CostModel, DraftController, load_calibration, save_calibration
from selfspec.calibration.measure import Continuations, calibrate, choose_plan, replay


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


def test_old_or_foreign_calibration_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    model.mkdir()
    saved = save_calibration(model, {"exit_layer": 2})
    assert load_calibration(model)["version"] == CALIBRATION_VERSION
    assert model not in saved.parents and not (model / "selfspec.json").exists()  # never in the model's folder
    data = json.loads(saved.read_text())
    for foreign in ({"machine": "another machine"}, {"version": 1}, {"selfspec_version": "0.0.1"},
                    {"device": "cuda"}, {"dtype": "bfloat16"}):  # fmt: skip
        saved.write_text(json.dumps({**data, **foreign}))
        assert load_calibration(model) is None, foreign
    saved.write_text("{not json")
    assert load_calibration(model) is None


def test_costs_measured_on_a_busy_machine_are_measured_again_once_it_is_quiet(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    busy = {"exit_layer": 2, "cost_checks": {"load_per_core": [0.4, 1.6]}}
    save_calibration("org/model", busy)
    monkeypatch.setattr("selfspec.calibration.store.load_per_core", lambda: 1.2)
    assert load_calibration("org/model")["exit_layer"] == 2  # still busy: nothing better to measure now
    monkeypatch.setattr("selfspec.calibration.store.load_per_core", lambda: 0.1)
    assert load_calibration("org/model") is None  # quiet now: measured again
    save_calibration("org/model", {"exit_layer": 3, "cost_checks": {"load_per_core": [0.2, 0.3]}})
    assert load_calibration("org/model")["exit_layer"] == 3  # measured quiet: kept
    save_calibration("org/model", {"exit_layer": 4, "cost_checks": {"load_per_core": "busy?"}})
    assert load_calibration("org/model")["exit_layer"] == 4  # unreadable load figures are not a reason


def test_measured_costs_record_the_load_and_keep_a_verify_curve_up_to_32_drafts() -> None:
    from selfspec.calibration.measure import measure_costs, verify_lengths

    assert verify_lengths(6) == [1, 2, 3, 4, 5, 6, 12, 16, 24, 32]
    assert verify_lengths(6, window=40) == [1, 2, 3, 4, 5, 6, 12, 16]
    engine = SpeculativeEngine(make_model("llama"), None, drafter="none", calibration={})
    checks: dict = {}
    draft, verify, seconds = measure_costs(engine, list(range(1, 30)), [1, 2], [1, 2, 12], repeats=2, checks=checks)
    assert sorted(verify) == [1, 2, 12] and all(v > 0 for v in verify.values()) and seconds > 0
    assert list(draft) == [1, 2] and draft[2] >= draft[1]  # deeper exits never cheaper
    assert len(checks["load_per_core"]) == 2 and "monotonic" in checks


def test_with_compile_on_the_costs_are_the_static_rounds_compiled_steps(monkeypatch) -> None:
    """Issue 40 item 4: where the static round serves the calls, its steps are what is timed."""
    from selfspec.calibration import measure
    from selfspec.modeling.static_step import bucket_for, width_for

    made = []

    def spied(runner, compile):  # the real static round, kept to look at what was compiled
        rounds = static_rounds(runner, compile)
        made.append(rounds)
        return rounds

    static_rounds = measure.static_rounds
    monkeypatch.setattr(measure, "static_rounds", spied)
    prompt, lengths = list(range(1, 30)), [1, 2, 4, 12]
    eager = SpeculativeEngine(make_model("llama"), None, drafter="none", calibration={})
    checks: dict = {}
    measure.measure_costs(eager, prompt, [1, 2], lengths, repeats=2, checks=checks)
    assert checks["path"] == measure.EAGER_PATH and made == [None]  # compile off on a CPU: the eager loop

    engine = SpeculativeEngine(make_model("llama"), None, drafter="none", calibration={}, compile="eager")
    checks = {}
    draft, verify, seconds = measure.measure_costs(engine, prompt, [1, 2], lengths, repeats=2, checks=checks)
    assert checks["path"] == "static round (eager)" and sorted(verify) == lengths and seconds > 0
    assert all(v > 0 for v in verify.values()) and draft[2] >= draft[1] > 0
    (rounds,) = made[1:]
    bucket = bucket_for(len(prompt) + width_for(max(lengths)) + 1)
    widths = sorted({1, *(width_for(k) for k in lengths)})
    assert sorted(rounds.step.compiled) == sorted(
        [("greedy", w, bucket) for w in widths] + [(f"exit_draft@{n}", 1, bucket) for n in (1, 2)]
    )
    assert int(rounds.step.cache.length) == len(prompt)  # every timed step left the prompt's text as it was


def test_calibration_with_compile_on_says_it_priced_the_static_round_and_runs_exactly() -> None:
    from selfspec.calibration import calibrate
    from selfspec.drafting.auto import Plan

    model = make_model("llama", agreeing=True)
    engine = SpeculativeEngine(model, drafter="auto", compile="eager")
    result = calibrate(engine, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3)
    assert result.cost_checks["path"] == result.plan.measured == "static round (eager)"
    assert Plan.from_json(result.plan.to_json()) == result.plan  # saved and read back with it
    assert "costs timed on the static round (eager)" in result.plan.summary()
    engine.configure(result.to_json())
    prompt = list(range(10, 30))
    assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == reference_greedy(model, prompt, 24)


def test_a_screened_runner_gets_a_second_curve_for_rounds_that_read_every_logit(tmp_path, monkeypatch) -> None:
    """Greedy rounds take the argmax from the exact-argmax head; sampling pays the full head: two curves."""
    from selfspec.calibration.measure import CalibrationResult, measure_costs

    engine = SpeculativeEngine(make_model("llama", dtype=torch.float32), None, drafter="none", calibration={})
    if engine.runner.argmax_head is None:
        pytest.skip("no exact-argmax head on this CPU (it needs native bf16)")
    sampled: dict[int, float] = {}
    _, verify, _ = measure_costs(engine, list(range(1, 30)), [1], [1, 2, 12], repeats=2, sampled=sampled)
    assert sorted(sampled) == sorted(verify) == [1, 2, 12] and all(v > 0 for v in sampled.values())
    engine.runner.argmax_screen = False  # one curve only: every round pays the full head
    unscreened: dict[int, float] = {}
    measure_costs(engine, list(range(1, 30)), [1], [1, 2], repeats=1, sampled=unscreened)
    assert unscreened == {}
    # saved with the plan's costs, read back by the sampling controllers only
    result = CalibrationResult(
        1, 1, 1.0, verify_cost={1: 1.2, 2: 1.5}, sampled_verify_cost={1: 1.6, 2: 1.9}, step_seconds=0.2, dtype="float32"
    )
    saved = result.to_json()
    assert saved["costs"]["verify_sampled"] == {"1": 1.6, "2": 1.9}
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    save_calibration("org/model", saved)
    loaded = load_calibration("org/model")
    assert loaded is not None and loaded["costs"]["verify_sampled"] == {"1": 1.6, "2": 1.9}
    controller = DraftController(2, adaptive=True, costs=loaded["costs"])
    assert isinstance(controller.costs, CostModel) and controller.costs.verify_cost(1) == 1.2
    sampling = controller.for_sampling().costs
    assert isinstance(sampling, CostModel) and sampling.verify_cost(1) == 1.6
    assert "verify_sampled" not in CalibrationResult(1, 1, 1.0, verify_cost={1: 1.2}).to_json()["costs"]


def test_calibrations_are_keyed_by_device_type_and_dtype(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    cpu = save_calibration("org/model", {"exit_layer": 2, "device": "cpu", "dtype": "float32"})
    gpu = save_calibration("org/model", {"exit_layer": 5, "device": "cuda:0", "dtype": "torch.bfloat16"})
    assert cpu != gpu and gpu.name == "cuda-bfloat16.json"
    assert cpu.parent == gpu.parent == tmp_path / "calibrations" / "org--model"
    assert load_calibration("org/model")["exit_layer"] == 2
    assert load_calibration("org/model", device=torch.device("cuda", 1), dtype=torch.bfloat16)["exit_layer"] == 5
    assert load_calibration("org/model", device="cpu", dtype=torch.bfloat16) is None


def test_a_bundled_calibration_is_not_reused_on_another_device_type_or_dtype() -> None:
    from selfspec import demo_model_path

    folder = demo_model_path()
    assert load_calibration(folder) is not None  # shipped: measured on CPU in float32, used on any such machine
    assert load_calibration(folder, device="cuda") is None
    assert load_calibration(folder, dtype="bfloat16") is None


@pytest.mark.parametrize(
    ("selfspec_cache", "xdg", "expected"),
    [
        ("/tmp/a", "/tmp/x", "/tmp/a"),
        (None, "/tmp/x", "/tmp/x/selfspec"),
        (None, "relative", "HOME"),  # the XDG spec: a relative XDG_CACHE_HOME is ignored
        (None, None, "HOME"),
    ],
)
def test_cache_location_rules(monkeypatch, selfspec_cache, xdg, expected) -> None:
    from pathlib import Path

    from selfspec.artifacts import cache_dir

    for name, value in (("SELFSPEC_CACHE", selfspec_cache), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    home = Path.home() / ".cache" / "selfspec"
    assert cache_dir() == (home if expected == "HOME" else Path(expected))


def test_guard_pauses_sampling_where_drafts_do_not_pay() -> None:
    model = make_model("llama", agreeing=False)
    costs = {"draft": 1.5, "verify": {"1": 1.1, "2": 1.2, "3": 1.3, "4": 1.4}}  # a draft costs more than it saves
    engine = SpeculativeEngine(
        model, exit_layer=2, calibration={"costs": costs}, drafter="early_exit"
    )  # adaptive early exit
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
            controller.record(4, 1, 2, seconds=0.0)  # one draft lands a round: 1.75 steps a token
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


def test_a_plan_naming_a_shipped_head_of_a_moved_installation_finds_it_here(tmp_path, monkeypatch, caplog) -> None:
    """A plan saved in the user cache by another clone or virtual environment names the shipped head by its
    old folder: the head this installation ships under that name runs, not the prompt-lookup fallback."""
    from selfspec.calibration import Plan
    from selfspec.drafting.eagle import head as heads
    from selfspec.drafting.eagle.drafter import EagleDrafter
    from selfspec.drafting.eagle.head import EagleHead, shipped_head_moved

    model = make_model("llama", agreeing=True)
    torch.manual_seed(0)
    shipped = tmp_path / "site-packages" / "selfspec" / "models" / "eagle"
    EagleHead(model).save(shipped / "tiny-llama")
    monkeypatch.setattr(heads, "SHIPPED_HEADS", shipped)
    old = tmp_path / "old-clone" / "src" / "selfspec" / "models" / "eagle" / "tiny-llama"  # (never existed here)
    assert shipped_head_moved(old) == shipped / "tiny-llama"
    assert shipped_head_moved(tmp_path / "old-clone" / "heads" / "tiny-llama") is None  # not a shipped head's folder
    assert shipped_head_moved(old.parent / "other") is None  # no shipped head of that name
    prompt = list(range(10, 30))
    plan = Plan("eagle_hybrid", {"num_draft_tokens": 3, "eagle_head": str(old)}, predicted_speedup=1.5)
    with caplog.at_level("WARNING"):
        engine = SpeculativeEngine(model, drafter="auto", calibration={"plan": plan.to_json()})
    assert "not usable" not in caplog.text
    assert isinstance(engine.drafter, EagleDrafter)
    assert engine.generate_ids(prompt, max_new_tokens=24).token_ids == reference_greedy(model, prompt, 24)


def test_plain_plans_name_the_command_that_trains_a_head() -> None:
    from selfspec.drafting.auto import Plan

    for method in ("none", "prompt_lookup"):
        advice = Plan(method).advice("org/model", has_head=False)
        assert "selfspec train-eagle --model org/model --minutes 20" in advice
        assert Plan(method).advice("org/model", has_head=True) == ""  # a head was measured: training again won't help
    assert Plan("eagle_hybrid").advice("org/model", has_head=True) == ""


def test_a_head_trained_after_calibration_is_measured_on_the_next_load(tmp_path, monkeypatch) -> None:
    """``train-eagle`` saves where ``find_eagle_head`` looks; the saved plan never measured it: measure again."""
    from selfspec.calibration.measure import head_found_since
    from selfspec.drafting.eagle.head import EagleHead, head_folder_for

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = make_model("llama", dtype=torch.float32)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    engine = SpeculativeEngine(model, calibration={"plan": {"method": "none"}})
    assert not head_found_since(engine)
    EagleHead(model).save(head_folder_for(str(folder)))
    assert head_found_since(engine)
    measured = SpeculativeEngine(model, calibration={"plan": {"method": "none"}, "eagle": {"acceptance": 0.1}})
    assert not head_found_since(measured)  # its calibration measured the head already


def test_first_load_says_what_it_measures_and_where_it_saves(tmp_path, monkeypatch, caplog, capsys) -> None:
    """What, once, where; a line per phase with its estimate; then how long and the plan; no bar off a terminal."""
    import logging

    from selfspec.calibration import calibration_path
    from selfspec.calibration.measure import calibrate_on_first_load, show_progress

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    model.config._name_or_path = str(tmp_path / "model")
    engine = SpeculativeEngine(model, calibration={})
    assert show_progress() == "lines"  # pytest's stderr is not a terminal: lines, not a bar
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        calibrate_on_first_load(engine)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("selfspec")]
    where = calibration_path(str(tmp_path / "model"), "cpu", "float32")
    assert "this happens once" in lines[0] and str(where) in lines[0] and "cpu float32" in lines[0]
    phases = [line for line in lines[1:-1] if not line.startswith("... ")]  # "..." lines: a phase still running
    assert [line[: len("calibrating (1/5)")] for line in phases] == [f"calibrating ({i}/5)" for i in range(1, 6)]
    assert "continuations" in phases[0] and "(" in phases[0].split(": ", 1)[1]  # with its estimate
    assert lines[-1].startswith(f"calibrated {tmp_path / 'model'} in ") and engine.plan.summary() in lines[-1]
    assert where is not None and where.is_file()
    assert "%|" not in capsys.readouterr().err  # the bar stayed off
    logging.getLogger("selfspec").setLevel(logging.ERROR)  # a user who silences selfspec silences the bar too
    try:
        monkeypatch.setattr("sys.stderr.isatty", lambda: True)
        assert show_progress() == "off"
        logging.getLogger("selfspec").setLevel(logging.NOTSET)
        assert show_progress() == "bar"
    finally:
        logging.getLogger("selfspec").setLevel(logging.NOTSET)


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


def test_first_load_compares_half_precision_with_float32() -> None:
    """A bf16 engine on the CPU: calibration times a prefill and a decode step in bf16 and in float32 and says so."""
    from selfspec.calibration.precision import describe_precision, measure_precision

    model = make_model("llama", agreeing=True, dtype=torch.bfloat16)
    engine = SpeculativeEngine(model, None, drafter="none", calibration={})
    measured = measure_precision(engine, list(range(10, 40)), repeats=1)
    assert measured["dtype"] == "bfloat16" and measured["prefill_tokens"] == 256
    assert measured["prefill_speedup"] > 0 and measured["step_speedup"] > 0
    assert all(v > 0 for v in (*measured["prefill_seconds"].values(), *measured["step_seconds"].values()))
    assert "256-token prefill" in describe_precision(measured)
    assert next(model.parameters()).dtype == torch.bfloat16  # the engine's model is untouched (a copy was timed)
    fp32_model = make_model("llama", agreeing=True, dtype=torch.float32)
    fp32 = SpeculativeEngine(fp32_model, None, drafter="none", calibration={})
    assert measure_precision(fp32, [1, 2, 3]) == {"skipped": "the model runs in float32 already"}
    assert describe_precision({"skipped": "x"}) == ""
    result = calibrate(engine, [list(range(10, 30))], max_new_tokens=4, max_draft_tokens=2, save=False, progress=False)
    assert result.precision["dtype"] == "bfloat16" and result.to_json()["precision"]["step_speedup"] > 0
