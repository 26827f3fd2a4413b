"""The OpenAI-compatible server over real HTTP on loopback, driven by the official client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from selfspec.serving.server import serve_in_background  # noqa: E402

MODEL = "selfspec-demo"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 16
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
PROMPT = "It is a truth universally acknowledged"
STAT_NAMES = (
    "target_forwards",
    "num_drafted",
    "num_accepted",
    "mean_accepted_length",
    "acceptance_rate",
    "accepted_length_histogram",
    "draft_seconds",
    "verify_seconds",
    "tokens_per_second",
)


@pytest.fixture(scope="module")
def base_url(demo_engine: Any) -> Iterator[str]:
    with serve_in_background(demo_engine, model_id=MODEL, api_key=KEY) as root:
        yield root


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_chat_equals_engine_streamed_or_not(client: Any, demo_engine: Any) -> None:
    expected = demo_engine.generate(MESSAGES, max_new_tokens=N)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == expected.prompt_tokens == len(demo_engine.encode_prompt(MESSAGES))
    assert reply.usage.completion_tokens == len(expected.token_ids) == N
    assert reply.usage.total_tokens == expected.prompt_tokens + N
    stats = reply.model_extra["selfspec"]
    assert set(stats) == set(STAT_NAMES)
    # adaptive drafting makes the draft lengths (not the text) vary between calls
    assert sum(stats["accepted_length_histogram"]) == stats["target_forwards"] - 1 > 0

    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["length"]
    assert set(finish[0].model_extra["selfspec"]) == set(STAT_NAMES)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


def test_completions_and_stop_strings(client: Any, demo_engine: Any) -> None:
    expected = demo_engine.generate(PROMPT, max_new_tokens=N)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == expected.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected.text

    stop = expected.text.split()[2]  # a word the greedy text contains
    stopped = demo_engine.generate(PROMPT, max_new_tokens=N, stop=[stop])
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop)
    assert reply.choices[0].text == stopped.text
    assert reply.choices[0].finish_reason == "stop"
    chat_stopped = demo_engine.generate(MESSAGES, max_new_tokens=N, stop=["sea", "the"])
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, stop=["sea", "the"]
    )
    assert chat.choices[0].message.content == chat_stopped.text


def test_seeded_sampling_is_reproducible(client: Any, demo_engine: Any) -> None:
    expected = demo_engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    reply = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 20}
    )
    assert reply.choices[0].text == expected.text


def test_models_health_and_metrics(client: Any, base_url: str) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{base_url}/health", headers=AUTH)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["model"] == MODEL
    plan = health.json()["plan"]  # what the engine runs (tests/system/test_openai_parity.py checks it in full)
    assert set(plan) == {"drafter", "method", "settings", "predicted_speedup", "calibrated", "summary"}
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    metrics = httpx.get(f"{base_url}/metrics", headers=AUTH)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in (
        "selfspec_target_forwards_total",
        "selfspec_num_drafted_total",
        "selfspec_num_accepted_total",
        "selfspec_mean_accepted_length",
        "selfspec_acceptance_rate",
        "selfspec_accepted_length_histogram_total",
        "selfspec_draft_seconds_total",
        "selfspec_verify_seconds_total",
        "selfspec_tokens_per_second",
        "selfspec_prompt_tokens_total",
        "selfspec_completion_tokens_total",
    ):
        assert f"# TYPE {name} " in text
    assert 'selfspec_requests_total{endpoint="/v1/completions",status="200"}' in text
    forwards = next(line for line in text.splitlines() if line.startswith("selfspec_target_forwards_total "))
    assert float(forwards.split()[1]) > 0


def test_concurrent_clients_get_what_they_get_alone(client: Any, demo_engine: Any) -> None:
    prompts = [
        "It is a truth universally acknowledged",
        "The sea was calm that morning",
        "Once upon a time",
        "My dear Elizabeth",
        "The captain looked at the map",
        "In the garden there was",
    ]
    alone = [demo_engine.generate(p, max_new_tokens=12).text for p in prompts]

    def ask(i: int) -> str:
        if i % 2:
            chunks = client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in chunks)
        return str(
            client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0).choices[0].text
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, range(len(prompts))))
    assert together == alone


def _error(exc_info: Any) -> dict[str, Any]:
    body = exc_info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_requests_get_openai_errors(client: Any, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=-1)
    assert _error(bad)["param"] == "temperature" and "temperature" in _error(bad)["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert _error(bad)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    assert "context window" in _error(bad)["message"] and _error(bad)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=4)
    assert "vocabulary" in _error(bad)["message"] and _error(bad)["param"] == "prompt"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-nothing", messages=MESSAGES, max_tokens=4)
    assert _error(missing)["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as denied:
        wrong.models.list()
    assert _error(denied)["code"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    assert httpx.get(f"{base_url}/v1/models").status_code == 401  # no key at all
    malformed = httpx.post(f"{base_url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    no_messages = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL}, headers=headers)
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    # the engine is still fine
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_disconnecting_stream_cancels_and_the_server_goes_on(client: Any, base_url: str, demo_engine: Any) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: ") :])
        assert first["object"] == "text_completion"
    # the abandoned generation is cancelled: it stops long before 2,000 tokens
    deadline = time.monotonic() + 30
    cancelled = 'selfspec_generations_total{finish_reason="cancelled"} 1'
    while cancelled not in httpx.get(f"{base_url}/metrics", headers=AUTH).text:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.1)
    # a non-streamed request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 30
    cancelled = 'selfspec_generations_total{finish_reason="cancelled"} 2'
    while cancelled not in httpx.get(f"{base_url}/metrics", headers=AUTH).text:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.1)
    expected = demo_engine.generate(MESSAGES, max_new_tokens=8)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected.text


MULTIPLY = {
    "name": "multiply",
    "description": "Multiply two integers.",
    "parameters": {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["x", "y"],
    },
}


def test_tools_render_through_the_template_and_forced_calls_parse(client: Any, demo_engine: Any) -> None:
    pytest.importorskip("llguidance")
    tools = [{"type": "function", "function": MULTIPLY}]
    messages = [{"role": "user", "content": "Use multiply on 3 and 5."}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "multiply"}},
        max_tokens=24,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "multiply" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"x", "y"}
    assert reply.usage.prompt_tokens == len(demo_engine.encode_prompt(messages, tools=tools))

    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="required", max_tokens=24, temperature=0, stream=True
    )
    chunks = list(streamed)
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "multiply"
    assert set(json.loads("".join(d.function.arguments or "" for d in deltas))) == {"x", "y"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the call and its result go back through the template in the model's own format
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "15"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=8, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    template_history = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "id": call.id, "function": {"name": "multiply", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "15", "name": "multiply"},
    ]
    assert answer.usage.prompt_tokens == len(demo_engine.encode_prompt(template_history, tools=tools))


def test_serve_command_line() -> None:
    import argparse

    from selfspec.cli.serve import add_serve_parser, cmd_serve

    parser = argparse.ArgumentParser(prog="selfspec")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", "--model", MODEL])
    assert (args.host, args.port, args.func) == ("127.0.0.1", 8000, cmd_serve)
    args = parser.parse_args(["serve", "-m", MODEL, "--port", "9001", "--api-key", "k", "--num-draft-tokens", "3"])
    assert (args.port, args.api_key, args.num_draft_tokens) == (9001, "k", 3)


def test_response_format_json_schema(client: Any) -> None:
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=24,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content)["city"], str)
    else:  # cut by max_tokens: still a prefix of the schema's JSON
        assert reply.choices[0].message.content.lstrip().startswith("{")


# ------------------------------------------------------------------------------- hostile and careless input
# One table for the HTTP front door: every row is a request a careless or hostile client sends,
# the status it gets (and the field or code named), then a valid request gets the right text.
GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
JSON_HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def _raw(body: str) -> bytes:
    return body.encode()


#: issue 29's hostile schemas and tools
BIG_ENUM = {"enum": [f"{i:06d}" + "x" * 74 for i in range(20_000)]}  # 1.6 MB
BIG_TOOL = {  # 19,000 property names of 96 characters: 2 MB
    "type": "function",
    "function": {
        "name": "big",
        "parameters": {"type": "object", "properties": {f"{i:06d}" + "k" * 90: {} for i in range(19_000)}},
    },
}
SMALL_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
BIG_CALL = {  # an assistant's past call whose arguments are all keys
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": {f"{i:05d}" + "k" * 25: 0 for i in range(10_000)}},
        }
    ],
}
RECURSIVE = {
    "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
    "$ref": "#/$defs/a",
}
RECURSIVE_TOOL = {"type": "function", "function": {"name": "rec", "parameters": RECURSIVE}}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


HTTP_BAD_INPUT = [
    # (id, path, body: dict | bytes, extra headers, status, param or code)
    ("temperature<0", "completions", {**GOOD, "temperature": -1}, {}, 400, "temperature"),
    ("temperature=true", "completions", {**GOOD, "temperature": True}, {}, 400, "temperature"),
    (
        "temperature=1e400",
        "completions",
        _raw('{"model": "selfspec-demo", "prompt": "Hi", "temperature": 1e400}'),
        {},
        400,
        "temperature",
    ),
    (
        "temperature=NaN",
        "completions",
        _raw('{"model": "selfspec-demo", "prompt": "Hi", "temperature": NaN}'),
        {},
        400,
        None,
    ),
    ("temperature=1e308", "completions", {**GOOD, "temperature": 1e308}, {}, 400, "temperature"),  # OpenAI: <= 2
    ("top_k=true", "completions", {**GOOD, "top_k": True}, {}, 400, "top_k"),
    ("top_k=1.5", "completions", {**GOOD, "top_k": 1.5}, {}, 400, "top_k"),
    ("top_k<0", "completions", {**GOOD, "top_k": -1, "temperature": 1}, {}, 400, "top_k"),
    ("top_p=0", "completions", {**GOOD, "top_p": 0, "temperature": 1}, {}, 400, "top_p"),
    ("top_p>1", "completions", {**GOOD, "top_p": 1.5, "temperature": 1}, {}, 400, "top_p"),
    ("stop=5", "completions", {**GOOD, "stop": 5}, {}, 400, "stop"),
    ("stop=['']", "completions", {**GOOD, "stop": [""]}, {}, 400, "stop"),
    ("stop=[1]", "completions", {**GOOD, "stop": [1]}, {}, 400, "stop"),
    ("seed=2**70", "completions", {**GOOD, "seed": 2**70}, {}, 400, "seed"),
    ("seed<0", "completions", {**GOOD, "seed": -1}, {}, 400, "seed"),
    ("seed=true", "completions", {**GOOD, "seed": True}, {}, 400, "seed"),
    ("max_tokens=0", "completions", {**GOOD, "max_tokens": 0}, {}, 400, "max_tokens"),
    (
        "max_completion_tokens=0",
        "chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        {},
        400,
        "max_completion_tokens",
    ),
    ("max_tokens=true", "completions", {**GOOD, "max_tokens": True}, {}, 400, "max_tokens"),
    ("max_tokens='5'", "completions", {**GOOD, "max_tokens": "5"}, {}, 400, "max_tokens"),
    ("max_tokens=2.0", "completions", {**GOOD, "max_tokens": 2.0}, {}, 400, "max_tokens"),
    ("max_tokens>window", "completions", {**GOOD, "max_tokens": 10_000}, {}, 400, "prompt"),
    ("stream='yes'", "completions", {**GOOD, "stream": "yes"}, {}, 400, "stream"),
    ("empty prompt", "completions", {**GOOD, "prompt": ""}, {}, 400, "prompt"),
    ("lone surrogate prompt", "completions", {**GOOD, "prompt": "a\ud800"}, {}, 400, "prompt"),
    (
        "lone surrogate chat",
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "a\udfff"}]},
        {},
        400,
        "messages[0].content",
    ),
    ("id out of vocabulary", "completions", {**GOOD, "prompt": [10**6]}, {}, 400, "prompt"),
    ("float ids", "completions", {**GOOD, "prompt": [1.5, 2.0]}, {}, 400, "prompt"),
    ("bool ids", "completions", {**GOOD, "prompt": [True]}, {}, 400, "prompt"),
    ("two prompts", "completions", {**GOOD, "prompt": ["a", "b"]}, {}, 400, "prompt"),
    ("two token-id prompts", "completions", {**GOOD, "prompt": [[1, 2, 3], [1, 2, 3]]}, {}, 400, "prompt"),
    ("an empty token-id prompt", "completions", {**GOOD, "prompt": [[]]}, {}, 400, "prompt"),
    ("a negative id in a list", "completions", {**GOOD, "prompt": [[5, -1]]}, {}, 400, "prompt"),
    ("an id over the vocabulary in a list", "completions", {**GOOD, "prompt": [[10**6]]}, {}, 400, "prompt"),
    ("float ids in a list", "completions", {**GOOD, "prompt": [[1.5]]}, {}, 400, "prompt"),
    ("text and ids mixed", "completions", {**GOOD, "prompt": ["a", 1]}, {}, 400, "prompt"),
    ("a prompt object", "completions", {**GOOD, "prompt": {"text": "a"}}, {}, 400, "prompt"),
    (
        "function_call without functions",
        "chat/completions",
        {**CHAT, "function_call": "auto"},
        {},
        400,
        "function_call",
    ),
    (
        "functions and tools",
        "chat/completions",
        {**CHAT, "functions": [SMALL_TOOL["function"]], "tools": [SMALL_TOOL]},
        {},
        400,
        "functions",
    ),
    (
        "function_call='banana'",
        "chat/completions",
        {**CHAT, "functions": [SMALL_TOOL["function"]], "function_call": "banana"},
        {},
        400,
        "function_call",
    ),
    (
        "a function without a name",
        "chat/completions",
        {**CHAT, "functions": [{"parameters": {}}]},
        {},
        400,
        "functions[0]",
    ),
    ("functions not a list", "chat/completions", {**CHAT, "functions": {"name": "f"}}, {}, 400, "functions"),
    (
        "a function message without a name",
        "chat/completions",
        {**CHAT, "messages": [*MESSAGES, {"role": "function", "content": "1"}]},
        {},
        400,
        "messages[1]",
    ),
    ("prompt over the window", "completions", {**GOOD, "prompt": "word " * 3000}, {}, 400, "prompt"),
    (
        "1 MB prompt (characters)",
        "completions",
        {**GOOD, "prompt": "x" * 1_000_000},
        {},
        400,
        "context_length_exceeded",
    ),
    (
        "1 MB chat message",
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "x" * 10**6}]},
        {},
        400,
        "context_length_exceeded",
    ),
    ("no messages field", "chat/completions", {"model": MODEL}, {}, 400, "messages"),
    ("empty messages", "chat/completions", {**CHAT, "messages": []}, {}, 400, "messages"),
    ("message not a dict", "chat/completions", {**CHAT, "messages": ["hi"]}, {}, 400, "messages.0"),
    (
        "unknown role",
        "chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
        {},
        400,
        "messages[0]",
    ),
    (
        "image content",
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {},
        400,
        "messages[0]",
    ),
    ("unknown model", "completions", {**GOOD, "model": "gpt-nothing"}, {}, 404, "model"),
    ("n=2", "completions", {**GOOD, "n": 2}, {}, 400, "n"),
    ("logprobs over OpenAI's 5", "completions", {**GOOD, "logprobs": 6}, {}, 400, "logprobs"),
    ("logprobs not an int", "completions", {**GOOD, "logprobs": True}, {}, 400, "logprobs"),
    ("temperature over OpenAI's 2", "completions", {**GOOD, "temperature": 3}, {}, 400, "temperature"),
    (
        "bad response_format",
        "chat/completions",
        {**CHAT, "response_format": {"type": "xml"}},
        {},
        400,
        "response_format",
    ),
    ("tool_choice without tools", "chat/completions", {**CHAT, "tool_choice": "required"}, {}, 400, "tool_choice"),
    ("top_logprobs without logprobs", "chat/completions", {**CHAT, "top_logprobs": 2}, {}, 400, "top_logprobs"),
    (
        "top_logprobs over OpenAI's 20",
        "chat/completions",
        {**CHAT, "logprobs": True, "top_logprobs": 21},
        {},
        400,
        "top_logprobs",
    ),
    ("chat logprobs not a bool", "chat/completions", {**CHAT, "logprobs": 3}, {}, 400, "logprobs"),
    ("chat temperature 2.5", "chat/completions", {**CHAT, "temperature": 2.5}, {}, 400, "temperature"),
    # issue 29: everything that becomes prompt or grammar is bounded before any work
    (
        "1.6 MB enum schema",
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BIG_ENUM}}},
        {},
        400,
        "invalid_schema",
    ),
    ("2 MB tool (19,000 keys)", "chat/completions", {**CHAT, "tools": [BIG_TOOL]}, {}, 400, "invalid_schema"),
    ("129 tools", "chat/completions", {**CHAT, "tools": [SMALL_TOOL] * 129}, {}, 400, "invalid_schema"),
    (
        "tool_calls arguments of 300,000 keys' characters",
        "chat/completions",
        {**CHAT, "messages": [*MESSAGES, BIG_CALL, {"role": "user", "content": "and?"}]},
        {},
        400,
        "context_length_exceeded",
    ),
    (
        "recursive required schema",
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": RECURSIVE}}},
        {},
        400,
        "invalid_schema",
    ),
    (
        "recursive required tool, forced",
        "chat/completions",
        {**CHAT, "tools": [RECURSIVE_TOOL], "tool_choice": {"type": "function", "function": {"name": "rec"}}},
        {},
        400,
        "invalid_schema",
    ),
    (
        "schema admitting nothing ($ref #)",
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"$ref": "#"}}}},
        {},
        400,
        "invalid_schema",
    ),
    (
        "mutual $refs",
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": MUTUAL}}},
        {},
        400,
        "invalid_schema",
    ),
    ("17 stop strings", "completions", {**GOOD, "stop": [f"s{i}" for i in range(17)]}, {}, 400, "stop"),
    ("100,000 stop strings", "completions", {**GOOD, "stop": ["zq"] * 100_000}, {}, 400, "stop"),
    ("a 257-character stop", "completions", {**GOOD, "stop": ["x" * 257]}, {}, 400, "stop"),
    ("temperature=1e-38 (greedy)", "completions", {**GOOD, "temperature": 1e-38}, {}, 200, None),
    ("temperature=5e-324 (subnormal)", "completions", {**GOOD, "temperature": 5e-324}, {}, 200, None),
    ("not JSON", "completions", b"{not json", {}, 400, None),
    ("invalid UTF-8", "completions", b'{"model": "selfspec-demo", "prompt": "\xff\xfe"}', {}, 400, None),
    ("a JSON list", "completions", b"[1, 2, 3]", {}, 400, None),
    ("100,000-deep JSON", "completions", b"[" * 100_000 + b"]" * 100_000, {}, 400, None),
    (
        "70-deep JSON in a field",
        "chat/completions",
        _raw(
            '{"model": "selfspec-demo", "messages": [{"role": "user", "content": "hi", "x": '
            + "[" * 70
            + "]" * 70
            + "}]}"
        ),
        {},
        400,
        None,
    ),
    (
        "a 10,000-digit int",
        "completions",
        _raw('{"model": "selfspec-demo", "prompt": "Hi", "seed": ' + "9" * 10_000 + "}"),
        {},
        400,
        None,
    ),
    ("text/plain", "completions", {**GOOD}, {"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    (
        "form content type",
        "completions",
        {**GOOD},
        {"Content-Type": "application/x-www-form-urlencoded"},
        415,
        "unsupported_media_type",
    ),
    (
        "foreign Host (DNS rebinding)",
        "completions",
        {**GOOD},
        {"Host": "attacker.example", "Origin": "http://attacker.example"},
        403,
        "host_not_allowed",
    ),
    ("body over the limit", "completions", {**GOOD, "prompt": "x" * (3 * 2**20)}, {}, 413, "request_too_large"),
    ("no API key", "completions", {**GOOD}, {"Authorization": ""}, 401, "invalid_api_key"),
    ("wrong API key", "completions", {**GOOD}, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
]


@pytest.fixture(scope="module")
def good_text(demo_engine: Any) -> str:
    return str(demo_engine.generate(PROMPT, max_new_tokens=6).text)


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "what"),
    [pytest.param(*row[1:], id=row[0]) for row in HTTP_BAD_INPUT],
)
def test_http_bad_input_table(base_url: str, good_text: str, path, body, headers, status, what) -> None:
    with httpx.Client(base_url=base_url, headers=JSON_HEADERS, timeout=60) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        started = time.perf_counter()
        response = http.post(f"/v1/{path}", content=content, headers=headers)
        elapsed = time.perf_counter() - started
        assert response.status_code == status, response.text
        assert response.headers["x-request-id"]
        if status != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert "\n" not in error["message"] and len(error["message"]) < 1000  # one clean line
            if what is not None:
                assert what in (error["param"], error["code"]), error
            assert elapsed < 5  # refused at once (the 1 MB prompt is never tokenized)
        # the server answers the next valid call with the right text
        reply = http.post("/v1/completions", json=GOOD)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == good_text


def test_completions_take_each_single_prompt_form(client: Any, base_url: str, demo_engine: Any) -> None:
    """Issue 44: text, token ids, and a one-element list of either are one prompt; several are a clear 400."""
    ids = [int(i) for i in demo_engine.tokenizer.encode(PROMPT, add_special_tokens=False)]
    expected = demo_engine.generate_ids(ids, max_new_tokens=6).text
    for prompt in (ids, [ids]):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert reply.choices[0].text == expected and reply.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model=MODEL, prompt=[ids], max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected
    text = client.completions.create(model=MODEL, prompt=[PROMPT], max_tokens=6, temperature=0)
    assert text.choices[0].text == demo_engine.generate(PROMPT, max_new_tokens=6).text
    with httpx.Client(base_url=base_url, headers=JSON_HEADERS, timeout=60) as http:

        def refusal(prompt: Any) -> str:
            response = http.post("/v1/completions", json={**GOOD, "prompt": prompt})
            assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
            return str(response.json()["error"]["message"])

        assert refusal([ids, ids]) == (
            "only one prompt per request is served, got 2: send one request per prompt "
            "(concurrent requests are served together)"
        )
        assert "got 3" in refusal([PROMPT, PROMPT, PROMPT])
        assert refusal([[]]) == refusal([]) == "the prompt is empty; pass some text or token ids"
        assert "a list of token ids (integers), or a one-element list of either" in refusal([[0.5]])
        vocab = int(refusal([[-1]]).rsplit(", ", 1)[1].rstrip(")"))  # "... not in the vocabulary [0, N)"
        assert refusal([[ids[0], vocab]]) == f"token id {vocab} is not in the vocabulary [0, {vocab})"
        assert http.post("/v1/completions", json={**GOOD, "prompt": [[vocab - 1]]}).status_code == 200


def test_legacy_function_calling_is_served_in_its_own_shape(client: Any, demo_engine: Any) -> None:
    """Issue 44: ``functions`` / ``function_call`` were silently ignored; now served as tools, answered as functions."""
    pytest.importorskip("llguidance")
    messages = [{"role": "user", "content": "Use multiply on 3 and 5."}]
    tools = [{"type": "function", "function": MULTIPLY}]
    common = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    as_tool = client.chat.completions.create(
        **common, tools=tools, tool_choice={"type": "function", "function": {"name": "multiply"}}
    )
    reply = client.chat.completions.create(**common, functions=[MULTIPLY], function_call={"name": "multiply"})
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "multiply"
    assert choice.message.function_call.arguments == as_tool.choices[0].message.tool_calls[0].function.arguments
    assert set(json.loads(choice.message.function_call.arguments)) == {"x", "y"}
    assert reply.usage.prompt_tokens == as_tool.usage.prompt_tokens  # the same prompt: functions render as tools

    streamed = list(
        client.chat.completions.create(**common, functions=[MULTIPLY], function_call={"name": "multiply"}, stream=True)
    )
    deltas = [chunk.choices[0].delta for chunk in streamed if chunk.choices]
    assert all(delta.tool_calls is None for delta in deltas)
    calls = [delta.function_call for delta in deltas if delta.function_call is not None]
    assert calls[0].name == "multiply" and all(call.name is None for call in calls[1:])
    assert "".join(call.arguments or "" for call in calls) == choice.message.function_call.arguments
    assert streamed[-1].choices[0].finish_reason == "function_call"

    plain = client.chat.completions.create(**common, functions=[MULTIPLY], function_call="none")
    assert plain.choices[0].message.function_call is None and plain.choices[0].finish_reason in ("stop", "length")
    assert plain.choices[0].message.content == (
        client.chat.completions.create(**common, tools=tools, tool_choice="none").choices[0].message.content
    )

    # the call and its result, in the deprecated shape, go through the template as a tool call and a tool message
    call = {"name": "multiply", "arguments": choice.message.function_call.arguments}
    legacy_history = [
        *messages,
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "multiply", "content": "15"},
    ]
    tools_history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_legacy_1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call_legacy_1", "content": "15"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=legacy_history, functions=[MULTIPLY], max_tokens=8, temperature=0
    )
    same = client.chat.completions.create(model=MODEL, messages=tools_history, tools=tools, max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens == same.usage.prompt_tokens
    legacy_message, tools_message = answer.choices[0].message, same.choices[0].message
    assert legacy_message.content == tools_message.content
    if tools_message.tool_calls:  # the model called again: the same call, in the deprecated shape
        assert legacy_message.function_call.name == tools_message.tool_calls[0].function.name
        assert legacy_message.function_call.arguments == tools_message.tool_calls[0].function.arguments
    else:
        assert legacy_message.function_call is None
    template_history = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call_legacy_1",
                    "function": {"name": "multiply", "arguments": json.loads(call["arguments"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_legacy_1", "content": "15", "name": "multiply"},
    ]
    assert answer.usage.prompt_tokens == len(demo_engine.encode_prompt(template_history, tools=tools))


def test_http_get_and_unknown_paths(base_url: str) -> None:
    with httpx.Client(base_url=base_url, headers=JSON_HEADERS, timeout=30) as http:
        assert http.get("/v1/completions").status_code == 405
        missing = http.get("/v1/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert http.get("/health", headers={"Host": "evil.example"}).status_code == 403
        assert http.get("/health", headers={"Host": "localhost:1234"}).status_code == 200
        assert http.get("/health", headers={"Host": "[::1]:80"}).status_code == 200


def test_metrics_count_refusals_and_no_500(base_url: str) -> None:
    def count(status: int) -> float:
        text = httpx.get(f"{base_url}/metrics", headers=AUTH).text
        assert 'status="500"' not in text  # not one of the bad requests above was a 500
        prefix = f'selfspec_requests_total{{endpoint="/v1/completions",status="{status}"}} '
        return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))

    before = count(415), count(413)
    httpx.post(f"{base_url}/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"})
    httpx.post(f"{base_url}/v1/completions", json={"prompt": "x" * (3 * 2**20)})
    assert (count(415), count(413)) == (before[0] + 1, before[1] + 1)


def test_internal_errors_get_a_request_id_and_no_exception_text(demo_engine: Any, caplog: Any) -> None:
    """A fault inside the server: a generic 500 naming the request id, one traceback in the log."""
    from fastapi.testclient import TestClient

    from selfspec.serving.server import create_app

    app = create_app(demo_engine, model_id=MODEL)
    server = app.state.selfspec

    def broken(body: Any) -> Any:
        raise RuntimeError("secret internal detail")

    server.prepare_completion = broken
    logger = "selfspec.serving.server"
    with TestClient(app, base_url="http://127.0.0.1") as http, caplog.at_level("ERROR", logger=logger):
        response = http.post("/v1/completions", json=GOOD)
        assert response.status_code == 500
        error = response.json()["error"]
        request_id = response.headers["x-request-id"]
        assert request_id in error["message"] and "secret" not in response.text
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        tracebacks = [r for r in caplog.records if r.exc_info and "secret internal detail" in str(r.exc_info[1])]
        assert len(tracebacks) == 1 and request_id in tracebacks[0].getMessage()
        del server.prepare_completion  # the engine and the server are fine
        assert http.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
        assert 'status="500"} 1' in http.get("/metrics").text


def test_queue_full_is_429_with_retry_after(demo_engine: Any, good_text: str) -> None:
    from selfspec.serving.server.limits import ServerLimits

    limits = ServerLimits(max_concurrent=1, max_queue=0, retry_after=3)
    with serve_in_background(demo_engine, model_id=MODEL, limits=limits) as root:
        long = {**GOOD, "max_tokens": 1500, "stream": True}
        with httpx.Client(base_url=root, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=long) as stream:
                assert stream.status_code == 200
                lines = stream.iter_lines()  # (a dropped iterator would close the connection)
                next(lines)  # the generation holds the only slot
                busy = http.post("/v1/completions", json=GOOD)
                assert busy.status_code == 429 and busy.headers["retry-after"] == "3"
                assert busy.json()["error"]["code"] == "server_busy"
                assert http.get("/health").status_code == 200  # only generations are limited
            deadline = time.monotonic() + 30  # the slot is freed when the stream is closed
            while (reply := http.post("/v1/completions", json=GOOD)).status_code == 429:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert reply.json()["choices"][0]["text"] == good_text


def test_cors_is_off_unless_asked(demo_engine: Any, base_url: str) -> None:
    from selfspec.serving.server.limits import ServerLimits

    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    off = httpx.options(f"{base_url}/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    limits = ServerLimits(cors_origins=("http://app.example",))
    with serve_in_background(demo_engine, model_id=MODEL, limits=limits) as root:
        on = httpx.options(f"{root}/v1/completions", headers=preflight)
        assert on.status_code == 200 and on.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.options(f"{root}/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_slow_and_broken_clients_on_a_real_server(demo_engine: Any, good_text: str) -> None:
    """Against uvicorn on loopback: incomplete headers, a body that never ends, a client that drops mid-upload."""
    import socket

    from selfspec.serving.server.limits import ServerLimits

    limits = ServerLimits(header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0)
    with serve_in_background(demo_engine, model_id=MODEL, limits=limits) as root:
        port = int(root.rsplit(":", 1)[1])
        # 1. incomplete headers: the connection is closed after header_timeout
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.settimeout(10)
        started = time.monotonic()
        assert slow.recv(100) == b"" and 0.8 < time.monotonic() - started < 5
        slow.close()
        # 2. a body that stops arriving: 408 after body_timeout
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model"'
        )
        stalled.settimeout(10)
        assert stalled.recv(100).startswith(b"HTTP/1.1 408")
        stalled.close()
        # 3. a client that drops mid-upload: no 500, counted under its own label
        dropped = socket.create_connection(("127.0.0.1", port))
        dropped.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model"'
        )
        time.sleep(0.2)
        dropped.close()
        # 4. a declared 5 GB body is refused before a byte of it is read
        huge = socket.create_connection(("127.0.0.1", port))
        huge.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000000000\r\n\r\n"
        )
        huge.settimeout(10)
        assert huge.recv(100).startswith(b"HTTP/1.1 413")
        huge.close()
        deadline = time.monotonic() + 10
        while 'status="499"} 1' not in (metrics := httpx.get(f"{root}/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.05)
        assert 'status="500"' not in metrics
        reply = httpx.post(f"{root}/v1/completions", json=GOOD, timeout=60)
        assert reply.json()["choices"][0]["text"] == good_text


def _raw_exchange(base_url: str, request: bytes, timeout: float = 10) -> bytes:
    """Send ``request`` as it is on one connection; everything the server sends until it closes the connection."""
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):  # a timeout here: the connection was left open
            received += chunk
    return received


def test_a_request_framed_twice_is_refused_and_its_connection_closed(base_url: str, good_text: str) -> None:
    """RFC 9112 6.3: ``Content-Length`` with ``Transfer-Encoding: chunked`` is refused (400), and the
    connection is closed, so a request smuggled behind it (in the bytes one reading of the framing
    calls body) is never answered."""
    body = json.dumps(GOOD).encode()
    smuggled = f"GET /health HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    for declared in (b"4", str(len(body)).encode()):
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
            + b"Content-Length: "
            + declared
            + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        reply = _raw_exchange(base_url, head + chunked + smuggled)
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 400 Bad Request", reply[:300]
        headers, _, payload = rest.partition(b"\r\n\r\n")
        assert b"connection: close" in headers.lower()
        assert json.loads(payload)["error"]["code"] == "ambiguous_framing"
        assert reply.count(b"HTTP/1.1 ") == 1  # the smuggled request got no answer
    # the same request framed once is answered with the engine's text
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
    )
    reply = _raw_exchange(base_url, head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200 OK")
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == good_text
