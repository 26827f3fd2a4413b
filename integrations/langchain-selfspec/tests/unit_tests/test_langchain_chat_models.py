"""Standard unit tests plus the adapter's own model-free unit tests (no weights are loaded)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field
from selfspec.serving.requests import aiterate as _iterate_in_thread
from selfspec.serving.requests import normalize_tool_choice as _normalize_tool_choice
from selfspec.serving.requests import response_schema as _response_schema
from selfspec.serving.tools import ContentDelta, ToolCallChunk

from langchain_selfspec import ChatSpeculative
from langchain_selfspec.chat_models import _chunk, to_engine_messages


class TestChatSpeculativeUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "selfspec-demo"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        # endpoint mode's key comes from $SELFSPEC_API_KEY (then $OPENAI_API_KEY)
        return {"SELFSPEC_API_KEY": "secret-from-env"}, {"base_url": "http://127.0.0.1:9/v1"}, {
            "api_key": "secret-from-env"
        }


def test_construction_loads_nothing() -> None:
    from selfspec.serving import engines as registry

    before = dict(registry._ENGINES)
    started = time.perf_counter()
    for _ in range(100):
        ChatSpeculative(model="no/such-model-is-loaded", temperature=0.5, max_tokens=8)
    assert time.perf_counter() - started < 2.0
    assert registry._ENGINES == before


def test_every_engine_argument_is_a_field() -> None:
    from selfspec import EngineOptions  # the one declaration (from_pretrained's parameters are pinned to it)

    engine_args = set(EngineOptions.names())
    assert engine_args <= set(ChatSpeculative.model_fields), engine_args - set(ChatSpeculative.model_fields)
    assert set(ChatSpeculative()._engine_args()) <= engine_args
    assert ChatSpeculative(draft_model="small/model")._engine_args()["draft_model"] == "small/model"
    assert ChatSpeculative(drafter="medusa", medusa_heads="heads/")._engine_args()["medusa_heads"] == "heads/"
    for name in ChatSpeculative.__annotations__:
        if name != "model_config" and not name.startswith("_"):
            assert ChatSpeculative.model_fields[name].description, f"field {name} has no attribute docstring"


def test_ls_params_honour_overrides() -> None:
    llm = ChatSpeculative(temperature=0.3, max_tokens=12, stop=["x"])
    params = llm._get_ls_params()
    assert params == {"ls_provider": "selfspec", "ls_model_name": "selfspec-demo", "ls_model_type": "chat",
                      "ls_temperature": 0.3, "ls_max_tokens": 12, "ls_stop": ["x"]}
    params = llm._get_ls_params(stop=["y"], model="other", temperature=0.0, max_tokens=3)
    assert (params["ls_model_name"], params["ls_stop"], params["ls_temperature"], params["ls_max_tokens"]) == (
        "other", ["y"], 0.0, 3)


def test_messages_render_in_the_chat_template_form() -> None:
    messages = [
        SystemMessage("Be brief."),
        HumanMessage([{"type": "text", "text": "What is 1 + 2"}]),
        AIMessage(
            [{"type": "text", "text": "some text"},
             {"type": "tool_use", "id": "abc123", "name": "my_adder_tool", "input": {"a": 1, "b": 2}}],
            tool_calls=[{"name": "my_adder_tool", "args": {"a": 1, "b": 2}, "id": "abc123", "type": "tool_call"}],
        ),
        ToolMessage('{"result": 3}', name="my_adder_tool", tool_call_id="abc123"),
        ChatMessage(role="user", content="Thanks"),
    ]
    assert to_engine_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 1 + 2"},
        {"role": "assistant", "content": "some text", "tool_calls": [
            {"type": "function", "id": "abc123", "function": {"name": "my_adder_tool", "arguments": {"a": 1, "b": 2}}}
        ]},
        {"role": "tool", "content": '{"result": 3}', "tool_call_id": "abc123", "name": "my_adder_tool"},
        {"role": "user", "content": "Thanks"},
    ]


def test_non_text_content_is_refused() -> None:
    image = HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}])
    with pytest.raises(ValueError, match="text only"):
        to_engine_messages([image])


def test_tool_choice_forms() -> None:
    names = ["magic_function", "get_weather"]
    assert _normalize_tool_choice(None, names) == "auto"
    assert _normalize_tool_choice("auto", names) == "auto"
    assert _normalize_tool_choice("none", names) == "none"
    for forced in ("any", "required", True):
        assert _normalize_tool_choice(forced, names) == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _normalize_tool_choice("get_weather", names) == named
    assert _normalize_tool_choice(named, names) == named
    assert _normalize_tool_choice({"name": "get_weather"}, names) == named
    with pytest.raises(ValueError, match="not one of the tools"):
        _normalize_tool_choice("nope", names)
    with pytest.raises(ValueError, match="at least one tool"):
        _normalize_tool_choice("any", [])


def test_bind_tools_normalises_and_validates() -> None:
    class Person(BaseModel):
        """A person."""

        name: str = Field(description="The name.")

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    bound = ChatSpeculative().bind_tools([Person, add], tool_choice="add")
    tools = bound.kwargs["tools"]  # type: ignore[attr-defined]
    assert [t["function"]["name"] for t in tools] == ["Person", "add"]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in tools)
    assert bound.kwargs["tool_choice"] == {"type": "function", "function": {"name": "add"}}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="invalid tool name"):
        ChatSpeculative().bind_tools([{"name": "bad name", "parameters": {"type": "object", "properties": {}}}])


def test_structured_output_wiring() -> None:
    class Joke(BaseModel):
        """Joke to tell user."""

        setup: str

    llm = ChatSpeculative()
    for method in ("function_calling", "json_schema", "json_mode"):
        assert llm.with_structured_output(Joke, method=method) is not None
        assert llm.with_structured_output(Joke.model_json_schema(), method=method, include_raw=True) is not None
    with pytest.raises(ValueError, match="unknown method"):
        llm.with_structured_output(Joke, method="xml")  # type: ignore[arg-type]
    assert _response_schema({"type": "json_object"}) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _response_schema({"type": "json_schema", "schema": schema}) == schema
    assert _response_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == schema
    assert _response_schema({"type": "text"}) is None
    assert _response_schema({"type": "json_object", "schema": schema}) == schema  # json_mode with a schema
    with pytest.raises(ValueError, match="response_format"):
        _response_schema({"type": "xml"})


def test_unknown_call_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown argument 'frequency_penalty'"):
        ChatSpeculative(model="no/such-model")._plan([HumanMessage("hi")], None, {"frequency_penalty": 1.0})


def test_a_calls_options_are_the_planners_declaration() -> None:
    """Local and endpoint mode read one RequestOptions: the call's arguments over the fields."""
    from selfspec.serving.requests import RequestOptions

    llm = ChatSpeculative(model="m", temperature=0.3, stop=["a"], truncate_prompt=True, escape_special_tokens=True)
    options = llm._request_options(None, {"seed": 2, "max_tokens": 9, "parallel_tool_calls": False})
    assert options == RequestOptions(
        max_tokens=9,
        temperature=0.3,
        seed=2,
        stop=["a"],
        truncate_prompt=True,
        parallel_tool_calls=False,
        escape_special_tokens=True,
    )
    assert llm._request_options(["b"], {"temperature": 0.0}).stop == ["b"]  # stop= wins over the field
    body = ChatSpeculative(model="m", base_url="http://127.0.0.1:9/v1")._endpoint_body(
        [HumanMessage("hi")], None, {"max_tokens": 4}
    )
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("m", 4, 0.0)


def test_chunks_are_built_in_one_place() -> None:
    text = _chunk(ContentDelta("Hello")).message
    assert text.content == "Hello" and text.usage_metadata is None and not text.response_metadata
    piece = _chunk(ToolCallChunk(0, "add", "", "call_1")).message
    assert piece.tool_call_chunks == [
        {"name": "add", "args": "", "id": "call_1", "index": 0, "type": "tool_call_chunk"}
    ]


def test_iterate_in_thread_never_blocks_the_loop_and_closes_early() -> None:
    closed = threading.Event()
    loop_thread = threading.get_ident()
    seen_threads: set[int] = set()

    def slow() -> Iterator[int]:
        try:
            for i in range(100):
                seen_threads.add(threading.get_ident())
                time.sleep(0.02)
                yield i
        finally:
            closed.set()

    async def main() -> tuple[list[int], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        task = asyncio.create_task(ticker())
        got = []
        iterator = _iterate_in_thread(slow)
        async for item in iterator:
            got.append(item)
            if len(got) == 5:
                break
        await iterator.aclose()
        task.cancel()
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == [0, 1, 2, 3, 4]
    assert ticks >= 5  # the loop kept running while the iterator slept
    assert closed.wait(2.0)  # the abandoned iterator was closed in its own thread
    assert loop_thread not in seen_threads


def test_iterate_in_thread_propagates_errors() -> None:
    def failing() -> Iterator[int]:
        yield 1
        raise KeyError("boom")

    async def main() -> list[int]:
        return [item async for item in _iterate_in_thread(failing)]

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(main())
