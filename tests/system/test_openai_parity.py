"""OpenAI parity of ``selfspec serve`` (issue 30 item 4), over real HTTP on loopback.

- ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs`` (completions), whole and streamed, in
  OpenAI's wire formats, equal to transformers' ``model(ids).logits.log_softmax(-1)`` at the same
  positions to 1e-5 in fp32: on a tiny random model with a speculative drafter (the values come
  from multi-token verify rows), with prompt lookup, with a token tree, and on the demo model;
- ``temperature`` above 2 refused;
- the statistics in ``x-selfspec-*`` headers, the plan in ``/health`` and in the startup log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tiny_models import make_model  # noqa: E402
from tiny_tokenizer import make_tokenizer  # noqa: E402

from selfspec import SpeculativeEngine  # noqa: E402
from selfspec.serving.server import serve_in_background  # noqa: E402
from selfspec.serving.server.logprobs import token_pieces  # noqa: E402

#: Absolute and relative: the reference is one forward over the whole text, whose float32 sums run
#: in another order than the verifies' (other row counts), so values agree to about 20 ulps
#: (1.07e-5 at -2.27 measured); a distribution the grammar had masked would be off by 1e-3 or more.
TOLERANCE = 1e-5
MESSAGES = [{"role": "user", "content": "It is a truth universally acknowledged"}]
TOP = 5


def reference_logprobs(model: Any, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """transformers' ``log_softmax`` at the positions that chose ``new_ids``: ``[len(new_ids), vocab]``."""
    ids = torch.tensor([prompt_ids + new_ids])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits
    return logits.float().log_softmax(-1)[0, len(prompt_ids) - 1 : -1]


def check_chat_content(content: list[dict[str, Any]], engine: Any, prompt_ids: list[int], new_ids: list[int]) -> None:
    """Each entry is the token's bytes and the reference log-probability; its top list is the reference's top."""
    reference = reference_logprobs(engine.model, prompt_ids, new_ids)
    pieces = token_pieces(engine.tokenizer)
    assert len(content) == len(new_ids)
    for i, (entry, token) in enumerate(zip(content, new_ids, strict=True)):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(pieces.bytes_of(token))
        assert entry["token"] == pieces.text_of(token)
        want = float(reference[i, token])
        assert abs(entry["logprob"] - want) < TOLERANCE * (1 + abs(want)), i
        best = reference[i].topk(len(entry["top_logprobs"]))
        assert [alt["bytes"] for alt in entry["top_logprobs"]] == [list(pieces.bytes_of(int(t))) for t in best.indices]
        got = torch.tensor([alt["logprob"] for alt in entry["top_logprobs"]])
        assert torch.allclose(got, best.values, atol=TOLERANCE, rtol=TOLERANCE), i


def streamed(http: Any, route: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
    """The JSON chunks of a streamed answer, and the response (for its headers)."""
    chunks = []
    with http.stream("POST", route, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks, response


# ------------------------------------------------------------------------------- a tiny random model
@pytest.fixture(scope="module")
def tiny_model() -> Any:
    tokenizer = make_tokenizer()
    return make_model("llama", dtype=torch.float32, vocab_size=len(tokenizer)), tokenizer


@pytest.fixture(scope="module", params=["early_exit", "prompt_lookup", "tree"])
def tiny_server(request: Any, tiny_model: Any) -> Iterator[tuple[Any, Any]]:
    model, tokenizer = tiny_model
    settings: dict[str, Any] = {"drafter": request.param, "num_draft_tokens": 4}
    if request.param in ("early_exit", "tree"):
        settings.update(drafter="early_exit", exit_layer=2)
    if request.param == "tree":
        settings["tree_nodes"] = 8
    engine = SpeculativeEngine(model, tokenizer, **settings)
    with serve_in_background(engine, model_id="tiny") as root, httpx.Client(base_url=root, timeout=120) as http:
        yield engine, http


def test_chat_logprobs_equal_transformers_whole_and_streamed(tiny_server: Any) -> None:
    engine, http = tiny_server
    prompt_ids = engine.encode_prompt(MESSAGES)
    expected = engine.generate_ids(prompt_ids, max_new_tokens=24)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "logprobs": True}
    reply = http.post("/v1/chat/completions", json={**body, "top_logprobs": TOP}).json()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == expected.text
    stats = reply["selfspec"]
    assert stats["num_accepted"] > 0 and stats["mean_accepted_length"] > 1  # multi-token verify rows
    check_chat_content(choice["logprobs"]["content"], engine, prompt_ids, expected.token_ids)

    chunks, _ = streamed(http, "/v1/chat/completions", {**body, "top_logprobs": TOP})
    content = [
        entry for chunk in chunks for entry in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text == expected.text
    check_chat_content(content, engine, prompt_ids, expected.token_ids)  # each chunk carried its own tokens'

    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [entry["top_logprobs"] for entry in plain] == [[]] * len(expected.token_ids)  # top_logprobs: 0
    none = http.post("/v1/chat/completions", json={**body, "logprobs": False}).json()
    assert none["choices"][0]["logprobs"] is None


def test_completion_logprobs_equal_transformers_whole_and_streamed(tiny_server: Any) -> None:
    engine, http = tiny_server
    prompt_ids = engine.encode_prompt("It is a truth universally acknowledged, that a single man")
    expected = engine.generate_ids(prompt_ids, max_new_tokens=20)
    body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": 20, "temperature": 0, "logprobs": 3}
    reply = http.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["text"] == expected.text
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    reference = reference_logprobs(engine.model, prompt_ids, expected.token_ids)
    pieces = token_pieces(engine.tokenizer)
    assert logprobs["tokens"] == [pieces.text_of(t) for t in expected.token_ids]
    want = reference.gather(-1, torch.tensor(expected.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), want, atol=TOLERANCE, rtol=0)
    for i, top in enumerate(logprobs["top_logprobs"]):
        best = reference[i].topk(3)
        want_top: dict[str, float] = {}  # keyed by text: two tokens spelt alike (partial characters) keep the first
        for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            want_top.setdefault(pieces.text_of(token), value)
        assert list(top) == list(want_top)
        assert torch.allclose(torch.tensor(list(top.values())), torch.tensor(list(want_top.values())), atol=TOLERANCE)
    # each token starts where the text before it ends
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(expected.text or "")
    decoded = [engine.tokenizer.decode(expected.token_ids[:i], skip_special_tokens=True) for i in range(len(offsets))]
    assert all(offset <= len(prefix) for offset, prefix in zip(offsets, decoded, strict=True))

    chunks, _ = streamed(http, "/v1/completions", body)
    parts = [chunk["choices"][0]["logprobs"] for chunk in chunks if chunk["choices"][0]["logprobs"]]
    joined = {key: [value for part in parts for value in part[key]] for key in logprobs}
    assert joined["tokens"] == logprobs["tokens"] and joined["text_offset"] == offsets
    assert torch.allclose(torch.tensor(joined["token_logprobs"]), want, atol=TOLERANCE, rtol=0)


def test_sampled_and_stopped_calls_report_the_models_own_distribution(tiny_server: Any) -> None:
    """Under temperature/top-k the values stay the model's log_softmax (OpenAI's choice), not the processed one."""
    engine, http = tiny_server
    prompt_ids = engine.encode_prompt(MESSAGES)
    sampling = {"temperature": 1.7, "top_k": 20, "seed": 11}
    expected = engine.generate_ids(prompt_ids, max_new_tokens=16, **sampling)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "logprobs": True, "top_logprobs": 2, **sampling}
    reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    check_chat_content(reply["choices"][0]["logprobs"]["content"], engine, prompt_ids, expected.token_ids)


# ------------------------------------------------------------------------------- the engine's own option
def test_engine_logprobs_from_verify_rows(tiny_model: Any) -> None:
    model, tokenizer = tiny_model
    prompt_ids = tokenizer("It is a truth universally acknowledged")["input_ids"]
    for settings in ({"drafter": "early_exit", "exit_layer": 2, "num_draft_tokens": 5}, {"drafter": "none"}):
        engine = SpeculativeEngine(model, tokenizer, **settings)
        out = engine.generate_ids(prompt_ids, max_new_tokens=24, logprobs=4)
        assert out.logprobs is not None and [e.token_id for e in out.logprobs] == out.token_ids
        reference = reference_logprobs(model, prompt_ids, out.token_ids)
        got = torch.tensor([e.logprob for e in out.logprobs])
        assert torch.allclose(got, reference.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=TOLERANCE)
        assert [e.top_token_ids for e in out.logprobs] == reference.topk(4).indices.tolist()
        with engine.stream_ids(prompt_ids, max_new_tokens=24, logprobs=0) as stream:
            for _ in stream:
                assert stream.logprobs is not None and len(stream.logprobs) == len(stream._run.token_ids)
        assert stream.output is not None and stream.output.logprobs is not None
        assert [e.token_id for e in stream.output.logprobs] == out.token_ids
        assert engine.generate_ids(prompt_ids, max_new_tokens=4).logprobs is None
    stopped = engine.generate_ids(prompt_ids, max_new_tokens=24, logprobs=1, stop=out.text[5:8] if out.text else None)
    assert stopped.logprobs is not None and len(stopped.logprobs) == len(stopped.token_ids)
    for bad in (-1, 21, 2.0, True, "3"):
        with pytest.raises(ValueError, match="logprobs must be None or an int in"):
            engine.generate_ids(prompt_ids, max_new_tokens=2, logprobs=bad)


def test_engine_logprobs_in_a_batch(tiny_model: Any) -> None:
    """Rows decoded together get the values they get alone (the batched verify's rows)."""
    from concurrent.futures import ThreadPoolExecutor

    model, tokenizer = tiny_model
    engine = SpeculativeEngine(model, tokenizer, drafter="early_exit", exit_layer=2, num_draft_tokens=3, batching=True)
    prompts = [tokenizer(text)["input_ids"] for text in ("It is a truth", "The quick brown fox", "Hello world! STOP")]
    with ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(lambda ids: engine.generate_ids(ids, max_new_tokens=16, logprobs=2), prompts))
    assert engine._batcher is not None and engine._batcher.max_rows_seen > 1  # they were decoded together
    for prompt_ids, out in zip(prompts, outputs, strict=True):
        assert out.logprobs is not None
        reference = reference_logprobs(model, prompt_ids, out.token_ids)
        want = reference.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([e.logprob for e in out.logprobs]), want, atol=TOLERANCE, rtol=0)


# ------------------------------------------------------------------------------- the demo model
@pytest.fixture(scope="module")
def demo_http(demo_engine: Any) -> Iterator[Any]:
    with serve_in_background(demo_engine, model_id="selfspec-demo") as root:
        with httpx.Client(base_url=root, timeout=120) as http:
            yield http


def test_demo_model_logprobs_equal_transformers(demo_engine: Any, demo_http: Any) -> None:
    messages = [{"role": "user", "content": "Tell me a story about the sea. Tell me a story about the sea."}]
    prompt_ids = demo_engine.encode_prompt(messages)
    expected = demo_engine.generate_ids(prompt_ids, max_new_tokens=32)
    body = {"model": "selfspec-demo", "messages": messages, "max_tokens": 32, "temperature": 0}
    reply = demo_http.post("/v1/chat/completions", json={**body, "logprobs": True, "top_logprobs": TOP}).json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["selfspec"]["num_accepted"] > 0  # the demo's plan drafted, and the target kept some
    check_chat_content(reply["choices"][0]["logprobs"]["content"], demo_engine, prompt_ids, expected.token_ids)


def test_demo_model_logprobs_under_a_grammar_are_the_models(demo_engine: Any, demo_http: Any) -> None:
    """A JSON-constrained answer reports the model's own log_softmax (before the grammar's mask)."""
    pytest.importorskip("llguidance")
    messages = [{"role": "user", "content": "Give me a JSON object about the sea."}]
    body = {
        "model": "selfspec-demo",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "logprobs": True,
        "top_logprobs": 3,
    }
    reply = demo_http.post("/v1/chat/completions", json=body).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert reply["choices"][0]["message"]["content"].startswith("{")
    assert len(content) == reply["usage"]["completion_tokens"]
    pieces = token_pieces(demo_engine.tokenizer)
    by_bytes = {bytes(pieces.bytes_of(t)): t for t in range(len(demo_engine.tokenizer))}
    new_ids = [by_bytes[bytes(entry["bytes"])] for entry in content]
    assert demo_engine.tokenizer.decode(new_ids, skip_special_tokens=True) == reply["choices"][0]["message"]["content"]
    check_chat_content(content, demo_engine, demo_engine.encode_prompt(messages), new_ids)


def test_streamed_tool_call_carries_every_tokens_logprobs(demo_engine: Any, demo_http: Any) -> None:
    """A forced tool call streamed as tool_calls deltas: the tokens the parser holds back ride in later chunks."""
    pytest.importorskip("llguidance")
    tool = {
        "type": "function",
        "function": {
            "name": "sing",
            "description": "sing a song",
            "parameters": {"type": "object", "properties": {"song": {"type": "string"}}, "required": ["song"]},
        },
    }
    body = {
        "model": "selfspec-demo",
        "messages": [{"role": "user", "content": "Sing a song about the sea"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    whole = demo_http.post("/v1/chat/completions", json=body).json()
    chunks, _ = streamed(demo_http, "/v1/chat/completions", body)
    assert any(chunk["choices"] and chunk["choices"][0]["delta"].get("tool_calls") for chunk in chunks)
    content = [
        entry
        for chunk in chunks
        if chunk["choices"]
        for entry in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert len(content) == chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    expected = whole["choices"][0]["logprobs"]["content"]
    assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in expected]
    assert all(abs(a["logprob"] - b["logprob"]) < TOLERANCE for a, b in zip(content, expected, strict=True))


# ------------------------------------------------------------------------------- temperature, headers, plan
def test_temperature_above_two_is_refused(demo_http: Any) -> None:
    for route, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        reply = demo_http.post(route, json={"model": "selfspec-demo", "max_tokens": 2, "temperature": 3, **body})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == "temperature" and "between 0 and 2" in error["message"]
        ok = demo_http.post(route, json={"model": "selfspec-demo", "max_tokens": 2, "temperature": 2, **body})
        assert ok.status_code == 200


def test_statistics_and_plan_in_headers_for_any_openai_client(demo_engine: Any, demo_http: Any) -> None:
    client = openai.OpenAI(
        base_url=str(demo_http.base_url).rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=120
    )
    raw = client.chat.completions.with_raw_response.create(
        model="selfspec-demo", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, temperature=0
    )
    stats = raw.parse().model_extra["selfspec"]
    headers = raw.headers
    for name in ("num_drafted", "num_accepted", "target_forwards"):
        assert int(headers[f"x-selfspec-{name.replace('_', '-')}"]) == stats[name]
    for name in ("mean_accepted_length", "acceptance_rate", "tokens_per_second"):
        assert float(headers[f"x-selfspec-{name.replace('_', '-')}"]) == pytest.approx(stats[name])
    histogram = headers["x-selfspec-accepted-length-histogram"]
    assert [int(n) for n in histogram.split(",")] == stats["accepted_length_histogram"]
    plan = demo_http.get("/health").json()["plan"]
    assert headers["x-selfspec-drafter"] == plan["drafter"] == demo_engine.config.drafter_name
    assert headers["x-selfspec-method"] == plan["method"]
    assert headers["x-selfspec-plan"] == plan["summary"]
    assert headers["x-selfspec-calibrated"] == json.dumps(plan["calibrated"])

    # streamed: the plan at the start, the statistics in the last chunk
    chunks, response = streamed(
        demo_http, "/v1/completions", {"model": "selfspec-demo", "prompt": "Once", "max_tokens": 6, "temperature": 0}
    )
    assert response.headers["x-selfspec-method"] == plan["method"]
    assert "x-selfspec-num-accepted" not in response.headers
    assert set(chunks[-1]["selfspec"]) >= {"num_drafted", "num_accepted", "mean_accepted_length"}


def test_health_reports_the_plan_and_startup_logs_it(demo_engine: Any, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="selfspec.serving.server"):
        with serve_in_background(demo_engine, model_id="selfspec-demo") as root:
            plan = httpx.get(f"{root}/health", timeout=30).json()["plan"]
    started = [r.getMessage() for r in caplog.records if r.name == "selfspec.serving.server"]
    assert sum("serving selfspec-demo: " in line for line in started) == 1
    assert plan["summary"] in started[0]
    engine_plan = demo_engine.plan
    assert engine_plan is not None  # the demo model is served with drafter="auto"
    assert plan["method"] == engine_plan.method and plan["settings"] == engine_plan.settings
    assert plan["predicted_speedup"] == engine_plan.predicted_speedup
    assert plan["calibrated"] is engine_plan.calibrated


def test_selfspec_serve_prints_the_plan_once_at_start() -> None:
    """The real command: the start-up line reaches the console through uvicorn's handler (and only once)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [sys.executable, "-m", "selfspec", "serve", "--model", "selfspec-demo", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([*command, "--threads", "1"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "selfspec serve did not start"
            time.sleep(0.2)
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    plan = health.json()["plan"]
    lines = [line for line in stderr.splitlines() if "serving selfspec-demo: " in line]
    assert len(lines) == 1 and lines[0].startswith("INFO:") and lines[0].endswith(plan["summary"]), stderr[-2000:]
