"""``drafter="auto"`` is the default everywhere a model is named: the engine, both adapters, every CLI verb, the server.

Passing an early-exit setting without naming the drafter is refused with what to do (``auto`` takes
the exit layer from its calibrated plan), so a caller who meant the early exit is never silently
given another drafter. Both adapters take every engine option with its default
(:class:`~selfspec.decoding.options.EngineOptions`) and refuse a wrong drafter name when constructed,
without importing torch.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from typing import Any

import pytest
from test_decoding_options import GIVEN
from tiny_models import make_model

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser
from selfspec.decoding.options import BUILTIN_DRAFTERS, EngineOptions
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


def adapter_classes() -> list[Any]:
    from langchain_selfspec import ChatSpeculative
    from llama_index.llms.selfspec import SpeculativeLLM

    return [ChatSpeculative, SpeculativeLLM]


@pytest.mark.parametrize("index", [0, 1], ids=["ChatSpeculative", "SpeculativeLLM"])
def test_each_adapter_has_a_described_field_per_option_with_its_default(index: int) -> None:
    adapter, defaults = adapter_classes()[index], EngineOptions.defaults()
    fields = adapter.model_fields
    assert {name: fields[name].default if name in fields else "missing" for name in defaults} == defaults
    assert all(fields[name].description for name in defaults)
    chosen = {name: parsed for name, (_, parsed) in GIVEN.items()}
    chosen["drafter"] = "draft_model"  # so that draft_model is passed on
    assert adapter(**chosen)._engine_args() == chosen


def test_the_builtin_drafters_are_the_registrys() -> None:
    """A fresh process, so that drafters registered by other tests do not count."""
    script = "import selfspec.decoding.engine; from selfspec import list_drafters; print(*list_drafters())"
    names = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert tuple(names) == BUILTIN_DRAFTERS


TORCH_FREE = """
import sys
from langchain_selfspec import ChatSpeculative
from llama_index.llms.selfspec import SpeculativeLLM
from selfspec.errors import ConfigurationError
for adapter in (ChatSpeculative, SpeculativeLLM):
    for name, closest in (("eagle3", "eagle"), ("prompt-lookup", "prompt_lookup")):
        try:
            adapter(model="selfspec-demo", drafter=name)
        except ConfigurationError as error:
            assert f"did you mean {closest!r}" in str(error) and "choose one of early_exit" in str(error), error
        else:
            raise AssertionError(f"{adapter.__name__}(drafter={name!r}) constructed")
    assert adapter(drafter="eagle").drafter == "eagle"
    assert adapter(base_url="http://127.0.0.1:9/v1", drafter="eagle3").drafter == "eagle3"  # endpoint mode ignores it
print("torch" in sys.modules)
"""


def test_adapters_refuse_a_wrong_drafter_name_at_construction_without_torch() -> None:
    result = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False"], result.stderr


def test_adapters_accept_a_registered_drafter() -> None:
    from selfspec import register_drafter
    from selfspec.drafting import NoDrafter, unregister_drafter

    register_drafter("adapter_test_drafter", lambda engine, **options: NoDrafter())
    try:
        for adapter in adapter_classes():
            assert adapter(drafter="adapter_test_drafter").drafter == "adapter_test_drafter"
    finally:
        unregister_drafter("adapter_test_drafter")
    for adapter in adapter_classes():
        with pytest.raises(ConfigurationError, match="unknown drafter 'adapter_test_drafter'"):
            adapter(drafter="adapter_test_drafter")
