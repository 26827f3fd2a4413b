"""The request planner's pure parts (no model): the one tool-choice normaliser, ``response_schema``, usage.

Every front door (``selfspec serve``, both adapters, local and endpoint) reads ``tool_choice`` and
``response_format`` through these, and counts tokens with :class:`TokenUsage`.
"""

from __future__ import annotations

from typing import Any

import pytest

from selfspec.serving.requests import (
    RequestFieldError,
    TokenUsage,
    ToolOffer,
    forced_tool,
    normalize_tool_choice,
    offer_tools,
    response_schema,
)

NAMES = ["sing", "dance"]
NAMED = {"type": "function", "function": {"name": "sing"}}


@pytest.mark.parametrize(
    ("choice", "normalized", "forced"),
    [
        (None, "auto", None),
        ("auto", "auto", None),
        (False, "auto", None),
        ("none", "none", None),
        ("required", "required", ""),
        ("any", "required", ""),
        (True, "required", ""),
        ("sing", NAMED, "sing"),
        ({"name": "sing"}, NAMED, "sing"),
        (NAMED, NAMED, "sing"),
    ],
)
def test_every_tool_choice_spelling(choice: Any, normalized: Any, forced: str | None) -> None:
    assert normalize_tool_choice(choice, NAMES) == normalized
    tools = [{"type": "function", "function": {"name": name}} for name in NAMES]
    assert forced_tool(normalize_tool_choice(choice, NAMES), tools) == forced


@pytest.mark.parametrize(
    ("choice", "names", "message"),
    [
        ("nope", NAMES, "not one of the tools"),
        ({"function": {}}, NAMES, "names no function"),
        ({"type": "banana", "function": {"name": "sing"}}, NAMES, "type 'banana' is not supported"),
        ({"type": None, "name": "sing"}, NAMES, "type None is not supported"),
        (3, NAMES, "must be 'auto', 'none', 'any', 'required'"),
        ("any", [], "needs at least one tool"),
        (True, [], "needs at least one tool"),
    ],
)
def test_bad_tool_choices_are_value_errors(choice: Any, names: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        normalize_tool_choice(choice, names)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("response_format", "schema"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "object"}),
        ({"type": "json_object", "schema": SCHEMA}, SCHEMA),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, SCHEMA),
        ({"type": "json_schema", "schema": SCHEMA}, SCHEMA),
    ],
)
def test_response_schema(response_format: Any, schema: Any) -> None:
    assert response_schema(response_format) == schema


@pytest.mark.parametrize("response_format", [{"type": "json_schema"}, {"type": "yaml"}, "json"])
def test_bad_response_formats_are_value_errors(response_format: Any) -> None:
    with pytest.raises(ValueError, match="response_format must be"):
        response_schema(response_format)


def test_usage_is_spelt_for_each_front_door() -> None:
    usage = TokenUsage(prompt_tokens=7, completion_tokens=5)
    assert usage.total_tokens == 12
    assert usage.openai() == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert usage.langchain() == {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12}


def test_offer_tools_is_read_once_for_local_and_endpoint_mode() -> None:
    tools = [{"type": "function", "function": {"name": name}} for name in NAMES]
    assert offer_tools(tools, "none") == ToolOffer([], None)  # nothing offered: no tools sent either
    assert offer_tools(None, None) == ToolOffer([], None)
    forced = offer_tools(tools, True)
    assert forced.choice == "required" and forced.forced == "" and len(forced.tools) == 2
    assert offer_tools(tools, {"name": "dance"}).forced == "dance"
    with pytest.raises(RequestFieldError) as bad_tool:
        offer_tools([{"type": "function"}], None)
    assert bad_tool.value.field == "tools"
    with pytest.raises(RequestFieldError) as bad_choice:
        offer_tools(tools, "nope")
    assert bad_choice.value.field == "tool_choice"


def test_the_adapters_constructor_guard() -> None:
    """What ``ChatSpeculative`` and ``SpeculativeLLM`` share: the drafter first, ``model_name``, no unknown names."""
    from pydantic import BaseModel, Field

    from selfspec.errors import ConfigurationError
    from selfspec.serving.requests import adapter_arguments, check_adapter_drafter

    class Adapter(BaseModel):
        model: str = ""
        temperature: float = Field(default=0.0, alias="temp")

    with pytest.raises(ConfigurationError, match="eagle3"):
        check_adapter_drafter({"drafter": "eagle3"})
    check_adapter_drafter({"drafter": "eagle3", "base_url": "http://localhost:8000/v1"})  # endpoint mode ignores it
    check_adapter_drafter({})  # "auto"
    assert adapter_arguments("Adapter", {"model_name": "m", "temp": 0.5}, Adapter.model_fields) == {
        "model": "m",
        "temp": 0.5,
    }
    with pytest.raises(ValueError, match="not both"):
        adapter_arguments("Adapter", {"model": "a", "model_name": "b"}, Adapter.model_fields)
    with pytest.raises(
        ValueError, match=r"Adapter got an unknown argument 'temprature' \(did you mean 'temperature'\?\)"
    ):
        adapter_arguments("Adapter", {"temprature": 1.0}, Adapter.model_fields)
    assert adapter_arguments("Adapter", {"class_name": "x"}, Adapter.model_fields, {"class_name"}) == {
        "class_name": "x"
    }
