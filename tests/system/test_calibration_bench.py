"""The command line (generate, chat, calibrate, bench, demo) on a tiny local model folder."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.calibration import load_calibration
from selfspec.calibration.measure import calibrate, choose, expected_speedup
from selfspec.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat-model")
    tokenizer = make_tokenizer()
    model = make_model("llama", dtype=torch.float32, vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_generate_prints_the_engine_text(model_dir, capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--max-new-tokens",
                "12",
                "--drafter",
                "early_exit",
                "--exit-layer",
                "2",
                "--num-draft-tokens",
                "3",
                "--stats",
                "It is a truth",
            ]
        )
        == 0
    )
    printed = capsys.readouterr()
    engine = SpeculativeEngine.from_pretrained(model_dir, exit_layer=2, num_draft_tokens=3, drafter="early_exit")
    as_chat = [{"role": "user", "content": "It is a truth"}]  # the tokenizer has a chat template: generate uses it
    assert printed.out == engine.generate(as_chat, max_new_tokens=12).text + "\n"
    assert "tau" in printed.err and "chat template applied (--raw sends the text as is)" in printed.err


def test_generate_reports_bad_input_without_a_traceback(model_dir, capsys) -> None:
    assert main(["generate", "--model", str(model_dir), "--drafter", "early_exit", "--exit-layer", "99", "hello"]) == 2
    assert "exit_layer must be in [1, 5]" in capsys.readouterr().err
    assert main(["generate", "--model", str(model_dir / "missing"), "hello"]) == 2


def test_chat_streams_answers(model_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello world!\n\n"))
    assert (
        main(
            [
                "chat",
                "--model",
                str(model_dir),
                "--max-new-tokens",
                "6",
                "--drafter",
                "early_exit",
                "--exit-layer",
                "2",
                "--num-draft-tokens",
                "2",
            ]
        )
        == 0
    )
    assert "Chatting with" in capsys.readouterr().out


def test_calibrate_saves_a_choice_that_auto_uses(model_dir, capsys) -> None:
    assert main(["calibrate", "--model", str(model_dir), "--max-new-tokens", "8"]) == 0
    saved = load_calibration(str(model_dir))
    assert saved is not None and saved["source"] == "calibrate"
    engine = SpeculativeEngine.from_pretrained(model_dir)
    assert (engine.exit_layer, engine.num_draft_tokens) == (saved["exit_layer"], saved["num_draft_tokens"])
    assert "chosen: exit_layer=" in capsys.readouterr().out


def test_calibration_choice_follows_the_cost_model() -> None:
    agreement = {1: 0.3, 2: 0.9, 3: 0.95}
    draft_cost = {1: 0.1, 2: 0.2, 3: 0.6}
    verify_cost = {1: 1.0, 2: 1.05, 4: 1.1}
    layer, k, speed = choose(agreement, draft_cost, verify_cost)
    best = max(
        (
            (layer_, k_, expected_speedup(a, draft_cost[layer_], v, k_))
            for layer_, a in agreement.items()
            for k_, v in verify_cost.items()
        ),
        key=lambda item: item[2],
    )
    assert (layer, k, speed) == best and layer == 2
    assert expected_speedup(0.0, 0.2, 1.0, 3) < 1.0  # useless drafts only cost time


def test_calibrate_measures_every_layer(model_dir) -> None:
    engine = SpeculativeEngine.from_pretrained(model_dir, exit_layer=1, num_draft_tokens=1, drafter="early_exit")
    result = calibrate(engine, max_new_tokens=8, max_draft_tokens=3, save=False, progress=False)
    assert set(result.agreement) == {1, 2, 3} and set(result.verify_cost) == {1, 2, 3, 12, 16, 24, 32}
    assert all(0.0 <= a <= 1.0 for a in result.agreement.values())
    assert result.draft_cost[1] < 1.5  # one layer costs well under a full step plus noise


@pytest.mark.slow
def test_bench_runs_every_method_and_checks_greedy_identity(model_dir, tmp_path) -> None:
    assert (
        main(
            [
                "bench",
                "--model",
                str(model_dir),
                "--max-new-tokens",
                "10",
                "--repeats",
                "1",
                "--categories",
                "code",
                "rag",
                "--temperatures",
                "1.0",
                "--out",
                str(tmp_path),
                "--name",
                "b",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "b.json").read_text())
    methods = report["methods"]
    assert {
        "hf_greedy",
        "selfspec_plain",
        "selfspec_auto",
        "selfspec_prompt_lookup",
        "selfspec_hybrid",
        "selfspec_layer_skip",
        "hf_sample_t1.0",
        "selfspec_tree_8",
        "selfspec_tree_8_t1.0",
    } <= set(methods)
    greedy = [m for m in methods.values() if m["baseline"] == "hf_greedy"]
    assert greedy and all(m["identical_to_greedy"] is True for m in greedy)
    assert all(m["identical_to_plain"] is True for n, m in methods.items() if m in greedy and n != "hf_greedy")
    assert methods["hf_greedy"]["identical_to_plain"] is None
    assert methods["selfspec_plain"]["tau"] == 1.0
    settings = report["settings"]
    assert len(settings["load_average_before"]) == len(settings["load_average_after"]) == 3
    assert "Load average" in (tmp_path / "b.md").read_text() and "identical to plain" in (tmp_path / "b.md").read_text()
    assert (tmp_path / "b.png").stat().st_size > 1000 and "| method |" in (tmp_path / "b.md").read_text()
    # sampling is compared with selfspec's own plain loop at the same temperature, not only transformers
    assert methods["selfspec_plain_t1.0"]["baseline"] == "hf_sample_t1.0"
    auto_t = methods["selfspec_auto_t1.0"]
    assert auto_t["vs_plain"] > 0 and len(auto_t["per_category"]["rag"]["vs_plain_per_repeat"]) == 1
    assert methods["selfspec_auto"]["vs_plain"] > 0 and "vs_plain" not in methods["selfspec_plain"]
    # the per-phase profile: draft + verify + overhead is the whole time per token
    prof = methods["selfspec_auto"]["profile"]
    parts = prof["draft_ms_per_token"] + prof["verify_ms_per_token"] + prof["overhead_ms_per_token"]
    assert prof["verify_ms_per_token"] > 0 and abs(parts - prof["total_ms_per_token"]) < 0.01
    assert 0 < methods["selfspec_plain"]["profile"]["target_forwards_per_token"] <= 1.0
    assert methods["hf_greedy"]["profile"] is None
    markdown = (tmp_path / "b.md").read_text()
    assert "## Where the time goes" in markdown and "## Against selfspec's own plain loop" in markdown


def test_demo_command_on_a_local_model(model_dir, capsys) -> None:
    assert main(["demo", "--model", str(model_dir), "--max-new-tokens", "16", "--prompt", "It is a truth"]) == 0
    out = capsys.readouterr().out
    assert "identical text: yes" in out and "speedup:" in out


def test_calibrate_layer_skip_search(model_dir, capsys) -> None:
    assert main(["calibrate", "--model", str(model_dir), "--max-new-tokens", "8", "--drafter", "layer_skip"]) == 0
    saved = load_calibration(str(model_dir))
    assert saved is not None and saved["layer_skip_layers"]
    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="layer_skip", num_draft_tokens=2)
    assert engine.drafter.layers == saved["layer_skip_layers"]
    assert "layer skip: layers" in capsys.readouterr().out


def test_bench_checks_categories_and_methods_before_loading_the_model(tmp_path, capsys) -> None:
    missing = str(tmp_path / "no-such-model")  # never loaded: the arguments fail first
    assert main(["bench", "--model", missing, "--categories", "poetry"]) == 2
    err = capsys.readouterr().err
    assert "unknown prompt category 'poetry'" in err and "rag" in err and "code" in err
    assert main(["bench", "--model", missing, "--methods", "fastest"]) == 2
    assert "unknown benchmark method 'fastest'" in capsys.readouterr().err


def test_bench_category_aliases_and_default_sets() -> None:
    from selfspec.calibration.bench import default_prompt_sets, select_categories
    from selfspec.prompts import PROMPT_SETS, STOCK_PROMPT_SETS

    assert list(select_categories(PROMPT_SETS, ["chat"])) == ["multi_turn_chat"]
    assert list(select_categories(STOCK_PROMPT_SETS, ["chat", "rag"])) == ["chat", "rag"]
    assert default_prompt_sets("selfspec-demo") is PROMPT_SETS
    assert set(default_prompt_sets("/models/SmolLM2.gguf")) == {"rag", "summarization", "chat", "code"}


def test_bench_help_lists_categories_and_methods(capsys) -> None:
    try:
        assert main(["bench", "--help"]) == 0
    except SystemExit as done:  # argparse's own exit, where main does not catch it
        assert done.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "multi_turn_chat" in out and "summarization" in out and "code" in out
    assert "prompt_lookup" in out and "layer_skip" in out and "--methods" in out


def test_method_filter_keeps_the_baselines() -> None:
    from selfspec.calibration.bench import Method, filter_methods

    def method(name: str, family: str, baseline: str = "hf_greedy") -> Method:
        return Method(name, baseline, lambda ids, n, seed: ([], None), family=family)

    every = [  # each row's family is declared by the drafter's registration (its bench rows)
        method("hf_greedy", "baseline"),
        method("selfspec_plain", "plain"),
        method("selfspec_E2_k3", "early_exit"),
        method("selfspec_auto", "auto"),
        method("hf_sample_t0.7", "baseline", "hf_sample_t0.7"),
        method("selfspec_auto_t0.7", "auto", "hf_sample_t0.7"),
        method("selfspec_tree_8", "tree"),
    ]
    kept = [m.name for m in filter_methods(every, ["plain", "early_exit"])]
    assert kept == ["hf_greedy", "selfspec_plain", "selfspec_E2_k3"]
    kept = [m.name for m in filter_methods(every, ["auto"])]
    assert kept == ["hf_greedy", "selfspec_auto", "hf_sample_t0.7", "selfspec_auto_t0.7"]
    assert [m.name for m in filter_methods(every, ["selfspec_tree_*"])] == ["hf_greedy", "selfspec_tree_8"]
    with pytest.raises(ValueError, match="no benchmark method matches"):
        filter_methods(every, ["selfspec_medusa*"])


def _report(names: list[str]):
    from selfspec.calibration.bench import BenchReport

    methods = {
        n: {
            "baseline": "hf_greedy",
            "per_category": {"rag": {"speedup": 1.0 + i / 10, "speedup_per_repeat": [0.9 + i / 10, 1.2 + i / 10]}},
        }
        for i, n in enumerate(names)
    }
    settings = {"model": "m", "device": "cpu", "threads": 1, "categories": {"rag": 2}}
    return BenchReport(settings=settings, methods=methods)


def test_plot_gives_each_method_its_own_colour_and_error_bars(tmp_path) -> None:
    pytest.importorskip("matplotlib")  # the bench extra, installed by make test
    from selfspec.calibration.bench import _plot, method_colours

    names = [f"method_{i}" for i in range(26)]
    colours = method_colours(names)
    assert len({tuple(c) for c in colours.values()}) == len(names)
    path = _plot(_report(names[:14]), tmp_path / "p.png")
    assert path.stat().st_size > 1000


def test_missing_matplotlib_is_reported_not_silent(tmp_path, monkeypatch, caplog) -> None:
    import sys

    from selfspec.calibration.bench import write_report

    report = _report(["a"])
    report.settings.update({"max_new_tokens": 8, "repeats": 1, "dtype": "float32", "date": "now"})
    report.methods["a"].update(
        {
            "tokens_per_second": 1.0,
            "tokens_per_second_spread": [1.0, 1.0],
            "speedup": 1.0,
            "tau": None,
            "acceptance_rate": None,
            "identical_to_greedy": True,
        }
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with caplog.at_level("WARNING"):
        paths = write_report(report, tmp_path, "r")
    assert [p.suffix for p in paths] == [".json", ".md"]
    assert "matplotlib is not installed" in caplog.text


def test_bench_runs_the_chat_prompt_sets_on_a_base_model_without_a_chat_template(tmp_path) -> None:
    """A base checkpoint (no chat template, like Gemma 3 270M) gets the stock sets as plain-text turns."""
    from selfspec.prompts import STOCK_PROMPT_SETS, as_plain_text

    tokenizer = copy.deepcopy(make_tokenizer())  # the shared one keeps its template
    tokenizer.chat_template = None
    model = make_model("llama", dtype=torch.float32, vocab_size=len(tokenizer), max_position_embeddings=2048)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = ["bench", "--model", str(tmp_path / "base"), "--max-new-tokens", "4", "--repeats", "1", "--no-calibrate"]
    args += ["--methods", "plain", "--categories", "chat", "--temperatures", "--out", str(tmp_path), "--name", "b"]
    assert main(args) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert {run["category"] for run in report["runs"]} == {"chat"}
    text = as_plain_text(STOCK_PROMPT_SETS["chat"][1])
    assert text.startswith("User: I want to learn to cook.") and text.endswith(
        "\n\nUser: What equipment do I need for those?\n\nAssistant:"
    )
