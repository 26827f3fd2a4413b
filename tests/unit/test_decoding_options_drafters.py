"""The engine's options are composed from its own and every registered drafter's (issue 42, item 1).

The built-in drafters' options are declared in torch-free modules beside them (the command line and the
adapters read them before torch is imported); a test pins those modules to the registrations. A drafter
registered later adds its options to ``EngineOptions.current()``, and a declaration that clashes is refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

from selfspec import SpeculativeEngine, register_drafter
from selfspec.cli import build_parser
from selfspec.cli.args import engine_kwargs
from selfspec.decoding.options import EngineOptions, option_spec
from selfspec.drafting import DrafterOption, NoDrafter, unregister_drafter
from selfspec.errors import ConfigurationError

BUILT_IN = {"exit_adapter", "draft_model", "medusa_heads", "eagle_head", "learn_online"}

FRESH = """
import json, sys
from selfspec.drafting import registry
declared = sorted(registry.declared_options())
torch_free = "torch" not in sys.modules
registered = sorted({option.name for spec in registry.registered() for option in spec.options})
users = {name: registry.drafters_declaring(name) for name in declared}
print(json.dumps([declared == registered, torch_free, users]))
"""


def test_the_torch_free_declarations_are_the_registrations() -> None:
    """A fresh process: the options the built-in modules declare are those the built-in drafters register."""
    out = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, check=True).stdout
    same, torch_free, users = json.loads(out)
    assert same and torch_free, out
    assert users == {
        "draft_model": ["draft_model"],
        "eagle_head": ["eagle", "eagle_hybrid"],
        "exit_adapter": ["early_exit", "hybrid", "auto"],
        "learn_online": ["eagle", "eagle_hybrid", "auto"],
        "medusa_heads": ["medusa"],
    }


def test_the_builtin_drafters_options_are_engine_options() -> None:
    assert BUILT_IN <= set(EngineOptions.names()) and set(EngineOptions.drafter_options()) == BUILT_IN
    declared = {f.name: f for f in dataclasses.fields(EngineOptions)}
    assert declared["eagle_head"].metadata["drafter_option"].name == "eagle_head"
    assert option_spec("medusa_heads").flag == "--medusa-heads"
    assert EngineOptions(eagle_head="auto").eagle_head == "auto"  # "auto" passes through to the head's resolver


def test_a_later_drafter_adds_its_options_everywhere_and_goes_away() -> None:
    option = DrafterOption("options_test_file", "with --drafter options_test: a file")
    register_drafter("options_test", lambda engine, **options: NoDrafter(), options=(option,))
    try:
        assert "options_test_file" in EngineOptions.names() and EngineOptions.current() is not EngineOptions
        assert issubclass(EngineOptions.current(), EngineOptions)
        given = EngineOptions.of({"drafter": "options_test", "options_test_file": "f.bin"})
        assert given.options_test_file == "f.bin" and isinstance(given, EngineOptions)
        args = build_parser().parse_args(["generate", "--options-test-file", "f.bin", "hi"])
        assert engine_kwargs(args)["options_test_file"] == "f.bin"
        with pytest.raises(TypeError, match="did you mean 'options_test_file'"):
            EngineOptions.of({"options_test_fil": "f.bin"}, "from_pretrained")
    finally:
        unregister_drafter("options_test")
    assert "options_test_file" not in EngineOptions.names() and EngineOptions.current() is EngineOptions


def test_a_clashing_declaration_is_refused() -> None:
    changed = DrafterOption("eagle_head", "another meaning")
    with pytest.raises(ConfigurationError, match="'eagle_head' is declared differently"):
        register_drafter("options_clash", lambda engine, **options: NoDrafter(), options=(changed,))
    register_drafter("options_clash", lambda engine, **options: NoDrafter(), options=(DrafterOption("threads", "x"),))
    try:
        with pytest.raises(ConfigurationError, match="may not be named like an engine option: 'threads'"):
            EngineOptions.current()
    finally:
        unregister_drafter("options_clash")
    with pytest.raises(ConfigurationError, match="must be DrafterOption values"):
        register_drafter("options_clash", lambda engine, **options: NoDrafter(), options=("file",))  # type: ignore[arg-type]


def test_the_engine_takes_later_options_as_keywords() -> None:
    for method in (SpeculativeEngine.from_pretrained, SpeculativeEngine.__init__):
        listed = inspect.signature(method).parameters
        assert listed["drafter_settings"].kind is inspect.Parameter.VAR_KEYWORD, method
