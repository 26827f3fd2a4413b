"""Short model names: a bare name that is no short name fails offline at once, with a "did you mean" and the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.errors import ModelNotFoundError
from selfspec.modeling.loading import DEMO_MODEL, check_short_name, resolve_model_path
from selfspec.modeling.realmodels import REAL_MODELS, suggest_name, unknown_name_message

SMOLLM2 = "smollm2-135m-instruct"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("smollm2-135m-instuct", SMOLLM2),  # a letter dropped
        ("SmolLM2-135M-Instruct", SMOLLM2),  # the authors' spelling
        ("smollm2", SMOLLM2),  # a prefix of exactly one name
        ("gemma3-270m", "gemma-3-270m"),
        ("gpt2", None),  # nothing close: no guess, only the list
        ("", None),
    ],
)
def test_suggest_name_finds_the_close_short_name(typed: str, meant: str | None) -> None:
    assert suggest_name(typed) == meant


def test_the_message_has_the_guess_and_every_short_name() -> None:
    message = unknown_name_message("smollm2-135m-instuct")
    assert f"did you mean {SMOLLM2!r}?" in message
    assert all(name in message for name in REAL_MODELS)
    assert "did you mean" not in unknown_name_message("gpt2")


def test_a_bare_unknown_name_fails_before_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty hub cache
    with pytest.raises(ModelNotFoundError, match=rf"did you mean {SMOLLM2!r}\?.*selfspec-demo.*'org/name'"):
        resolve_model_path("smollm2-135m-instuct")
    with pytest.raises(ModelNotFoundError, match="short names: "):
        check_short_name("gpt2")
    (tmp_path / "models--gpt2").mkdir()  # a legacy bare hub id the user has cached still loads
    assert resolve_model_path("gpt2") == "gpt2"
    for name in (*REAL_MODELS, DEMO_MODEL):
        check_short_name(name)  # known names pass
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # hub ids pass through
