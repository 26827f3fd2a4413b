"""Endpoint mode, ``SpeculativeLLM(base_url=...)``, against ``selfspec serve`` on loopback.

The server runs the same demo engine as local mode, so every response must be the local one:
text (chat, completion, raw prompt), streamed deltas, async paths, token counts, tool calls
and structured output. Nothing is loaded locally.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel
from selfspec import GenerationStats
from selfspec.errors import ConfigurationError

from llama_index.llms.selfspec import SpeculativeLLM

MAX_NEW_TOKENS = 16
MESSAGES = [ChatMessage(role="user", content="Tell me about Longbourn.")]


def multiply(x: int, y: int) -> int:
    """Multiply two integers."""
    return x * y


class City(BaseModel):
    """A city."""

    name: str
    country: str


@pytest.fixture(scope="module")
def remote(selfspec_server):
    return SpeculativeLLM(model="selfspec-demo", max_new_tokens=MAX_NEW_TOKENS, **selfspec_server)


@pytest.fixture(scope="module")
def local(demo_llm):
    return SpeculativeLLM(model="selfspec-demo", max_new_tokens=MAX_NEW_TOKENS)


def test_responses_equal_local_mode(remote, local) -> None:
    expected = local.chat(MESSAGES)
    got = remote.chat(MESSAGES)
    assert got.message.content == expected.message.content and got.message.content
    assert got.raw["usage"] == expected.raw["usage"]
    assert got.raw["finish_reason"] == expected.raw["finish_reason"] == "length"
    assert set(GenerationStats().to_dict()) <= set(got.raw)  # the server's statistics
    assert got.additional_kwargs["completion_tokens"] == MAX_NEW_TOKENS

    streamed = list(remote.stream_chat(MESSAGES))
    assert "".join(r.delta for r in streamed) == streamed[-1].message.content == expected.message.content
    assert streamed[-1].raw["usage"] == expected.raw["usage"]
    assert all(not r.raw for r in streamed[:-1])

    assert remote.complete("Who is Mr. Darcy?").text == local.complete("Who is Mr. Darcy?").text
    assert remote.complete("It is a truth", formatted=True).text == local.complete("It is a truth", formatted=True).text
    chunks = list(remote.stream_complete("Who is Mr. Darcy?"))
    assert chunks[-1].text == "".join(c.delta for c in chunks) == local.complete("Who is Mr. Darcy?").text
    assert chunks[-1].raw["usage"] == local.complete("Who is Mr. Darcy?").raw["usage"]


def test_async_paths_equal_local_mode(remote, local) -> None:
    async def run():
        chat = await remote.achat(MESSAGES)
        stream = await remote.astream_chat(MESSAGES)
        streamed = [r async for r in stream]
        completion = await remote.acomplete("Who is Mr. Darcy?")
        cstream = await remote.astream_complete("Who is Mr. Darcy?")
        cstreamed = [r async for r in cstream]
        return chat, streamed, completion, cstreamed

    chat, streamed, completion, cstreamed = asyncio.run(run())
    expected = local.chat(MESSAGES).message.content
    assert chat.message.content == streamed[-1].message.content == "".join(r.delta for r in streamed) == expected
    assert completion.text == cstreamed[-1].text == local.complete("Who is Mr. Darcy?").text
    assert streamed[-1].raw["usage"] == chat.raw["usage"]


def test_tools_and_structured_output_equal_local_mode(remote, local) -> None:
    tool = FunctionTool.from_defaults(fn=multiply)
    picked = {}
    for name, llm in (("local", local), ("remote", remote)):
        response = llm.chat_with_tools([tool], user_msg="Multiply 3 and 5.", tool_required=True, max_new_tokens=40)
        [selection] = llm.get_tool_calls_from_response(response)
        picked[name] = (selection.tool_name, selection.tool_kwargs)
    assert picked["remote"] == picked["local"] and picked["remote"][0] == "multiply"

    prompt = PromptTemplate("Name a city in {country}.")
    assert remote.structured_predict(City, prompt, country="France", llm_kwargs={"max_new_tokens": 40}) == (
        local.structured_predict(City, prompt, country="France", llm_kwargs={"max_new_tokens": 40})
    )


def test_cut_off_tool_call_is_reported_as_invalid(remote, local) -> None:
    tool = FunctionTool.from_defaults(fn=multiply)
    for llm in (local, remote):
        response = llm.chat_with_tools([tool], user_msg="Multiply 3 and 5.", tool_required=True, max_new_tokens=12)
        assert not response.message.additional_kwargs.get("tool_calls")
        [bad] = response.message.additional_kwargs["invalid_tool_calls"]
        assert bad["name"] == "multiply" and bad["error"]
        with pytest.raises(ValueError, match="malformed tool calls"):
            llm.get_tool_calls_from_response(response)
    assert remote.chat(MESSAGES).message.content == local.chat(MESSAGES).message.content


def test_no_local_engine_and_metadata(selfspec_server) -> None:
    from selfspec.serving import engines as registry

    before = dict(registry._ENGINES)
    llm = SpeculativeLLM(model="selfspec-demo", exit_layer=3, max_new_tokens=4, **selfspec_server)
    assert llm.complete("Hello!").text
    assert registry._ENGINES == before
    with pytest.raises(ConfigurationError, match="no local engine"):
        _ = llm.engine
    assert llm.metadata.context_window == 2048  # read from the model's config, no weights
    assert "base_url=" in repr(llm) and selfspec_server["api_key"] not in repr(llm)
    assert "api_key" not in llm.to_dict()
    elsewhere = SpeculativeLLM(model="org/served-elsewhere", base_url=selfspec_server["base_url"])
    assert elsewhere.metadata.context_window > 0  # no config here: LlamaIndex's default


def test_api_key_from_environment_and_refusals(selfspec_server, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_API_KEY", selfspec_server["api_key"])
    llm = SpeculativeLLM(base_url=selfspec_server["base_url"], max_new_tokens=2)
    assert llm.complete("Hi").raw["usage"]["completion_tokens"] <= 2
    monkeypatch.delenv("SELFSPEC_API_KEY")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(openai.AuthenticationError):
        SpeculativeLLM(base_url=selfspec_server["base_url"], max_retries=0).complete("Hi")
    slow = SpeculativeLLM(model="selfspec-demo", max_new_tokens=1000, timeout=0.05, max_retries=0, **selfspec_server)
    with pytest.raises(openai.APITimeoutError):
        slow.complete("Tell me a long story.")
