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
    """What ``selfspec generate`` prints by default: the answer to the prompt as a user turn (chat template)."""
    return demo_engine.generate([{"role": "user", "content": PROMPT}], max_new_tokens=8).text


def assert_next_call_is_fine(capsys: pytest.CaptureFixture[str], reference: str) -> None:
    code, out, _ = run(capsys, "-m", "selfspec-demo", "--max-new-tokens", "8", PROMPT)
    assert code == 0 and out == reference + "\n"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(
            ["--max-tokens", "0"], "--max-tokens/--max-new-tokens: max_tokens must be an int >= 1", id="max_tokens=0"
        ),
        pytest.param(
            ["--max-new-tokens", "-4"], "--max-tokens/--max-new-tokens: max_tokens must", id="max_new_tokens<0"
        ),
        pytest.param(["--temperature", "-1"], "temperature must be >= 0", id="negative-temperature"),
        pytest.param(["--top-p", "0"], r"top_p must be in \(0, 1\]", id="top_p=0"),
        pytest.param(["--top-p", "1.5"], "top_p", id="top_p>1"),
        pytest.param(["--top-k", "-1"], "top_k must be an integer >= 0", id="top_k<0"),
        pytest.param(["--stop", ""], "must not be empty", id="empty-stop-string"),
        pytest.param(
            ["--drafter", "early_exit", "--exit-layer", "99"], r"exit_layer must be in \[1, 15\]", id="bad-exit-layer"
        ),
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
    code, _, err = run(capsys, "-m", "selfspec-demo", "--raw", "")
    assert code == 2 and "the prompt is empty" in err
    # documented: by default (and with the old --chat) an empty prompt is an empty user turn, which the template renders
    for flags in ([], ["--chat"]):
        code, out, _ = run(capsys, "-m", "selfspec-demo", *flags, "--max-new-tokens", "4", "")
        assert code == 0 and out.strip()
    assert_next_call_is_fine(capsys, reference)


def test_prompt_over_the_context_window(capsys, demo_engine, reference) -> None:
    code, _, err = run(capsys, "-m", "selfspec-demo", "--max-new-tokens", "8", LONG_PROMPT)
    assert code == 2 and "context window" in err and "truncate_prompt=True" in err
    code, out, _ = run(
        capsys, "-m", "selfspec-demo", "--raw", "--max-new-tokens", "8", "--truncate-prompt", LONG_PROMPT
    )
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
            "--raw",
            "東京 🙂",
        )
        assert code == 0 and out == expected + "\n"


# ------------------------------------------------------------------------------- argument errors (issue 18)
# Each bad argument is one ``selfspec: error: ...`` line, exit status 2, and no model is loaded.
ARGUMENT_ERRORS = [
    pytest.param(
        ["generate", "--exit-layer", "abc", PROMPT], "argument --exit-layer: exit_layer must be", id="exit-layer=abc"
    ),
    pytest.param(
        ["generate", "--exit-layer", "0", PROMPT], "exit_layer must be 'auto' or an int >= 1", id="exit-layer=0"
    ),
    pytest.param(
        ["generate", "--num-draft-tokens", "many", PROMPT], "num_draft_tokens must be", id="draft-tokens=many"
    ),
    pytest.param(["generate", "--num-draft-tokens", "100000", PROMPT], "<= 128", id="draft-tokens=1e5"),
    pytest.param(
        ["generate", "--tree-nodes", "100000000", PROMPT], "tree_nodes must be .* <= 1024", id="tree-nodes=1e8"
    ),
    pytest.param(
        ["generate", "--tree-nodes", "lots", PROMPT],
        "tree_nodes must be an int, 'auto' or 'none'",
        id="tree-nodes=lots",
    ),
    pytest.param(
        ["generate", "--temperature", "inf", PROMPT], "temperature must be >= 0 and finite", id="temperature=inf"
    ),
    pytest.param(
        ["generate", "--temperature", "nan", PROMPT], "temperature must be >= 0 and finite", id="temperature=nan"
    ),
    pytest.param(["generate", "--temperature", "hot", PROMPT], "expected a number, got 'hot'", id="temperature=hot"),
    pytest.param(["generate", "--top-k", "1.5", PROMPT], "argument --top-k: expected an int", id="top-k=1.5"),
    pytest.param(["generate", "--top-p", "nan", PROMPT], r"top_p must be in \(0, 1\]", id="top-p=nan"),
    pytest.param(
        ["generate", "--seed", str(2**70), PROMPT],
        r"seed must be None or an int in \[0, 2\*\*64 - 1\]",
        id="seed=2**70",
    ),
    pytest.param(["generate", "--seed", "-1", PROMPT], "seed must be", id="seed=-1"),
    pytest.param(
        ["generate", "--max-new-tokens", "lots", PROMPT],
        "argument --max-tokens/--max-new-tokens: expected an int",
        id="max-new-tokens=lots",
    ),
    pytest.param(
        ["generate", "--drafter", "magic", PROMPT],
        "argument --drafter: unknown drafter 'magic'; choose one of",
        id="drafter=magic",
    ),
    pytest.param(
        ["generate", "--drafter", "eagle3", PROMPT],
        r"argument --drafter: unknown drafter 'eagle3' \(did you mean 'eagle'\?\); choose one of early_exit, ",
        id="drafter=eagle3",
    ),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--drafter", "prompt-lookup"],
        r"unknown drafter 'prompt-lookup' \(did you mean 'prompt_lookup'\?\)",
        id="serve-drafter=prompt-lookup",
    ),
    pytest.param(
        ["chat", "--draft-confidence", "1.5"],
        r"argument --draft-confidence: draft_confidence must be in \[0, 1\)",
        id="draft-confidence=1.5",
    ),
    pytest.param(
        ["generate", "--temprature", "0.5", PROMPT], "unrecognized arguments: --temprature", id="misspelt-option"
    ),
    pytest.param(["generate"], "the following arguments are required: prompt", id="no-prompt"),
    pytest.param([], "the following arguments are required: command", id="no-command"),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--port", "99999"],
        r"a TCP port is in \[0, 65535\] \(0: any free port\), got 99999",
        id="serve-port=99999",
    ),
    pytest.param(["serve", "-m", "selfspec-demo", "--port", "http"], "expected a port number", id="serve-port=http"),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--max-body-size", "2XB"], "expected a size such as", id="serve-body-size=2XB"
    ),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--max-concurrent", "0"], "must be an int >= 1", id="serve-max-concurrent=0"
    ),
    pytest.param(["serve", "-m", "selfspec-demo", "--max-queue", "-1"], "must be an int >= 0", id="serve-max-queue=-1"),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--header-timeout", "0"],
        "finite number of seconds > 0",
        id="serve-header-timeout=0",
    ),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--body-timeout", "inf"],
        "finite number of seconds > 0",
        id="serve-body-timeout=inf",
    ),
    pytest.param(
        ["serve", "-m", "selfspec-demo", "--threads", "0"],
        "argument --threads: must be an int >= 1",
        id="serve-threads=0",
    ),
    pytest.param(["demo", "--threads", "-2"], "must be an int >= 1", id="demo-threads=-2"),
]
if not torch.cuda.is_available():
    ARGUMENT_ERRORS.append(
        pytest.param(
            ["generate", "--device", "cuda", PROMPT], "sees no CUDA GPU; use --device cpu or auto", id="device=cuda"
        )
    )


@pytest.mark.parametrize(("argv", "match"), ARGUMENT_ERRORS)
def test_argument_errors_are_one_line_before_loading(capsys, monkeypatch, reference, argv, match) -> None:
    import selfspec.decoding.engine

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    with monkeypatch.context() as patch:
        patch.setattr(selfspec.decoding.engine.SpeculativeEngine, "from_pretrained", no_loading)
        code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line: no usage block, no traceback
    assert lines[0].startswith("selfspec: error: ") and re.search(match, lines[0]), err
    assert_next_call_is_fine(capsys, reference)


def test_version(capsys) -> None:
    from selfspec import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"selfspec {__version__}"


def test_generate_and_chat_default_to_the_demo_model(capsys, monkeypatch, reference) -> None:
    import io

    code = main(["generate", "--max-new-tokens", "8", PROMPT])  # no --model
    out, _ = capsys.readouterr()
    assert code == 0 and out == reference + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n\n"))
    assert main(["chat", "--max-new-tokens", "4"]) == 0
    out, _ = capsys.readouterr()
    assert "Chatting with selfspec-demo" in out


@pytest.mark.parametrize(
    ("config_text", "match"),
    [
        ('{"model_type": "llama", ', "config.json is not valid JSON"),
        ('{"model_type": "wizardlm9000"}', "'wizardlm9000' is not supported by selfspec.*supported architectures"),
    ],
    ids=["malformed-config", "unknown-model_type"],
)
def test_honest_config_errors(capsys, tmp_path, reference, config_text, match) -> None:
    (tmp_path / "config.json").write_text(config_text)
    code, _, err = run(capsys, "-m", str(tmp_path), PROMPT)
    assert code == 2 and re.search(match, err) and "not a local folder" not in err
    assert_next_call_is_fine(capsys, reference)


def test_pt_only_checkpoint(capsys, tmp_path, reference) -> None:
    folder = _demo_files(tmp_path, weights=False)
    from safetensors.torch import load_file

    torch.save(load_file(demo_model_path() / "model.safetensors"), folder / "model.pt")
    code, _, err = run(capsys, "-m", str(folder), PROMPT)
    assert code == 2 and "only pickle weights (model.pt)" in err and "*.bin" not in err
    # transformers reads pickle weights only as pytorch_model.bin: allowed, a model.pt is still not loadable
    code, _, err = run(capsys, "-m", str(folder), "--allow-pickle", PROMPT)
    assert code == 2 and "no file named" in err
    assert_next_call_is_fine(capsys, reference)
