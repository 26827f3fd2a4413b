"""SpeculativeLLM on the bundled demo model inside real LlamaIndex pipelines.

Every answer is checked against the engine's own greedy output for the exact messages LlamaIndex
sent (captured by an instrumentation handler): the adapter adds nothing and loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatStartEvent, LLMCompletionStartEvent
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field
from selfspec import GenerationStats

from llama_index.llms.selfspec import SpeculativeLLM
from llama_index.llms.selfspec.base import to_engine_messages

pytestmark = pytest.mark.slow

DOCUMENTS = [
    "Elizabeth Bennet lives at Longbourn with her mother, her father and her four sisters.",
    "Mr. Darcy owns Pemberley, a great estate in Derbyshire, and has ten thousand a year.",
    "Jane Bennet, the eldest sister, is admired by Mr. Bingley, who has taken Netherfield Park.",
    "Mr. Collins, a clergyman, is the cousin who will inherit Longbourn.",
]
STATS_KEYS = set(GenerationStats().to_dict())


class PromptRecorder(BaseEventHandler):
    """Records the messages of every chat call and the prompt of every completion call."""

    calls: list = Field(default_factory=list)

    def handle(self, event, **kwargs):
        if isinstance(event, LLMChatStartEvent):
            self.calls.append(("chat", list(event.messages)))
        elif isinstance(event, LLMCompletionStartEvent):
            self.calls.append(("complete", event.prompt))


@pytest.fixture(scope="module")
def recorder():
    handler = PromptRecorder()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture(scope="module")
def index(demo_llm):
    previous = Settings._llm, Settings._embed_model
    Settings.llm = demo_llm
    Settings.embed_model = MockEmbedding(embed_dim=8)
    yield VectorStoreIndex.from_documents([Document(text=text) for text in DOCUMENTS])
    Settings._llm, Settings._embed_model = previous


def engine_greedy(llm: SpeculativeLLM, messages: list[ChatMessage]) -> str:
    """What the engine alone writes for these messages (rendered by the chat template)."""
    plain = [{"role": m.role.value, "content": m.content or ""} for m in messages]
    return llm.engine.generate(plain, max_new_tokens=llm.max_new_tokens).text


def last_chat(recorder: PromptRecorder) -> list[ChatMessage]:
    kind, messages = recorder.calls[-1]
    assert kind == "chat"
    return messages


def check_response_metadata(response, llm: SpeculativeLLM) -> None:
    usage = response.raw["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert STATS_KEYS <= set(response.raw) and STATS_KEYS <= set(response.additional_kwargs)
    assert response.additional_kwargs["prompt_tokens"] == usage["prompt_tokens"]
    assert response.raw["target_forwards"] >= 1


# ----------------------------------------------------------------------------- plain calls
def test_metadata_reads_the_model_config(demo_llm):
    assert demo_llm.metadata.context_window == demo_llm.engine.context_window == 2048


def test_one_engine_shared_with_the_langchain_adapter(demo_llm):
    langchain_selfspec = pytest.importorskip("langchain_selfspec")
    assert langchain_selfspec.ChatSpeculative(model="selfspec-demo").get_engine() is demo_llm.engine


def test_chat_matches_engine_and_counts_tokens(demo_llm):
    counter = TokenCountingHandler()
    llm = SpeculativeLLM(
        model="selfspec-demo",
        max_new_tokens=demo_llm.max_new_tokens,
        callback_manager=CallbackManager([counter]),
    )
    messages = [ChatMessage(role=MessageRole.USER, content="Who is Mr. Darcy?")]
    response = llm.chat(messages)
    assert llm.engine is demo_llm.engine  # one shared engine
    assert response.message.content == engine_greedy(llm, messages)
    check_response_metadata(response, llm)
    assert counter.prompt_llm_token_count == response.raw["usage"]["prompt_tokens"]
    assert counter.completion_llm_token_count == response.raw["usage"]["completion_tokens"]


def test_sampling_with_a_seed_is_reproducible(demo_llm):
    texts = [demo_llm.complete("Tell me about Meryton.", temperature=0.9, seed=7).text for _ in range(2)]
    assert texts[0] == texts[1]


def test_stream_complete_is_cumulative(demo_llm):
    final = demo_llm.complete("Tell me about Longbourn.")
    chunks = list(demo_llm.stream_complete("Tell me about Longbourn."))
    deltas = [chunk.delta for chunk in chunks]
    assert all(deltas)
    assert [chunk.text for chunk in chunks] == ["".join(deltas[: i + 1]) for i in range(len(deltas))]
    assert chunks[-1].text == final.text
    assert chunks[-1].raw["usage"] == final.raw["usage"]
    assert STATS_KEYS <= set(chunks[-1].additional_kwargs)


@pytest.mark.asyncio
async def test_async_calls_do_not_block_the_event_loop(demo_llm):
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    demo_llm.engine  # noqa: B018 - loaded before timing
    task = asyncio.create_task(ticker())
    messages = [ChatMessage(role=MessageRole.USER, content="Who lives at Netherfield?")]
    started = time.perf_counter()
    response = await demo_llm.achat(messages)
    elapsed = time.perf_counter() - started
    chunks = [chunk async for chunk in await demo_llm.astream_chat(messages)]
    done.set()
    await task
    # the loop kept running while the model worked (blocked, it would tick about once)
    assert ticks >= max(5, 0.1 * elapsed / 0.005)
    assert chunks[-1].message.content == response.message.content == engine_greedy(demo_llm, messages)
    assert "".join(chunk.delta for chunk in chunks) == response.message.content
    assert chunks[-1].raw["usage"] == response.raw["usage"]


@pytest.mark.asyncio
async def test_abandoned_async_stream_is_closed(demo_llm):
    messages = [ChatMessage(role=MessageRole.USER, content="Tell me about Pemberley.")]
    stream = await demo_llm.astream_chat(messages)
    first = await anext(stream)
    await stream.aclose()  # abandoned mid-answer: the engine stays free for the next call
    assert first.delta
    response = await demo_llm.achat(messages)
    assert response.message.content.startswith(first.delta)


def test_streamed_token_counts(demo_llm):
    counter = TokenCountingHandler()
    llm = SpeculativeLLM(
        model="selfspec-demo",
        max_new_tokens=demo_llm.max_new_tokens,
        callback_manager=CallbackManager([counter]),
    )
    chunks = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content="Who is Mr. Bingley?")]))
    assert counter.prompt_llm_token_count == chunks[-1].raw["usage"]["prompt_tokens"]
    assert counter.completion_llm_token_count == chunks[-1].raw["usage"]["completion_tokens"]


@pytest.mark.asyncio
async def test_concurrent_achats_each_get_their_own_answer(demo_llm):
    questions = ["Who is Jane Bennet?", "What is Pemberley?"]
    conversations = [[ChatMessage(role=MessageRole.USER, content=q)] for q in questions]
    responses = await asyncio.gather(*(demo_llm.achat(messages) for messages in conversations))
    for messages, response in zip(conversations, responses, strict=True):
        assert response.message.content == engine_greedy(demo_llm, messages)


# ----------------------------------------------------------------------------- RAG
def test_query(index, demo_llm, recorder):
    response = index.as_query_engine(similarity_top_k=2).query("Where does Elizabeth live?")
    assert len(response.source_nodes) == 2
    messages = last_chat(recorder)
    assert response.response == engine_greedy(demo_llm, messages)
    # lossless end to end: plain decoding of the same messages writes the same answer
    plain = SpeculativeLLM(model="selfspec-demo", drafter="none", max_new_tokens=demo_llm.max_new_tokens)
    assert plain.chat(messages).message.content == response.response


@pytest.mark.asyncio
async def test_async_query(index, demo_llm, recorder):
    response = await index.as_query_engine(similarity_top_k=2).aquery("Who owns Pemberley?")
    assert response.response == engine_greedy(demo_llm, last_chat(recorder))


def test_streaming_query(index, demo_llm, recorder):
    response = index.as_query_engine(similarity_top_k=2, streaming=True).query("Who is Jane?")
    text = "".join(response.response_gen)
    assert text == engine_greedy(demo_llm, last_chat(recorder))


def test_condense_plus_context_chat_engine(index, demo_llm, recorder):
    chat_engine = index.as_chat_engine(chat_mode="condense_plus_context", similarity_top_k=2)
    first = chat_engine.chat("Who will inherit Longbourn?")
    assert first.response == engine_greedy(demo_llm, last_chat(recorder))
    second = chat_engine.chat("Is he a clergyman?")
    kinds = [kind for kind, _ in recorder.calls[-2:]]
    assert kinds == ["complete", "chat"]  # condense the question, then answer with context
    assert second.response == engine_greedy(demo_llm, last_chat(recorder))
    assert len(second.sources) == 1 and second.source_nodes


# ----------------------------------------------------------------------------- tools
def multiply(x: int, y: int) -> int:
    """Multiply two integers."""
    return x * y


# llama-index's workflow machinery inspects pydantic objects with deprecated attributes
@pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")
@pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince211")
@pytest.mark.asyncio
async def test_function_agent_calls_a_tool_then_answers(demo_llm, recorder):
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult

    from llama_index.llms.selfspec.base import to_engine_messages

    tool = FunctionTool.from_defaults(fn=multiply)
    # the tool call is forced on the first turn only; the demo model then answers on its own
    agent = FunctionAgent(tools=[tool], llm=demo_llm, initial_tool_choice="multiply")
    handler = agent.run(user_msg="What is 7 times 6?")
    results = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    response = await handler

    (result,) = results
    assert result.tool_name == "multiply"
    assert set(result.tool_kwargs) == {"x", "y"} and all(isinstance(v, int) for v in result.tool_kwargs.values())
    product = str(result.tool_kwargs["x"] * result.tool_kwargs["y"])
    assert result.tool_output.content == product  # the tool really ran on the model's arguments
    assert product in str(response)  # and the answer uses its result
    # the second turn saw the call and its result in the model's own template format
    prompt = demo_llm.engine.tokenizer.decode(
        demo_llm.engine.encode_prompt(to_engine_messages(last_chat(recorder)), tools=[tool.metadata.to_openai_tool()])
    )
    call = json.dumps({"name": "multiply", "arguments": result.tool_kwargs})
    assert f"<tool_call>{call}</tool_call><|im_end|>" in prompt
    assert f"<tool_response>{product}</tool_response>" in prompt


def test_forced_tool_call_is_well_formed(demo_llm):
    tool = FunctionTool.from_defaults(fn=multiply)
    response = demo_llm.chat_with_tools([tool], user_msg="Use multiply on 3 and 5.", tool_required=True)
    (selection,) = demo_llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "multiply"
    assert set(selection.tool_kwargs) == {"x", "y"}
    assert all(isinstance(v, int) for v in selection.tool_kwargs.values())


def test_optional_tool_calls_are_well_formed(demo_llm):
    tools = [FunctionTool.from_defaults(fn=multiply)]
    response = demo_llm.chat_with_tools(tools, user_msg="What is 7 times 6?", allow_parallel_tool_calls=True)
    # the model may answer in text or call tools; any call it makes follows the tools' grammar
    assert not response.message.additional_kwargs.get("invalid_tool_calls")
    for selection in demo_llm.get_tool_calls_from_response(response, error_on_no_tool_call=False):
        assert selection.tool_name == "multiply"
        assert set(selection.tool_kwargs) == {"x", "y"}
    messages = [ChatMessage(role="user", content="hi")]

    def constraint(llm, choice):
        options = llm._options({"tools": tools, "tool_choice": choice})
        return llm._plan(to_engine_messages(messages), options).constraint

    assert constraint(demo_llm, "auto") is not None
    unconstrained = SpeculativeLLM(model="selfspec-demo", constrain_tool_calls=False)
    assert constraint(unconstrained, "auto") is None
    assert constraint(unconstrained, "multiply") is not None


class Person(BaseModel):
    """A person and the city they live in."""

    name: str
    city: str


def test_structured_predict(demo_llm):
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}, who lives in {city}.")
    person = demo_llm.structured_predict(Person, prompt, name="Anne Elliot", city="Bath")
    assert isinstance(person, Person)
    assert person.name and person.city


@pytest.mark.asyncio
async def test_astructured_predict(demo_llm):
    prompt = PromptTemplate("Give me a JSON object with keys name and city for {name}, who lives in {city}.")
    person = await demo_llm.astructured_predict(Person, prompt, name="Emma Woodhouse", city="Highbury")
    assert isinstance(person, Person)


def test_class_docstring_example_runs(demo_llm, capsys):
    import re

    from llama_index.core import Settings

    (code,) = re.findall(r"```python\n(.*?)```", SpeculativeLLM.__doc__, re.S)
    previous = Settings._llm, Settings._embed_model
    try:
        exec(compile(textwrap.dedent(code), "SpeculativeLLM.__doc__", "exec"), {})
    finally:
        Settings._llm, Settings._embed_model = previous
    assert "prompt_tokens" in capsys.readouterr().out


def test_example_rag_app_runs(demo_llm, monkeypatch, capsys):
    import runpy
    from pathlib import Path

    from llama_index.core import Settings

    example = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_rag.py"
    monkeypatch.setattr("sys.argv", [str(example), "--max-new-tokens", "24", "--compare"])
    previous = Settings._llm, Settings._embed_model
    try:
        runpy.run_path(str(example), run_name="__main__")
    finally:
        Settings._llm, Settings._embed_model = previous
    out = capsys.readouterr().out
    assert "A: " in out and "speculation: " in out
    assert "same text: True" in out
