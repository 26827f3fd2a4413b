"""``selfspec.decoding.options``: every engine option declared once, and everything built from it pinned to it.

An option added to :class:`EngineOptions` and not to ``from_pretrained``, a CLI verb it applies to,
``selfspec serve``'s loading path or one of the adapters' fields fails here; so does a keyword added
to one of the four generate/stream methods and not to :class:`GenerateOptions`.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser
from selfspec.cli.args import engine_kwargs
from selfspec.cli.serve import server_limits
from selfspec.decoding.generation import GenerationRequest
from selfspec.decoding.options import (
    LOAD_VERBS,
    LOADING_OPTIONS,
    RUN_VERBS,
    EngineOptions,
    GenerateKeywords,
    GenerateOptions,
    OptionSpec,
    check_drafter_name,
    option_spec,
)
from selfspec.errors import ConfigurationError
from selfspec.serving.server.settings import ServerLimits, limit_flags

DEFAULTS = EngineOptions.defaults()

#: A value other than the default for every option (the adapters' parity test in tests/system/test_defaults.py
#: uses it too), as a flag's text and as parsed: a new option
#: needs one here (the parity tests below fail without it).
GIVEN: dict[str, tuple[str | None, Any]] = {
    "quantization": ("4bit", "4bit"),
    "dtype": ("bfloat16", "bfloat16"),
    "device": ("cpu", "cpu"),
    "gguf_file": ("model.Q4_1.gguf", "model.Q4_1.gguf"),
    "trust_remote_code": (None, True),
    "allow_pickle": (None, True),
    "threads": ("3", 3),
    "drafter": ("early_exit", "early_exit"),
    "exit_layer": ("3", 3),
    "num_draft_tokens": ("5", 5),
    "draft_confidence": ("0.5", 0.5),
    "tree_nodes": ("8", 8),
    "draft_model": ("small/model", "small/model"),
    "exit_adapter": ("auto", "auto"),
    "medusa_heads": ("heads/", "heads/"),
    "eagle_head": ("head/", "head/"),
    "learn_online": (None, True),
    "batching": (None, True),
    "escape_special_tokens": (None, True),
    "compile": ("on", True),
    "row_exact": ("off", False),
    "calibrate": (None, False),
    "calibration_budget": ("none", None),
}

#: What each verb needs besides the flags under test.
VERB_ARGV = {
    "generate": ["generate", "a prompt"],
    "chat": ["chat"],
    "demo": ["demo"],
    "serve": ["serve", "--model", "selfspec-demo"],
    "calibrate": ["calibrate", "--model", "selfspec-demo"],
    "bench": ["bench"],
}


def parameters(function: Any, skip: int) -> dict[str, Any]:
    """A function's parameters after the first ``skip`` (name -> default)."""
    listed = list(inspect.signature(function).parameters.values())[skip:]
    return {p.name: p.default for p in listed if p.kind is not inspect.Parameter.VAR_KEYWORD}


def test_from_pretrained_takes_exactly_the_options_with_their_defaults() -> None:
    assert parameters(SpeculativeEngine.from_pretrained, 1) == DEFAULTS  # after name_or_path


def test_the_constructor_takes_every_engine_setting_with_its_default() -> None:
    init = parameters(SpeculativeEngine.__init__, 3)  # after self, model, tokenizer
    settings = {name: default for name, default in DEFAULTS.items() if name not in LOADING_OPTIONS}
    assert {name: init.get(name, "missing") for name in settings} == settings
    assert set(init) - set(settings) == {"calibration", "draft_tokenizer", "drafter_options", "fast_path"}


def test_every_option_has_a_sample_help_and_flag() -> None:
    assert set(GIVEN) == set(DEFAULTS), "add a sample value for each new option to GIVEN"
    for name in DEFAULTS:
        spec = option_spec(name)
        assert spec.help and spec.flag.startswith("--"), name
        assert RUN_VERBS <= spec.verbs <= LOAD_VERBS, name  # every option reaches every verb that runs an engine


@pytest.mark.parametrize("verb", sorted(LOAD_VERBS))
def test_each_verb_has_the_flags_of_its_options_with_their_defaults(verb: str) -> None:
    args = build_parser().parse_args(VERB_ARGV[verb])
    given = engine_kwargs(args)
    assert set(given) == set(EngineOptions.for_verb(verb))
    for name, value in given.items():
        assert value == option_spec(name).verb_defaults.get(verb, DEFAULTS[name]), (verb, name)


@pytest.mark.parametrize("verb", sorted(LOAD_VERBS))
def test_every_option_a_verb_takes_reaches_from_pretrained(verb: str) -> None:
    for name in EngineOptions.for_verb(verb):
        text, parsed = GIVEN[name]
        flag = [option_spec(name).flag] + ([text] if text is not None else [])
        argv = VERB_ARGV[verb][:1] + flag + VERB_ARGV[verb][1:]
        assert engine_kwargs(build_parser().parse_args(argv))[name] == parsed, (verb, name)


def test_the_options_are_checked_when_declared() -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'eagle'"):
        EngineOptions(drafter="eagle3")
    with pytest.raises(ConfigurationError, match=r"draft_confidence must be in \[0, 1\)"):
        EngineOptions(draft_confidence=1.0)
    with pytest.raises(ConfigurationError, match="calibration_budget must be positive"):
        EngineOptions(calibration_budget=0)
    for threads in (0, "2", True, 1.5):
        with pytest.raises(ConfigurationError, match="threads must be 'auto', an int >= 1 or None"):
            EngineOptions(threads=threads)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="batching must be True or False"):
        EngineOptions(batching="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "hint"),
    [("eagle3", "did you mean 'eagle'"), ("prompt-lookup", "did you mean 'prompt_lookup'"), ("magic", "choose one")],
)
def test_a_wrong_drafter_name_lists_the_names_and_the_closest(name: str, hint: str) -> None:
    with pytest.raises(ConfigurationError, match=f"unknown drafter '{name}'") as error:
        check_drafter_name(name)
    assert hint in str(error.value) and "early_exit, prompt_lookup" in str(error.value)


def test_a_registered_drafter_is_accepted() -> None:
    from selfspec import register_drafter
    from selfspec.drafting import NoDrafter, unregister_drafter

    register_drafter("options_test_drafter", lambda engine, **options: NoDrafter())
    try:
        check_drafter_name("options_test_drafter")
        assert EngineOptions(drafter="options_test_drafter").drafter == "options_test_drafter"
    finally:
        unregister_drafter("options_test_drafter")
    with pytest.raises(ConfigurationError):
        check_drafter_name("options_test_drafter")


# ------------------------------------------------------------------------------- the server
def test_serve_loads_its_engine_with_every_option() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--batching", "--escape-special-tokens"])
    given = engine_kwargs(args)
    assert set(given) == set(DEFAULTS) and given["batching"] and given["escape_special_tokens"]


def test_every_server_limit_flag_round_trips() -> None:
    parser_args = build_parser().parse_args(["serve", "--model", "m"])
    assert server_limits(parser_args, ServerLimits) == ServerLimits()
    argv = ["serve", "--model", "m", "--max-body-size", "1MiB", "--max-concurrent", "3", "--max-queue", "0"]
    argv += ["--header-timeout", "2", "--body-timeout", "3", "--keep-alive-timeout", "4"]
    argv += ["--allowed-host", "a.example", "--cors-origin", "http://b.example", "--shutdown-grace", "1.5"]
    limits = server_limits(build_parser().parse_args(argv), ServerLimits)
    assert limits == ServerLimits(2**20, 3, 0, 2.0, 3.0, 4.0, allowed_hosts=("a.example",),
                                  cors_origins=("http://b.example",), shutdown_grace=1.5)  # fmt: skip
    not_flags = {"max_header_bytes", "max_json_depth", "retry_after"}
    assert {name for name, _, _ in limit_flags()} == {f.name for f in dataclasses.fields(ServerLimits)} - not_flags
    # one mechanism for flags on dataclass fields: the engine's options' OptionSpec
    assert all(isinstance(spec, OptionSpec) and spec.verbs == {"serve"} for _, _, spec in limit_flags())


# ------------------------------------------------------------------------------- a call's options
def test_the_four_methods_take_the_generate_options() -> None:
    for method in (SpeculativeEngine.generate, SpeculativeEngine.generate_ids, SpeculativeEngine.stream,
                   SpeculativeEngine.stream_ids):  # fmt: skip
        listed = inspect.signature(method).parameters
        assert list(listed)[2:] == ["options", "keywords"], method
        assert listed["keywords"].kind is inspect.Parameter.VAR_KEYWORD
        assert "Unpack[GenerateKeywords]" in str(listed["keywords"].annotation)


def test_generate_options_and_keywords_agree() -> None:
    declared = {f.name: f.type for f in dataclasses.fields(GenerateOptions)}
    keywords = {name: getattr(kind, "__forward_arg__", kind) for name, kind in GenerateKeywords.__annotations__.items()}
    assert keywords == declared
    assert issubclass(GenerationRequest, GenerateOptions)  # a request is the options plus its prompt
    request = GenerationRequest.for_prompt([1, 2], GenerateOptions(max_new_tokens=3, seed=4))
    assert (request.prompt_ids, request.max_new_tokens, request.seed) == ([1, 2], 3, 4)


def test_keywords_replace_the_options_and_a_typo_names_the_option() -> None:
    base = GenerateOptions(max_new_tokens=5, seed=1)
    assert GenerateOptions.of(base, {"seed": 2}, "generate") == GenerateOptions(max_new_tokens=5, seed=2)
    assert GenerateOptions.of(None, {}, "generate") == GenerateOptions()
    with pytest.raises(TypeError, match=r"generate\(\) got an unexpected keyword argument 'temprature' \(did you mean"):
        GenerateOptions.of(None, {"temprature": 0.5}, "generate")


@pytest.mark.parametrize("verb", ["generate", "chat", "calibrate", "bench", "demo"])
def test_every_verb_takes_max_tokens_and_its_alias(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    from selfspec.cli.main import build_parser

    parser = build_parser()
    tail = {"generate": ["hi"], "calibrate": ["-m", "M"], "bench": ["-m", "M"]}.get(verb, [])
    assert parser.parse_args([verb, "--max-tokens", "7", *tail]).max_new_tokens == 7
    assert parser.parse_args([verb, "--max-new-tokens", "9", *tail]).max_new_tokens == 9
    with pytest.raises(SystemExit):
        parser.parse_args([verb, "--max-tokens", "0", *tail])
    assert "max_tokens must be an int >= 1, got int 0" in capsys.readouterr().err
