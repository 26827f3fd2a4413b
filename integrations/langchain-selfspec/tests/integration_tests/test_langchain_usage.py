"""ChatSpeculative in LangChain programs on the demo model: the text is the engine's own.

An LCEL chain, ``batch`` with concurrency, streaming to a callback handler, async calls in
parallel, stop sequences that span tokens, a tool round trip, structured output, the
metadata names, and every example of the class docstring.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import textwrap
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from selfspec import GenerationStats

from langchain_selfspec import ChatSpeculative

MAX_TOKENS = 40
SYSTEM = "You are a helpful assistant."
QUESTIONS = ["What is the capital of France?", "Tell me about Elizabeth Bennet.", "Hello!", "Who is Mr. Darcy?"]


@pytest.fixture(scope="module")
def llm(demo_engine: Any) -> ChatSpeculative:
    return ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS)


def engine_text(engine: Any, question: str, **kwargs: Any) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return str(engine.generate(messages, max_new_tokens=MAX_TOKENS, **kwargs).text)


class TokenCollector(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
        self.tokens.append(token)


def test_lcel_chain_text_is_the_engines_greedy_text(llm: ChatSpeculative, demo_engine: Any) -> None:
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    chain = prompt | llm | StrOutputParser()
    for question in QUESTIONS[:2]:
        assert chain.invoke({"question": question}) == engine_text(demo_engine, question)


def test_batch_with_concurrency(llm: ChatSpeculative, demo_engine: Any) -> None:
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    chain = prompt | llm | StrOutputParser()
    answers = chain.batch([{"question": q} for q in QUESTIONS], config={"max_concurrency": 4})
    assert answers == [engine_text(demo_engine, q) for q in QUESTIONS]


def test_streaming_to_a_callback_handler(demo_engine: Any) -> None:
    handler = TokenCollector()
    streaming = ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS, streaming=True, callbacks=[handler])
    message = streaming.invoke([("system", SYSTEM), ("human", QUESTIONS[1])])
    expected = engine_text(demo_engine, QUESTIONS[1])
    assert message.content == expected
    assert "".join(handler.tokens) == expected and len([t for t in handler.tokens if t]) > 3
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] > 0
    # stream() calls the handler too, with the same text
    handler.tokens.clear()
    chunks = list(ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS).stream(
        [("system", SYSTEM), ("human", QUESTIONS[1])], config={"callbacks": [handler]}))
    assert "".join(c.text for c in chunks) == expected == "".join(handler.tokens)
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1


async def test_async_calls_in_parallel_each_get_their_own_text(llm: ChatSpeculative, demo_engine: Any) -> None:
    prompts = [[("system", SYSTEM), ("human", q)] for q in QUESTIONS]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())

    async def streamed(messages: Any) -> str:
        return "".join([chunk.text async for chunk in llm.astream(messages)])

    results = await asyncio.gather(*(llm.ainvoke(p) for p in prompts), *(streamed(p) for p in prompts))
    task.cancel()
    expected = [engine_text(demo_engine, q) for q in QUESTIONS]
    assert [r.content for r in results[:4]] == expected
    assert list(results[4:]) == expected
    assert ticks > 10  # the event loop kept running while the engine worked


def test_stop_sequences_spanning_tokens(llm: ChatSpeculative, demo_engine: Any) -> None:
    question = QUESTIONS[1]
    full = engine_text(demo_engine, question)
    tokenizer = demo_engine.tokenizer
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tokenizer.decode([t]) for t in tokenizer(full, add_special_tokens=False)["input_ids"]]
    offsets, position = [], 0
    for piece in pieces:
        offsets.append((position, position + len(piece)))
        position += len(piece)
    index = next(i for i, (start, end) in enumerate(offsets) if i > 2 and end - start >= 2
                 and offsets[i + 1][1] - offsets[i + 1][0] >= 2)
    stop = full[offsets[index][0] + 1 : offsets[index + 1][0] + 1]
    assert len(stop) >= 2 and full.find(stop) == offsets[index][0] + 1
    expected = full[: full.find(stop)]
    messages = [("system", SYSTEM), ("human", question)]
    assert llm.invoke(messages, stop=[stop]).content == expected
    assert "".join(c.text for c in llm.stream(messages, stop=[stop])) == expected
    at_init = ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS, stop=[stop])
    assert at_init.invoke(messages).content == expected
    # a call's own stop replaces the one given at init
    assert at_init.invoke(messages, stop=["\x00never"]).content == full


def test_metadata_names(llm: ChatSpeculative) -> None:
    message = llm.invoke("Hello!")
    metadata = message.response_metadata
    assert metadata["model_name"] == "selfspec-demo"
    assert metadata["finish_reason"] in ("stop", "length")
    assert set(GenerationStats().to_dict()) <= set(metadata)
    usage = message.usage_metadata
    assert usage is not None
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] == llm.get_num_tokens_from_messages([HumanMessage("Hello!")])


def test_tool_round_trip_and_per_call_overrides(llm: ChatSpeculative) -> None:
    @tool
    def get_weather(location: str) -> str:
        """Get the weather at a location."""
        return "It's sunny."

    with_tools = llm.bind_tools([get_weather])
    question = HumanMessage("What is the weather in Paris?")
    call_message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    assert isinstance(call_message, AIMessage)
    assert [c["name"] for c in call_message.tool_calls] == ["get_weather"]
    assert set(call_message.tool_calls[0]["args"]) == {"location"}
    result = get_weather.invoke(call_message.tool_calls[0])
    assert isinstance(result, ToolMessage)
    answer = with_tools.invoke([question, call_message, result])
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    # sampling per call, reproducible with a seed (also with the adaptive draft length)
    first = llm.invoke("Tell me a story.", temperature=1.0, seed=7, max_tokens=12)
    llm.invoke("Tell me about Bath.", max_tokens=12)  # the engine's state moves on in between
    again = llm.invoke("Tell me a story.", temperature=1.0, seed=7, max_tokens=12)
    assert first.content == again.content and first.usage_metadata["output_tokens"] <= 12  # type: ignore[index]


def test_forced_tool_call_streams_chunks(llm: ChatSpeculative) -> None:
    @tool
    def magic_function(input: int) -> int:
        """Apply a magic function to an input."""
        return input + 2

    forced = llm.bind_tools([magic_function], tool_choice="magic_function")
    question = "What is the value of magic_function(3)? Use the tool."
    chunks = list(forced.stream(question))
    pieces = [c for c in chunks if c.tool_call_chunks]
    assert pieces and pieces[0].tool_call_chunks[0]["name"] == "magic_function"
    assert len(pieces) > 1  # the arguments arrive while they are generated
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    invoked = forced.invoke(question)
    [call] = full.tool_calls
    assert call["name"] == "magic_function" and isinstance(call["args"]["input"], int)
    assert [(c["name"], c["args"]) for c in invoked.tool_calls] == [(call["name"], call["args"])]
    assert full.content == invoked.content == ""


def test_structured_output_methods(llm: ChatSpeculative) -> None:
    class Joke(BaseModel):
        """Joke to tell user."""

        setup: str = Field(description="question to set up a joke")
        punchline: str = Field(description="answer to resolve the joke")

    for method in ("function_calling", "json_schema"):
        joke = llm.with_structured_output(Joke, method=method).invoke("Tell me a joke about cats.")
        assert isinstance(joke, Joke) and joke.setup
    raw = llm.with_structured_output(Joke, method="json_mode", include_raw=True).invoke(
        "Tell me a joke about cats. Respond in JSON with keys setup and punchline.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Joke)
    json.loads(raw["raw"].content)


def python_blocks(doc: str) -> list[str]:
    """The ``.. code-block:: python`` blocks of a docstring, dedented."""
    blocks: list[str] = []
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == ".. code-block:: python":
            indent = len(lines[i]) - len(lines[i].lstrip())
            body = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            blocks.append(textwrap.dedent("\n".join(body)))
        else:
            i += 1
    return blocks


def test_class_docstring_examples_run(demo_engine: Any, capsys: Any) -> None:
    """Every ``code-block:: python`` of the class docstring runs, in order, on the demo model."""
    blocks = python_blocks(ChatSpeculative.__doc__ or "")
    assert len(blocks) == 8  # Instantiate, Invoke, Stream, Async, Tool calling, Structured output, metadata x2
    namespace: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, "<ChatSpeculative docstring>", "exec"), namespace)
    assert namespace["ai_msg"].usage_metadata
    assert namespace["full"].content
    assert capsys.readouterr().out
