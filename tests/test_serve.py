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

from selfspec.server import serve_in_background  # noqa: E402

MODEL = "selfspec-demo"
KEY = "test-key"
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
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    metrics = httpx.get(f"{base_url}/metrics")
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
    assert int(forwards.split()[1]) > 0


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
    while 'selfspec_generations_total{finish_reason="cancelled"} 1' not in httpx.get(f"{base_url}/metrics").text:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.1)
    # a non-streamed request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False}, headers=headers, timeout=0.5)
    deadline = time.monotonic() + 30
    while 'selfspec_generations_total{finish_reason="cancelled"} 2' not in httpx.get(f"{base_url}/metrics").text:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.1)
    expected = demo_engine.generate(MESSAGES, max_new_tokens=8)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected.text


def test_tools_render_through_the_template_and_forced_calls_parse(client: Any, demo_engine: Any) -> None:
    pytest.importorskip("llguidance")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "multiply",
                "description": "Multiply two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                },
            },
        }
    ]
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

    from selfspec.server import add_serve_parser, cmd_serve

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
