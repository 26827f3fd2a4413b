"""``selfspec generate``'s prompt: a user turn in the chat template when the model has one, ``--raw`` as is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from selfspec.cli.main import build_parser, generate_prompt

WITH_TEMPLATE = SimpleNamespace(chat_template="{{ messages }}")
WITHOUT_TEMPLATE = SimpleNamespace(chat_template=None)
TURN = [{"role": "user", "content": "Name the capital of Italy."}]


def test_the_template_is_applied_when_the_model_has_one() -> None:
    assert generate_prompt("Name the capital of Italy.", WITH_TEMPLATE) == TURN
    assert generate_prompt("Name the capital of Italy.", WITHOUT_TEMPLATE) == "Name the capital of Italy."


def test_raw_sends_the_text_and_chat_forces_the_turn() -> None:
    assert generate_prompt("Name the capital of Italy.", WITH_TEMPLATE, raw=True) == "Name the capital of Italy."
    assert generate_prompt("Name the capital of Italy.", WITHOUT_TEMPLATE, chat=True) == TURN  # the engine refuses


def test_raw_and_chat_are_exclusive_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).raw is False
    assert parser.parse_args(["generate", "--chat", "hi"]).chat is True  # the old flag still parses
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--raw", "--chat", "hi"])
    assert "not allowed with argument" in capsys.readouterr().err
