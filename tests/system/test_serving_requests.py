"""The request planner (selfspec.serving.requests): budget, tools, constraints, prompts, and the async bridge."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from selfspec import SpeculativeEngine
from selfspec.errors import InvalidPromptError
from selfspec.serving.requests import (
    DEFAULT_MAX_TOKENS,
    SCHEMA_INSTRUCTION,
    TOOLS_INSTRUCTION,
    agenerate,
    aiterate,
    check_arguments,
    forced_tool,
    normalize_tool_choice,
    plan_request,
    prepare_messages,
    response_schema,
    template_renders_tool_calls,
    template_renders_tools,
    token_budget,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather at a location.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "the city"}},
            "required": ["location"],
        },
    },
}
#: SmolLM2-135M-Instruct's chat template: it renders neither tools nor past tool calls.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def lookup_engine() -> SpeculativeEngine:
    """The demo model with prompt-lookup drafts: one target forward (one rotary call) per round."""
    return SpeculativeEngine.from_pretrained("selfspec-demo", drafter="prompt_lookup")


@pytest.fixture(scope="module")
def batching_engine() -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained("selfspec-demo", drafter="prompt_lookup", batching=True)


@pytest.fixture
def smol_template_tokenizer(demo_engine: SpeculativeEngine) -> Any:
    tokenizer = copy.deepcopy(demo_engine.tokenizer)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


# ------------------------------------------------------------------------------- budget
def test_one_default_budget_never_past_the_window() -> None:
    assert token_budget(None, 10, 2048) == DEFAULT_MAX_TOKENS == 256
    assert token_budget(None, 10, None) == DEFAULT_MAX_TOKENS
    assert token_budget(None, 2000, 2048) == 48
    assert token_budget(1000, 10, 2048) == 1000
    assert token_budget(1000, 2000, 2048) == 48
    with pytest.raises(InvalidPromptError, match="fills the model's context window of 2048"):
        token_budget(None, 2048, 2048)
    # with truncate_prompt the engine cuts the prompt: the budget stays
    assert token_budget(None, 5000, 2048, truncate_prompt=True) == DEFAULT_MAX_TOKENS
    assert token_budget(700, 5000, 2048, truncate_prompt=True) == 700
    assert token_budget(None, 5000, 300, truncate_prompt=True) == 150
    for bad in (0, -1, True, 2.5):  # left for the engine to refuse, naming max_new_tokens
        assert token_budget(bad, 10, 2048) is bad  # type: ignore[arg-type]


def test_the_default_is_the_same_in_both_adapters_and_the_server() -> None:
    from langchain_selfspec import ChatSpeculative
    from llama_index.llms.selfspec import SpeculativeLLM

    from selfspec.serving.server import app

    assert ChatSpeculative().max_tokens is None  # None means DEFAULT_MAX_TOKENS (plan_request)
    assert SpeculativeLLM().max_new_tokens == DEFAULT_MAX_TOKENS
    assert app.DEFAULT_MAX_TOKENS is DEFAULT_MAX_TOKENS  # the server plans its requests here too
    assert app.plan_request is plan_request  # one planner: budget, constraint, guard, usage


def test_plan_uses_the_default_budget(lookup_engine: SpeculativeEngine) -> None:
    plan = plan_request(lookup_engine, [{"role": "user", "content": "Hello"}])
    assert plan.max_new_tokens == DEFAULT_MAX_TOKENS
    assert plan.constraint is None and not plan.parse_tools


# ------------------------------------------------------------------------------- arguments and choices
def test_unknown_arguments_name_the_closest() -> None:
    with pytest.raises(ValueError, match=r"unknown argument 'temprature' \(did you mean 'temperature'\?\)"):
        check_arguments("SpeculativeLLM", ["temprature"], ["temperature", "top_p"])
    with pytest.raises(ValueError, match="unknown arguments 'a', 'zzz'"):
        check_arguments("x", ["zzz", "a"], ["temperature"])
    check_arguments("x", ["top_p"], ["temperature", "top_p"])


def test_tool_choice_is_checked_when_normalised() -> None:
    names = ["get_weather"]
    assert normalize_tool_choice(None, names) == "auto"
    assert normalize_tool_choice("any", names) == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert normalize_tool_choice("get_weather", names) == named
    assert forced_tool(named, [WEATHER]) == "get_weather"
    assert forced_tool("required", [WEATHER]) == ""
    assert forced_tool("auto", [WEATHER]) is None
    for bad, message in ((42, "tool_choice must be"), ("nope", "not one of the tools"), ({"x": 1}, "names no")):
        with pytest.raises(ValueError, match=message):
            normalize_tool_choice(bad, names)


def test_json_mode_with_a_schema_is_that_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert response_schema({"type": "json_object"}) == {"type": "object"}
    assert response_schema({"type": "json_object", "schema": schema}) == schema
    assert response_schema({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}) == schema
    assert response_schema({"type": "text"}) is None
    with pytest.raises(ValueError, match="response_format"):
        response_schema({"type": "json_schema"})


def test_json_mode_constrains_to_the_schema(lookup_engine: SpeculativeEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"setup": {"type": "string"}, "punchline": {"type": "string"}},
        "required": ["setup", "punchline"],
    }
    messages = [{"role": "user", "content": "Tell me a joke."}]
    plan = plan_request(
        lookup_engine, messages, max_tokens=200, response_format={"type": "json_object", "schema": schema}
    )
    assert plan.constraint is not None and plan.constraint.schema == schema
    output = plan.generate()
    assert output.finish_reason == "stop", output.text
    assert set(json.loads(output.text)) == {"setup", "punchline"}


# ------------------------------------------------------------------------------- prompts
def test_tools_reach_a_template_that_drops_them(smol_template_tokenizer: Any, demo_engine: SpeculativeEngine) -> None:
    assert template_renders_tools(demo_engine.tokenizer) and template_renders_tool_calls(demo_engine.tokenizer)
    tokenizer = smol_template_tokenizer
    assert not template_renders_tools(tokenizer) and not template_renders_tool_calls(tokenizer)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    messages, tools = prepare_messages(tokenizer, history, [WEATHER], forced="get_weather")
    assert tools is None  # written into the messages instead
    assert messages[0]["content"].startswith(TOOLS_INSTRUCTION)
    assert '"description": "the city"' in messages[0]["content"]  # schema descriptions reach the prompt
    assert messages[0]["content"].endswith("Weather in Paris?\n\nCall get_weather.")  # the schema is stated once
    assert messages[0]["content"].count('"description": "the city"') == 1
    call = '<tool_call>{"name": "get_weather", "arguments": {"location": "Paris"}}</tool_call>'
    assert messages[1]["content"] == call
    assert "tool_calls" not in messages[1]
    assert history[0]["content"] == "Weather in Paris?"  # the caller's messages are not changed
    # a template that renders tools gets them as they are
    same, tools = prepare_messages(demo_engine.tokenizer, history, [WEATHER], forced="get_weather")
    assert tools == [WEATHER] and same[0]["content"] == "Weather in Paris?" and same[1]["tool_calls"]


def test_a_schema_is_stated_in_the_last_user_message(demo_engine: SpeculativeEngine) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "description": "the name"}}}
    messages, _ = prepare_messages(demo_engine.tokenizer, [{"role": "user", "content": "Anne is 27."}], [], schema)
    assert messages[-1]["content"] == "Anne is 27.\n\n" + SCHEMA_INSTRUCTION + json.dumps(schema)


# ------------------------------------------------------------------------------- the async bridge
def _rounds(engine: SpeculativeEngine) -> tuple[list[int], Any]:
    """Counts the engine's target forwards (one rotary call each with prompt-lookup drafts)."""
    calls: list[int] = []
    handle = engine.model.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("engine_name", ["lookup_engine", "batching_engine"])
def test_a_cancelled_call_stops_within_one_round(engine_name: str, request: pytest.FixtureRequest) -> None:
    engine: SpeculativeEngine = request.getfixturevalue(engine_name)
    plan = plan_request(engine, "Write a long story about the Bennet sisters.", max_tokens=1500)
    calls, handle = _rounds(engine)
    finished: list[int] = []

    async def main() -> int:
        task = asyncio.create_task(agenerate(plan.stream))
        while len(calls) < 6:  # prefill and a few rounds
            await asyncio.sleep(0.002)
        task.cancel()
        at_cancel = len(calls)
        with pytest.raises(asyncio.CancelledError):
            await task
        return at_cancel

    try:
        at_cancel = asyncio.run(main())  # returns once the worker has stopped
        finished.append(len(calls))
    finally:
        handle.remove()
    assert finished[0] - at_cancel <= 1, f"{finished[0] - at_cancel} rounds after the cancel"
    # the engine stays usable, and gives the text a fresh call gives
    again = plan_request(engine, "Hello", max_tokens=8)
    assert engine.generate_ids(again.prompt_ids, max_new_tokens=8).text == again.generate().text


def test_aiterate_closes_the_engine_stream_within_a_round(lookup_engine: SpeculativeEngine) -> None:
    plan = plan_request(lookup_engine, "Write a long story about the Bennet sisters.", max_tokens=1500)
    calls, handle = _rounds(lookup_engine)
    streams: list[Any] = []

    def make() -> Any:
        streams.append(plan.stream())
        return streams[0]

    async def main() -> int:
        got = 0
        async for _ in aiterate(make):
            got += 1
            if got == 10:
                break
        return len(calls)

    try:
        at_break = asyncio.run(main())
    finally:
        handle.remove()
    assert len(calls) - at_break <= 1
    assert streams[0].finish_reason == "cancelled"


def test_agenerate_returns_the_output(lookup_engine: SpeculativeEngine) -> None:
    plan = plan_request(lookup_engine, [{"role": "user", "content": "Hello"}], max_tokens=12)
    output = asyncio.run(agenerate(plan.stream))
    assert output.text == plan.generate().text and output.finish_reason in ("stop", "length")


def test_a_pydantic_class_and_its_schema_are_stated_alike() -> None:
    """Pydantic's generated property titles are left out of the stated schema (issue 19, SmolLM2's JSON mode)."""
    from pydantic import BaseModel, Field

    from selfspec.serving.requests import schema_instruction

    class Joke(BaseModel):
        """Joke to tell user."""

        setup: str = Field(description="question to set up a joke")
        first_name: str = Field(title="Given name")

    stated = json.loads(schema_instruction(Joke.model_json_schema()).removeprefix(SCHEMA_INSTRUCTION))
    assert "title" not in stated["properties"]["setup"]  # "Setup": the key again
    assert stated["properties"]["first_name"]["title"] == "Given name"  # a title of its own is kept
    assert stated["title"] == "Joke" and stated["description"] == "Joke to tell user."
