"""ChatSpeculative on the request planner: arguments, tool options, cut-off structured output, cancellation."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_selfspec import ChatSpeculative


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name")
    age: int = Field(description="the person's age in years", ge=0, le=150)  # bounded: the demo model loops in digits


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


@pytest.fixture(scope="module", params=["local", "endpoint"])
def mode(request: pytest.FixtureRequest, demo_engine: Any) -> dict[str, Any]:
    if request.param == "local":
        return {"model": "selfspec-demo"}
    return {"model": "selfspec-demo", **request.getfixturevalue("selfspec_server")}


# ------------------------------------------------------------------------------- construction
def test_unknown_constructor_arguments_name_the_closest_field() -> None:
    with pytest.raises(ValueError, match=r"unknown argument 'temprature' \(did you mean 'temperature'\?\)"):
        ChatSpeculative(temprature=0.5)
    with pytest.raises(ValueError, match="unknown argument 'no_such_option'"):
        ChatSpeculative(no_such_option=1)
    assert ChatSpeculative(model_name="foo").model == "foo"  # ChatOpenAI's name for the field
    assert ChatSpeculative(model="foo", temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="not both"):
        ChatSpeculative(model="a", model_name="b")


# ------------------------------------------------------------------------------- bind_tools
def test_bind_tools_takes_strict_and_parallel_tool_calls() -> None:
    llm = ChatSpeculative()
    bound = llm.bind_tools([get_weather], strict=True, parallel_tool_calls=False)
    assert bound.kwargs["parallel_tool_calls"] is False  # type: ignore[attr-defined]
    assert "strict" not in bound.kwargs  # type: ignore[attr-defined]  # constrained calls are strict by construction
    for bad, message in ((42, "tool_choice must be"), ("nope", "not one of the tools")):
        with pytest.raises(ValueError, match=message):  # at bind time, not at invoke
            llm.bind_tools([get_weather], tool_choice=bad)
    with pytest.raises(ValueError, match="parallel_tool_calls must be a bool"):
        llm.bind_tools([get_weather], parallel_tool_calls="no")  # type: ignore[arg-type]


def test_strict_tool_calls_invoke(mode: dict[str, Any]) -> None:
    llm = ChatSpeculative(**mode, max_tokens=40)
    message = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke("Weather in Paris?")
    assert message.tool_calls[0]["name"] == "get_weather"
    assert set(message.tool_calls[0]["args"]) == {"location"}


def test_parallel_tool_calls_false_gives_at_most_one_call(mode: dict[str, Any]) -> None:
    llm = ChatSpeculative(**mode, max_tokens=120)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    prompt = "Use the tools: add 1 and 2, and add 3 and 4."
    for parallel in (False, None):
        message = llm.bind_tools([add, get_weather], parallel_tool_calls=parallel).invoke(prompt)
        if parallel is False:
            assert len(message.tool_calls) + len(message.invalid_tool_calls) <= 1


# ------------------------------------------------------------------------------- cut off by max_tokens
def test_structured_output_cut_by_max_tokens_raises_a_clear_error(mode: dict[str, Any]) -> None:
    llm = ChatSpeculative(**mode, max_tokens=8)
    for method in ("function_calling", "json_schema"):
        structured = llm.with_structured_output(Person, method=method)  # type: ignore[arg-type]
        with pytest.raises(OutputParserException, match=r"max_tokens=8 \(8 tokens used\)"):
            structured.invoke("Anne is 27.")
        with pytest.raises(OutputParserException, match="max_tokens=8"):
            for _ in structured.stream("Anne is 27."):
                pass
        raw = llm.with_structured_output(Person, method=method, include_raw=True).invoke("Anne is 27.")  # type: ignore[arg-type]
        assert raw["parsed"] is None
        assert isinstance(raw["parsing_error"], OutputParserException)
        assert "max_tokens=8" in str(raw["parsing_error"])
    # a call cut inside its arguments: invalid_tool_calls carry the arguments' text only
    raw = ChatSpeculative(**mode, max_tokens=16).with_structured_output(Person, include_raw=True).invoke("Anne is 27.")
    assert "max_tokens=16" in str(raw["parsing_error"])
    [bad] = raw["raw"].invalid_tool_calls
    assert bad["name"] == "Person"
    assert bad["args"].startswith("{") and '"arguments"' not in bad["args"] and "Person" not in bad["args"]


def test_a_dict_schema_cut_by_max_tokens_is_not_read_as_partial_json(mode: dict[str, Any]) -> None:
    """LangChain's JSON parser closes a cut string; a cut answer must still be an error, not a partial dict."""
    llm = ChatSpeculative(**mode, max_tokens=8)
    for method in ("json_schema", "json_mode"):
        structured = llm.with_structured_output(Person.model_json_schema(), method=method)  # type: ignore[arg-type]
        with pytest.raises(OutputParserException, match=r"max_tokens=8 \(8 tokens used\)"):
            structured.invoke("Anne is 27.")
        with pytest.raises(OutputParserException, match="max_tokens=8"):
            for _ in structured.stream("Anne is 27."):
                pass


async def test_structured_output_cut_by_max_tokens_raises_async(mode: dict[str, Any]) -> None:
    structured = ChatSpeculative(**mode, max_tokens=8).with_structured_output(Person)
    with pytest.raises(OutputParserException, match="max_tokens=8"):
        await structured.ainvoke("Anne is 27.")


def test_json_mode_is_constrained_to_the_schema(mode: dict[str, Any]) -> None:
    llm = ChatSpeculative(**mode, max_tokens=120)
    result = llm.with_structured_output(Person.model_json_schema(), method="json_mode").invoke("Anne is 27.")
    assert set(result) == {"name", "age"} and isinstance(result["age"], int)


# ------------------------------------------------------------------------------- cancellation (issue 18)
def _round_counter(llm: ChatSpeculative) -> tuple[list[int], Any]:
    """Counts target forwards: one per round with prompt-lookup drafts (no draft forwards)."""
    calls: list[int] = []
    rotary = llm.get_engine().model.model.rotary_emb
    return calls, rotary.register_forward_hook(lambda *args: calls.append(1))


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("path", ["ainvoke", "astream", "abatch"])
def test_a_cancelled_call_stops_within_one_round(path: str, batching: bool) -> None:
    """The reproduction of issue 18: a cancelled ``ainvoke`` kept the engine going for seconds."""
    llm = ChatSpeculative(model="selfspec-demo", drafter="prompt_lookup", batching=batching, max_tokens=1500)
    calls, handle = _round_counter(llm)

    async def call() -> Any:
        if path == "ainvoke":
            return await llm.ainvoke("Write a long story.")
        if path == "abatch":
            return await llm.abatch(["Write a long story.", "Tell me about Longbourn."])
        return [chunk async for chunk in llm.astream("Write a long story.")]

    async def main() -> tuple[int, float]:
        task = asyncio.create_task(call())
        while len(calls) < 6:  # prefill and a few rounds
            await asyncio.sleep(0.002)
        task.cancel()
        at_cancel, cancelled_at = len(calls), time.perf_counter()
        with pytest.raises(asyncio.CancelledError):
            await task
        return at_cancel, cancelled_at

    try:
        at_cancel, cancelled_at = asyncio.run(main())
        returned_after = time.perf_counter() - cancelled_at  # returns once the worker threads have stopped
    finally:
        handle.remove()
    after = len(calls) - at_cancel
    assert after <= (2 if path == "abatch" else 1), f"{after} rounds after the cancel"
    # the engine is still usable and gives the text a fresh call gives
    fresh = ChatSpeculative(model="selfspec-demo", drafter="prompt_lookup", batching=batching, max_tokens=8)
    assert fresh.invoke("Hello").content == fresh.invoke("Hello").content
    print(json.dumps({"path": path, "batching": batching, "rounds_after_cancel": after,
                      "seconds_to_return": round(returned_after, 3)}))


# ------------------------------------------------------------------------------- repetition (issue 19)
def test_a_json_loop_stopped_early_is_a_clear_output_parser_exception() -> None:
    """A call stopped on a loop inside a JSON string reaches LangChain's parser as the cut-off does."""
    from langchain_core.output_parsers import JsonOutputParser
    from selfspec.serving.requests import plan_request

    from langchain_selfspec.chat_models import _chat_result, _cut_off_check

    engine = ChatSpeculative(model="selfspec-demo").get_engine()
    # a raw prompt that loops the demo model; minLength keeps the grammar from ending the string
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 5000}}, "required": ["text"]}
    plan = plan_request(engine, 'la la la la la la la la {"text": "la la la la la la la la', json_schema=schema,
                        max_tokens=900)
    message = _chat_result(plan, "selfspec-demo", plan.generate()).generations[0].message
    used = message.usage_metadata["output_tokens"]  # type: ignore[index]
    assert message.response_metadata["finish_reason"] == "repetition" and used < 600
    with pytest.raises(OutputParserException, match=rf"repetition .* after {used} tokens used \(max_tokens=900\)"):
        _cut_off_check(JsonOutputParser(), "JSON answer").invoke(message)
