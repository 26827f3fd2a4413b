"""One request path (issue 25 item 5): every front door plans its calls in :mod:`selfspec.serving.requests`.

``selfspec serve``, ``ChatSpeculative`` and ``SpeculativeLLM`` (local and endpoint mode) hand each
call to :func:`~selfspec.serving.requests.plan_request`, so that they agree: a forced tool call
that runs away stops with the same ``repetition`` finish reason after the same tokens; a
``json_object`` format with a schema is honoured the same; every ``tool_choice`` spelling means
the same; token usage is the planner's :class:`~selfspec.serving.requests.TokenUsage`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from selfspec import SpeculativeEngine
from selfspec.serving.requests import RequestFieldError, TokenUsage, plan_request

MODEL = "selfspec-demo"
KEY = "one-path-key"

# A forced tool call that runs away on the demo model under greedy decoding: minLength keeps the
# grammar from ending the string, and the model loops inside it.
RUNAWAY_MESSAGES = [{"role": "user", "content": "la " * 30}]
RUNAWAY_TOOL = {
    "type": "function",
    "function": {
        "name": "sing",
        "description": "sing a song",
        "parameters": {
            "type": "object",
            "properties": {"song": {"type": "string", "minLength": 5000}},
            "required": ["song"],
        },
    },
}
BUDGET = 900

TOOL = {
    "type": "function",
    "function": {
        "name": "sing",
        "description": "sing a song",
        "parameters": {"type": "object", "properties": {"song": {"type": "string"}}, "required": ["song"]},
    },
}
MESSAGES = [{"role": "user", "content": "Sing a song about the sea"}]


@pytest.fixture(scope="module")
def root(demo_engine: SpeculativeEngine) -> Iterator[str]:
    """``selfspec serve`` on loopback over the demo engine."""
    pytest.importorskip("uvicorn")
    from selfspec.serving.server import serve_in_background

    with serve_in_background(demo_engine, model_id=MODEL, api_key=KEY) as url:
        yield url


def _post(root: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{root}/v1/chat/completions", json={"model": MODEL, **body}, headers=headers, timeout=300)


@pytest.fixture(scope="module")
def runaway(demo_engine: SpeculativeEngine) -> int:
    """The planner's own run of the runaway call: it stops on ``repetition``; the tokens it used."""
    plan = plan_request(
        demo_engine, RUNAWAY_MESSAGES, tools=[RUNAWAY_TOOL], tool_choice="sing", max_tokens=BUDGET, temperature=0.0
    )
    assert plan.guards_repetition
    output = plan.generate()
    assert plan.finish_reason(output) == "repetition" and plan.repetition
    used = TokenUsage.of(output).completion_tokens
    assert used < BUDGET * 0.6  # stopped early, the budget not spent
    return used


# ------------------------------------------------------------------------------- the runaway call
@pytest.mark.slow
def test_selfspec_serve_stops_the_runaway_call_on_repetition(root: str, runaway: int) -> None:
    body = {"messages": RUNAWAY_MESSAGES, "tools": [RUNAWAY_TOOL], "tool_choice": "sing", "max_tokens": BUDGET}
    whole = _post(root, {**body, "temperature": 0})
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["choices"][0]["finish_reason"] == "repetition"
    assert answer["usage"]["completion_tokens"] == runaway
    streamed = _post(root, {**body, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert reasons == ["repetition"]
    assert events[-1]["usage"]["completion_tokens"] == runaway
    metrics = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert 'selfspec_generations_total{finish_reason="repetition"}' in metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "endpoint"])
def test_langchain_stops_the_runaway_call_on_repetition(root: str, runaway: int, mode: str) -> None:
    pytest.importorskip("langchain_core")
    from langchain_selfspec import ChatSpeculative

    endpoint = {"base_url": f"{root}/v1", "api_key": KEY} if mode == "endpoint" else {}
    chat = ChatSpeculative(model=MODEL, temperature=0.0, max_tokens=BUDGET, **endpoint)
    bound = chat.bind_tools([RUNAWAY_TOOL], tool_choice="sing")
    message = bound.invoke(RUNAWAY_MESSAGES[0]["content"])
    assert message.response_metadata["finish_reason"] == "repetition"
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] == runaway
    chunks = list(bound.stream(RUNAWAY_MESSAGES[0]["content"]))
    last = chunks[-1].message if hasattr(chunks[-1], "message") else chunks[-1]
    assert last.response_metadata["finish_reason"] == "repetition"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["local", "endpoint"])
def test_llamaindex_stops_the_runaway_call_on_repetition(root: str, runaway: int, mode: str) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.selfspec import SpeculativeLLM

    endpoint = {"base_url": f"{root}/v1", "api_key": KEY} if mode == "endpoint" else {}
    llm = SpeculativeLLM(model=MODEL, temperature=0.0, max_new_tokens=BUDGET, **endpoint)
    messages = [ChatMessage(role="user", content=RUNAWAY_MESSAGES[0]["content"])]
    response = llm.chat(messages, tools=[RUNAWAY_TOOL], tool_choice="sing")
    assert response.additional_kwargs["finish_reason"] == "repetition"
    assert response.additional_kwargs["completion_tokens"] == runaway
    *_, last = llm.stream_chat(messages, tools=[RUNAWAY_TOOL], tool_choice="sing")
    assert last.additional_kwargs["finish_reason"] == "repetition"


# ------------------------------------------------------------------------------- json_object with a schema
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object", "schema": ANSWER_SCHEMA},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        {"type": "json_object"},
    ],
    ids=["json_object+schema", "json_schema", "json_object"],
)
def test_response_format_means_the_same_through_the_planner_and_the_server(
    demo_engine: SpeculativeEngine, root: str, response_format: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "Is the sea blue? Answer yes or no."}]
    plan = plan_request(demo_engine, messages, response_format=response_format, max_tokens=40, temperature=0.0)
    planned = plan.generate()
    served = _post(root, {"messages": messages, "response_format": response_format, "max_tokens": 40, "temperature": 0})
    assert served.status_code == 200, served.text
    body = served.json()
    assert body["choices"][0]["message"]["content"] == planned.text
    assert body["usage"] == TokenUsage.of(planned).openai()
    if "schema" in response_format or "json_schema" in response_format:
        assert plan.constraint is not None and plan.constraint.schema == ANSWER_SCHEMA  # the schema is honoured
        if plan.finish_reason(planned) == "stop":
            assert json.loads(planned.text)["answer"] in ("yes", "no")


def test_a_bad_response_format_is_refused_alike(demo_engine: SpeculativeEngine, root: str) -> None:
    bad = {"type": "json_schema"}  # no schema
    with pytest.raises(RequestFieldError) as refused:
        plan_request(demo_engine, MESSAGES, response_format=bad)
    assert refused.value.field == "response_format"
    served = _post(root, {"messages": MESSAGES, "response_format": bad})
    assert served.status_code == 400 and served.json()["error"]["param"] == "response_format"
    assert served.json()["error"]["message"] == str(refused.value)


# ------------------------------------------------------------------------------- tool_choice spellings
SPELLINGS: list[Any] = [
    None,
    "auto",
    False,
    "none",
    "required",
    "any",
    True,
    "sing",
    {"name": "sing"},
    {"type": "function", "function": {"name": "sing"}},
]


@pytest.mark.parametrize("choice", SPELLINGS, ids=[json.dumps(choice) for choice in SPELLINGS])
def test_every_tool_choice_spelling_means_the_same_through_the_planner_and_the_server(
    demo_engine: SpeculativeEngine, root: str, choice: Any
) -> None:
    plan = plan_request(demo_engine, MESSAGES, tools=[TOOL], tool_choice=choice, max_tokens=24, temperature=0.0)
    planned = plan.generate()
    parsed = plan.parse(planned.text or "")
    body: dict[str, Any] = {"messages": MESSAGES, "tools": [TOOL], "max_tokens": 24, "temperature": 0}
    if choice is not None:
        body["tool_choice"] = choice
    served = _post(root, body)
    assert served.status_code == 200, served.text
    answer = served.json()
    message = answer["choices"][0]["message"]
    assert answer["usage"] == TokenUsage.of(planned).openai()  # the same tokens
    calls = [call["function"]["name"] for call in message.get("tool_calls") or []]
    assert calls == [c.name for c in parsed.tool_calls] + [c.name or "" for c in parsed.invalid_tool_calls]
    assert (message["content"] or "") == parsed.content


@pytest.mark.parametrize("choice", ["nope", {"function": {}}, {"name": 3}])
def test_a_bad_tool_choice_is_refused_alike(demo_engine: SpeculativeEngine, root: str, choice: Any) -> None:
    with pytest.raises(RequestFieldError) as refused:
        plan_request(demo_engine, MESSAGES, tools=[TOOL], tool_choice=choice)
    assert refused.value.field == "tool_choice"
    served = _post(root, {"messages": MESSAGES, "tools": [TOOL], "tool_choice": choice})
    assert served.status_code == 400 and served.json()["error"]["param"] == "tool_choice"
    assert served.json()["error"]["message"] == str(refused.value)


def test_a_forced_choice_without_tools_is_refused_alike(demo_engine: SpeculativeEngine, root: str) -> None:
    with pytest.raises(RequestFieldError) as refused:
        plan_request(demo_engine, MESSAGES, tool_choice="any")
    served = _post(root, {"messages": MESSAGES, "tool_choice": "any"})
    assert served.status_code == 400 and served.json()["error"]["param"] == "tool_choice"
    assert served.json()["error"]["message"] == str(refused.value)
