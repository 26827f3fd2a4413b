"""Endpoint mode, ``ChatSpeculative(base_url=...)``, against ``selfspec serve`` on loopback.

The server runs the same demo engine as local mode, so every answer must be the local answer:
text, streamed text, tool calls, structured output, stop strings, seeded sampling and token
counts. Nothing is loaded locally, keys come from the field or the environment, and timeouts
and refusals surface as clear errors.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from selfspec import GenerationStats
from selfspec.errors import ConfigurationError

from langchain_selfspec import ChatSpeculative

MAX_TOKENS = 16
QUESTIONS = ["Tell me about Elizabeth Bennet.", "Hello!"]


@tool
def get_weather(location: str) -> str:
    """Get the weather at a location."""
    return "It's sunny."


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


@pytest.fixture(scope="module")
def remote(selfspec_server: dict[str, str]) -> ChatSpeculative:
    return ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS, **selfspec_server)


@pytest.fixture(scope="module")
def local(demo_engine: Any) -> ChatSpeculative:
    return ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS)


def joined(chunks: list[Any]) -> Any:
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    return full


def test_answers_equal_local_mode_sync_async_and_streamed(remote: ChatSpeculative, local: ChatSpeculative) -> None:
    for question in QUESTIONS:
        expected = local.invoke(question)
        answer = remote.invoke(question)
        assert answer.content == expected.content and answer.content
        assert answer.usage_metadata == expected.usage_metadata
        assert answer.response_metadata["model_name"] == "selfspec-demo"
        assert answer.response_metadata["finish_reason"] == expected.response_metadata["finish_reason"]
        assert set(GenerationStats().to_dict()) <= set(answer.response_metadata)  # the server's statistics
        chunks = list(remote.stream(question))
        assert "".join(c.text for c in chunks) == expected.content
        assert [c.usage_metadata is not None for c in chunks].count(True) == 1
        assert joined(chunks).usage_metadata == expected.usage_metadata

    async def both() -> tuple[Any, str]:
        answer = await remote.ainvoke(QUESTIONS[0])
        streamed = "".join([c.text async for c in remote.astream(QUESTIONS[0])])
        return answer, streamed

    answer, streamed = asyncio.run(both())
    assert answer.content == streamed == local.invoke(QUESTIONS[0]).content


def test_stop_and_seeded_sampling_equal_local_mode(remote: ChatSpeculative, local: ChatSpeculative) -> None:
    full = str(local.invoke(QUESTIONS[0]).content)
    stop = full.split()[2]
    expected = local.invoke(QUESTIONS[0], stop=[stop]).content
    assert expected == full[: full.find(stop)] and stop not in expected
    assert remote.invoke(QUESTIONS[0], stop=[stop]).content == expected
    assert "".join(c.text for c in remote.stream(QUESTIONS[0], stop=[stop])) == expected
    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 11}
    assert remote.invoke("Tell me a story.", **options).content == local.invoke("Tell me a story.", **options).content


def test_tools_round_trip_and_structured_output_equal_local_mode(
    remote: ChatSpeculative, local: ChatSpeculative
) -> None:
    question = HumanMessage("What is the weather in Paris?")
    calls = {}
    for name, llm in (("local", local), ("remote", remote)):
        forced = llm.bind_tools([get_weather], tool_choice="get_weather", max_tokens=40)
        message = forced.invoke([question])
        assert isinstance(message, AIMessage) and message.content == ""
        [call] = message.tool_calls
        streamed = joined(list(forced.stream([question])))
        assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
        result = get_weather.invoke(call)
        assert isinstance(result, ToolMessage)
        answer = llm.bind_tools([get_weather]).invoke([question, message, result])
        calls[name] = (call["name"], call["args"], answer.content)
    assert calls["remote"] == calls["local"]
    assert calls["remote"][0] == "get_weather" and set(calls["remote"][1]) == {"location"}

    for method in ("function_calling", "json_schema"):
        expected = local.with_structured_output(Joke, method=method).bind(max_tokens=60)
        got = remote.with_structured_output(Joke, method=method).bind(max_tokens=60)
        assert got.invoke("Tell me a joke about cats.") == expected.invoke("Tell me a joke about cats.")


def test_optional_tool_calls_constrained_or_not_as_in_local_mode(selfspec_server: dict[str, str]) -> None:
    """``constrain_tool_calls`` reaches the server (tools offered, ``tool_choice="auto"``).

    On this question the demo model, unconstrained, calls ``get_weather`` with a ``city``
    argument its schema does not have; under the tools' grammar it writes ``location``.
    """
    question = "What is the weather in San Francisco, CA?"
    arguments = {}
    for constrain in (True, False):
        local = ChatSpeculative(model="selfspec-demo", max_tokens=40, constrain_tool_calls=constrain)
        remote = ChatSpeculative(
            model="selfspec-demo", max_tokens=40, constrain_tool_calls=constrain, **selfspec_server
        )
        expected = local.bind_tools([get_weather]).invoke(question)
        got = remote.bind_tools([get_weather]).invoke(question)
        assert got.content == expected.content
        assert [(c["name"], c["args"]) for c in got.tool_calls] == [(c["name"], c["args"]) for c in expected.tool_calls]
        [call] = got.tool_calls
        arguments[constrain] = set(call["args"])
    assert arguments == {True: {"location"}, False: {"city"}}


def test_cut_off_tool_call_is_an_invalid_tool_call_in_both_modes(
    remote: ChatSpeculative, local: ChatSpeculative
) -> None:
    """A call cut by ``max_tokens`` is malformed: reported in ``invalid_tool_calls``, no crash."""
    question = "What is the weather in Paris?"
    for llm in (local, remote):
        message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question, max_tokens=14)
        assert message.tool_calls == []
        [bad] = message.invalid_tool_calls
        assert bad["name"] == "get_weather" and bad["error"]
        assert message.response_metadata["finish_reason"] == "length"
    assert remote.invoke(QUESTIONS[1]).content == local.invoke(QUESTIONS[1]).content  # the next call is fine


def test_no_local_engine_is_loaded(selfspec_server: dict[str, str]) -> None:
    from selfspec.serving import engines as registry

    before = dict(registry._ENGINES)
    llm = ChatSpeculative(model="selfspec-demo", exit_layer=3, num_draft_tokens=2, max_tokens=4, **selfspec_server)
    assert llm.invoke("Hello!").content
    assert registry._ENGINES == before  # these engine arguments would have loaded a second engine
    with pytest.raises(ConfigurationError, match="no local engine"):
        llm.get_engine()
    assert "base_url" in llm._identifying_params


def test_token_counting_uses_the_models_tokenizer(remote: ChatSpeculative, local: ChatSpeculative) -> None:
    messages = [HumanMessage("Hello!")]
    assert remote.get_num_tokens_from_messages(messages) == local.get_num_tokens_from_messages(messages)
    assert remote.get_num_tokens_from_messages(messages) == remote.invoke(messages).usage_metadata["input_tokens"]  # type: ignore[index]
    assert remote.get_token_ids("Hello there") == local.get_token_ids("Hello there")


def test_api_key_from_field_or_environment(selfspec_server: dict[str, str], monkeypatch: Any) -> None:
    base_url, key = selfspec_server["base_url"], selfspec_server["api_key"]
    monkeypatch.delenv("SELFSPEC_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    assert ChatSpeculative(base_url=base_url, max_tokens=2).invoke("Hi").content is not None
    monkeypatch.setenv("SELFSPEC_API_KEY", key)  # read first
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    assert ChatSpeculative(base_url=base_url, max_tokens=2).invoke("Hi").usage_metadata is not None
    with pytest.raises(openai.AuthenticationError):
        ChatSpeculative(base_url=base_url, api_key="wrong", max_tokens=2, max_retries=0).invoke("Hi")
    assert "wrong" not in repr(ChatSpeculative(base_url=base_url, api_key="wrong"))


def test_timeout(selfspec_server: dict[str, str]) -> None:
    slow = ChatSpeculative(model="selfspec-demo", max_tokens=1000, timeout=0.05, max_retries=0, **selfspec_server)
    with pytest.raises(openai.APITimeoutError):
        slow.invoke(QUESTIONS[0])


def test_unreachable_server_is_a_connection_error() -> None:
    dead = ChatSpeculative(base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=5)
    with pytest.raises(openai.APIConnectionError):
        dead.invoke("Hello!")
