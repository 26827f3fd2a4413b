"""``selfspec.decoding.config``: every engine argument resolved once, against a calibration, with no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from selfspec.decoding.config import DEFAULT_NUM_DRAFT_TOKENS, EngineConfig, check_arguments, default_exit_layer
from selfspec.decoding.options import EngineOptions
from selfspec.errors import ConfigurationError

RUNNER = SimpleNamespace(num_layers=12, fast_layers=None)  # all resolve reads of the model runner


def resolve(calibration: dict | None = None, **arguments) -> EngineConfig:
    return EngineConfig.resolve(RUNNER, "", calibration or {}, EngineOptions(**arguments))


def test_auto_values_without_a_calibration() -> None:
    config = resolve(drafter="early_exit")
    assert config.exit_layer == default_exit_layer(12) == 3
    assert config.num_draft_tokens == DEFAULT_NUM_DRAFT_TOKENS and config.adaptive


def test_auto_values_come_from_the_calibration() -> None:
    config = resolve({"exit_layer": 5, "num_draft_tokens": 2}, drafter="early_exit")
    assert (config.exit_layer, config.num_draft_tokens) == (5, 2)
    fixed = resolve({"exit_layer": 5}, drafter="early_exit", exit_layer=7, num_draft_tokens=3)
    assert (fixed.exit_layer, fixed.num_draft_tokens, fixed.adaptive) == (7, 3, False)


def test_a_calibrated_layer_the_model_does_not_have_is_ignored() -> None:
    assert resolve({"exit_layer": 40}, drafter="early_exit").exit_layer == 3


def test_drafter_auto_takes_the_plans_draft_length() -> None:
    plan = {"plan": {"method": "prompt_lookup", "settings": {"num_draft_tokens": 6, "min_ngram": 2}}}
    assert resolve(plan).num_draft_tokens == 6


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"drafter": "magic"}, "unknown drafter"),
        ({"exit_layer": 2}, "pass drafter='early_exit'"),
        ({"drafter": "early_exit", "exit_layer": "deep"}, "exit_layer must be 'auto' or an int"),
        ({"drafter": "early_exit", "num_draft_tokens": 0}, "num_draft_tokens"),
        ({"drafter": "early_exit", "draft_confidence": 1.5}, "draft_confidence"),
        ({"drafter": "prompt_lookup", "eagle_head": "somewhere"}, "eagle_head= is only used with"),
        ({"batching": "yes"}, "batching must be True or False"),
    ],
)
def test_bad_arguments_are_refused(arguments: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        resolve(**arguments)


def test_check_arguments_needs_no_model() -> None:
    check_arguments("auto", "auto", "auto")
    with pytest.raises(ConfigurationError):
        check_arguments("auto", "auto", "auto", tree_nodes=-1)
