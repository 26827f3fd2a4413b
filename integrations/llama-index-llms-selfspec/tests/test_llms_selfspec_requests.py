"""SpeculativeLLM on the request planner: arguments, streamed structured output and tool calls, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.program.utils import FlexibleModel
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.core.types import PydanticProgramMode
from pydantic import BaseModel, Field

from llama_index.llms.selfspec import SpeculativeLLM


class Person(BaseModel):
    """A person and the city they live in."""

    name: str = Field(description="the person's name")
    city: str = Field(description="the city they live in")


def multiply(x: int, y: int) -> int:
    """Multiply two integers."""
    return x * y


@pytest.fixture(scope="module", params=["local", "endpoint"])
def llm(request: pytest.FixtureRequest, demo_llm: SpeculativeLLM) -> SpeculativeLLM:
    if request.param == "local":
        return demo_llm
    return SpeculativeLLM(model="selfspec-demo", max_new_tokens=demo_llm.max_new_tokens,
                          **request.getfixturevalue("selfspec_server"))


# ------------------------------------------------------------------------------- construction
def test_unknown_constructor_arguments_name_the_closest_field() -> None:
    with pytest.raises(ValueError, match=r"unknown argument 'temprature' \(did you mean 'temperature'\?\)"):
        SpeculativeLLM(model_name="foo", temprature=0.5)
    assert SpeculativeLLM(model_name="foo").model == "foo"
    with pytest.raises(ValueError, match=r"unknown argument 'max_new_token' .*'max_new_tokens'"):
        SpeculativeLLM(max_new_token=5)


def test_unknown_call_arguments_are_refused(demo_llm: SpeculativeLLM) -> None:
    with pytest.raises(ValueError, match="unknown argument 'temprature'"):
        demo_llm.complete("Hi", temprature=0.3)


# ------------------------------------------------------------------------------- structured output
@pytest.mark.parametrize("mode", [PydanticProgramMode.DEFAULT, PydanticProgramMode.FUNCTION])
def test_stream_structured_predict_streams_partial_objects(llm: SpeculativeLLM, mode: PydanticProgramMode) -> None:
    """Issue 19 item 1: the stream was 48 empty FlexiblePerson objects."""
    llm = llm.model_copy(update={"pydantic_program_mode": mode, "max_tokens": 80})
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}, who lives in {city}.")
    items = list(llm.stream_structured_predict(Person, prompt, name="Anne Elliot", city="Bath"))
    partial = [item for item in items[:-1] if isinstance(item, FlexibleModel)]
    assert any(item.name and not getattr(item, "city", None) for item in partial), items  # filled in as it came
    last = items[-1]
    final = last if isinstance(last, Person) else Person.model_validate(last.model_dump())
    assert final.name and final.city
    assert final == llm.structured_predict(Person, prompt, name="Anne Elliot", city="Bath")


def test_astream_structured_predict_streams_partial_objects(llm: SpeculativeLLM) -> None:
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}, who lives in {city}.")

    async def main() -> list[Any]:
        return [item async for item in await llm.astream_structured_predict(Person, prompt, name="Anne", city="Bath")]

    items = asyncio.run(main())
    assert len(items) > 2 and isinstance(items[-1], Person)
    assert items[-1] == llm.structured_predict(Person, prompt, name="Anne", city="Bath")


def test_structured_output_cut_by_the_budget_names_it(llm: SpeculativeLLM) -> None:
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}.")
    for name in ("max_tokens", "max_new_tokens"):  # the message names the budget as the call wrote it
        with pytest.raises(ValueError, match=rf"cut off at {name}=6 \(6 tokens used\).*raise {name} "):
            llm.structured_predict(Person, prompt, llm_kwargs={name: 6}, name="Anne")
        with pytest.raises(ValueError, match=rf"cut off at {name}=6"):
            list(llm.stream_structured_predict(Person, prompt, llm_kwargs={name: 6}, name="Anne"))


# ------------------------------------------------------------------------------- streamed tool calls
def test_tool_call_arguments_stream_in_the_responses(llm: SpeculativeLLM) -> None:
    tool = FunctionTool.from_defaults(fn=multiply)
    responses = list(llm.stream_chat_with_tools([tool], user_msg="Multiply 3 and 5.", tool_required=True))
    arguments = [
        r.message.additional_kwargs["tool_calls"][0]["function"]["arguments"]
        for r in responses[:-1]
        if r.message.additional_kwargs.get("tool_calls")
    ]
    assert len(arguments) > 2 and all(isinstance(a, str) for a in arguments)
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(arguments))  # growing
    [selection] = llm.get_tool_calls_from_response(responses[-1])
    assert json.loads(arguments[-1]) == selection.tool_kwargs and selection.tool_name == "multiply"
    # partial arguments are read as far as they are complete
    partial = [llm.get_tool_calls_from_response(r, error_on_no_tool_call=False) for r in responses[:-1]]
    assert all(p[0].tool_name == "multiply" for p in partial if p)
    assert any(p and p[0].tool_kwargs for p in partial)


# ------------------------------------------------------------------------------- cancellation (issue 18)
def _round_counter(llm: SpeculativeLLM) -> tuple[list[int], Any]:
    """Counts target forwards: one per round with prompt-lookup drafts (no draft forwards)."""
    calls: list[int] = []
    return calls, llm.engine.model.model.rotary_emb.register_forward_hook(lambda *args: calls.append(1))


@pytest.mark.parametrize("batching", [False, True])
@pytest.mark.parametrize("path", ["achat", "acomplete", "astream_chat", "astream_complete"])
def test_a_cancelled_call_stops_within_one_round(path: str, batching: bool) -> None:
    """Issue 18: a cancelled ``achat`` kept the engine going (30 -> 286 rounds in 3 s)."""
    llm = SpeculativeLLM(model="selfspec-demo", drafter="prompt_lookup", batching=batching, max_new_tokens=1500)
    calls, handle = _round_counter(llm)
    messages = [ChatMessage(role="user", content="Write a long story.")]

    async def call() -> Any:
        if path == "achat":
            return await llm.achat(messages)
        if path == "acomplete":
            return await llm.acomplete("Write a long story.")
        stream = await (llm.astream_chat(messages) if path == "astream_chat" else llm.astream_complete("Story:"))
        return [response async for response in stream]

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
        returned_after = time.perf_counter() - cancelled_at  # returns once the worker thread has stopped
    finally:
        handle.remove()
    after = len(calls) - at_cancel
    assert after <= 1, f"{after} rounds after the cancel"
    fresh = SpeculativeLLM(model="selfspec-demo", drafter="prompt_lookup", batching=batching, max_new_tokens=8)
    assert fresh.complete("Hello").text == fresh.complete("Hello").text  # the engine is still usable
    print(json.dumps({"path": path, "batching": batching, "rounds_after_cancel": after,
                      "seconds_to_return": round(returned_after, 3)}))


# ------------------------------------------------------------------------------- repetition (issue 19)
def test_a_json_loop_stopped_early_is_a_clear_value_error(demo_llm: SpeculativeLLM) -> None:
    """A call stopped on a loop inside a JSON string is reported as the cut-off is (a clear ValueError)."""
    from selfspec.serving.requests import plan_request

    from llama_index.llms.selfspec.base import _final_response, _local_answer, _validate_json

    class Text(BaseModel):
        text: str = Field(min_length=5000)  # keeps the grammar from ending the string

    plan = plan_request(demo_llm.engine, 'la la la la la la la la {"text": "la la la la la la la la',
                        json_schema=Text.model_json_schema(), max_tokens=900)
    response = _final_response("chat", _local_answer(plan, "selfspec-demo", plan.generate()))
    used = response.additional_kwargs["completion_tokens"]
    assert response.additional_kwargs["finish_reason"] == "repetition" and used < 600
    with pytest.raises(ValueError, match=rf"repetition .* after {used} tokens used \(max_tokens=900\)"):
        _validate_json(Text, response)
