"""``drafter="auto"`` is the default everywhere a model is named: the engine, both adapters, every CLI verb, the server.

Passing an early-exit setting without naming the drafter is refused with what to do (``auto`` takes
the exit layer from its calibrated plan), so a caller who meant the early exit is never silently
given another drafter.
"""

from __future__ import annotations

import inspect

import pytest
from tiny_models import make_model

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser
from selfspec.errors import ConfigurationError


def test_the_engine_defaults_to_auto() -> None:
    for method in (SpeculativeEngine.__init__, SpeculativeEngine.from_pretrained):
        assert inspect.signature(method).parameters["drafter"].default == "auto", method
    engine = SpeculativeEngine(make_model("llama"))
    assert engine.config.drafter == "auto" and engine.plan is not None  # uncalibrated: prompt lookup, guarded


@pytest.mark.parametrize("verb", [["generate", "hi"], ["chat"], ["demo"], ["serve", "--model", "selfspec-demo"]])
def test_every_cli_verb_defaults_to_auto(verb: list[str]) -> None:
    assert build_parser().parse_args(verb).drafter == "auto"


def test_both_adapters_default_to_auto() -> None:
    from langchain_selfspec import ChatSpeculative
    from llama_index.llms.selfspec import SpeculativeLLM

    assert ChatSpeculative().drafter == "auto"
    assert SpeculativeLLM().drafter == "auto"


def test_an_exit_layer_without_a_drafter_says_what_to_do() -> None:
    model = make_model("llama")
    with pytest.raises(ConfigurationError, match="pass drafter='early_exit'"):
        SpeculativeEngine(model, exit_layer=2)
    assert SpeculativeEngine(model, exit_layer=2, drafter="early_exit").config.exit_layer == 2
