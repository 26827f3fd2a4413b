"""The bad-input table for the command line: ``selfspec generate`` exits with status 2 and a
one-line ``selfspec: error: ...`` naming the fix, and the next command answers correctly.

Runs ``selfspec.cli.main`` in-process (the same entry point as the console script).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from selfspec import demo_model_path
from selfspec.cli import main

PROMPT = "It is a truth universally acknowledged"
LONG_PROMPT = "It is a truth universally acknowledged. " * 300  # > 2048 tokens, the demo model's window


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def reference(demo_engine) -> str:
    return demo_engine.generate(PROMPT, max_new_tokens=8).text


def assert_next_call_is_fine(capsys: pytest.CaptureFixture[str], reference: str) -> None:
    code, out, _ = run(capsys, "-m", "selfspec-demo", "--max-new-tokens", "8", PROMPT)
    assert code == 0 and out == reference + "\n"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(["--max-new-tokens", "0"], "max_new_tokens must be an int >= 1", id="max_new_tokens=0"),
        pytest.param(["--max-new-tokens", "-4"], "max_new_tokens", id="max_new_tokens<0"),
        pytest.param(["--temperature", "-1"], "temperature must be >= 0", id="negative-temperature"),
        pytest.param(["--top-p", "0"], r"top_p must be in \(0, 1\]", id="top_p=0"),
        pytest.param(["--top-p", "1.5"], "top_p", id="top_p>1"),
        pytest.param(["--top-k", "-1"], "top_k must be an integer >= 0", id="top_k<0"),
        pytest.param(["--stop", ""], "must not be empty", id="empty-stop-string"),
        pytest.param(["--exit-layer", "99"], r"exit_layer must be in \[1, 15\]", id="bad-exit-layer"),
        pytest.param(
            ["--num-draft-tokens", "0"], "num_draft_tokens must be 'auto' or an int >= 1", id="bad-draft-length"
        ),
    ],
)
def test_bad_options(capsys, reference, args, match) -> None:
    code, out, err = run(capsys, "-m", "selfspec-demo", *args, PROMPT)
    assert code == 2 and out == ""
    last = err.strip().splitlines()[-1]  # after any weight-loading progress bar
    assert last.startswith("selfspec: error: ") and re.search(match, last), err
    assert_next_call_is_fine(capsys, reference)


def test_empty_prompt(capsys, reference) -> None:
    code, _, err = run(capsys, "-m", "selfspec-demo", "")
    assert code == 2 and "the prompt is empty" in err
    # documented: with --chat an empty prompt is an empty user turn, which the template renders
    code, out, _ = run(capsys, "-m", "selfspec-demo", "--chat", "--max-new-tokens", "4", "")
    assert code == 0 and out.strip()
    assert_next_call_is_fine(capsys, reference)


def test_prompt_over_the_context_window(capsys, demo_engine, reference) -> None:
    code, _, err = run(capsys, "-m", "selfspec-demo", "--max-new-tokens", "8", LONG_PROMPT)
    assert code == 2 and "context window" in err and "truncate_prompt=True" in err
    code, out, _ = run(capsys, "-m", "selfspec-demo", "--max-new-tokens", "8", "--truncate-prompt", LONG_PROMPT)
    ids = demo_engine.encode_prompt(LONG_PROMPT)
    expected = demo_engine.generate_ids(ids[-(demo_engine.context_window - 8) :], max_new_tokens=8).text
    assert code == 0 and out == expected + "\n"
    assert_next_call_is_fine(capsys, reference)


def test_unknown_model(capsys, reference) -> None:
    code, _, err = run(capsys, "-m", "./no-such-model-folder", PROMPT)
    assert code == 2 and "selfspec: error:" in err
    code, _, err = run(capsys, "-m", "selfspec-test/no-such-model-anywhere", PROMPT)
    assert code == 2 and "HF_HUB_OFFLINE" in err
    assert_next_call_is_fine(capsys, reference)


def _demo_files(folder: Path, *, weights: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for path in demo_model_path().iterdir():
        if path.is_file() and path.name != "model.safetensors":  # not medusa/ and other extras
            shutil.copy(path, folder / path.name)
    if weights:
        from safetensors.torch import load_file

        torch.save(load_file(demo_model_path() / "model.safetensors"), folder / "pytorch_model.bin")
    return folder


def test_folder_without_weights(capsys, tmp_path) -> None:
    code, _, err = run(capsys, "-m", str(_demo_files(tmp_path, weights=False)), PROMPT)
    assert code == 2 and "no weights" in err


def test_pickle_only_checkpoint_needs_allow_pickle(capsys, tmp_path, reference) -> None:
    folder = str(_demo_files(tmp_path, weights=True))
    code, _, err = run(capsys, "-m", folder, PROMPT)
    assert code == 2 and "allow_pickle=True" in err
    code, out, _ = run(capsys, "-m", folder, "--allow-pickle", "--max-new-tokens", "8", PROMPT)
    assert code == 0 and out == reference + "\n"  # the same weights


def test_remote_code_is_refused_by_default(capsys, tmp_path) -> None:
    config = json.loads((demo_model_path() / "config.json").read_text())
    config.update({"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "custom.MyConfig"}})
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "-m", str(tmp_path), PROMPT)
    assert code == 2 and "trust_remote_code=True" in err


def test_unsupported_architecture(capsys, tmp_path) -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    code, _, err = run(capsys, "-m", str(tmp_path), PROMPT)
    assert code == 2 and "supported architectures" in err


def test_non_utf8_bytes_in_output(capsys, demo_engine) -> None:
    """Sampled byte-level text prints exactly the engine's text (U+FFFD for incomplete characters)."""
    for seed in range(3):
        expected = demo_engine.generate("東京 🙂", max_new_tokens=24, temperature=1.5, seed=seed).text
        code, out, _ = run(
            capsys,
            "-m",
            "selfspec-demo",
            "--max-new-tokens",
            "24",
            "--temperature",
            "1.5",
            "--seed",
            str(seed),
            "東京 🙂",
        )
        assert code == 0 and out == expected + "\n"
