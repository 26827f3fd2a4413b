"""``selfspec serve`` as its own process on loopback, under hostile load.

- Three concurrent 5 MB bodies: each refused (413) in under 100 ms, server RSS grows < 50 MB.
- Three concurrent prompts of 1.9 MB (under the body limit, over what the context window can
  hold): each refused (400) before tokenizing, RSS grows < 50 MB.
- 64 concurrent mixed requests (streamed and not, chat and text, clients that disconnect at
  random, oversized bodies) within 60 s: no 500, every completed greedy text equal to the text
  the engine gives alone, server RSS growth under ``LOAD_RSS_BOUND_MB``.
- A warm-up burst, then ``BURSTS`` bursts of ``BURST_SIZE`` concurrent mixed requests with a pause
  between them: the server trims its allocator once in each pause (``selfspec_malloc_trims_total``),
  and its RSS after the last burst is within ``BURST_RSS_BOUND_MB`` of the RSS after the warm-up.

Traffic goes to 127.0.0.1 only. The server is a real ``python -m selfspec serve`` process, so
its resident memory is measured alone (``/proc/<pid>/status``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_process import wait_until_serving  # noqa: E402

MODEL = "selfspec-demo"
PROMPTS = [
    "It is a truth universally acknowledged",
    "The sea was calm that morning",
    "Once upon a time",
    "My dear Elizabeth",
    "The captain looked at the map",
    "In the garden there was",
    "She had never seen",
    "The letter arrived on",
]
NEW_TOKENS = 12
#: The most the server's resident memory may grow over the 64-request load (after a warm-up).
LOAD_RSS_BOUND_MB = 100
#: Bursts of concurrent requests after the warm-up burst, and requests per burst.
BURSTS, BURST_SIZE = 3, 40
#: The most the server's resident memory may grow from the warm-up burst to the last burst, with the
#: server's own allocator settings: measured 13 and 19 MB over the three bursts (2 shared cores, load
#: 7.8-8.7); benchmarks/results/serve_rss_cpu.md has the settings compared on bursts of 100.
BURST_RSS_BOUND_MB = 45
#: Seconds the server waits once idle before it trims (``allocator.IDLE_TRIM_DELAY``); the test waits
#: at most ten times this for each trim.
BURST_SETTLE_S = 0.5
FIVE_MB = 5 * 10**6


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("RSS is read from /proc (Linux)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [sys.executable, "-m", "selfspec", "serve", "--model", MODEL, "--port", str(port), "--threads", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([*command, "--log-level", "warning"], env=env, stderr=subprocess.PIPE, text=True)
    root = f"http://127.0.0.1:{port}"
    wait_until_serving(root, process)
    try:
        yield root, process.pid
    finally:
        process.terminate()
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
        # never a traceback in the server's log: refusals and disconnects are not errors
        assert "Traceback" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def solo(demo_engine: Any) -> dict[tuple[str, str], str]:
    """The greedy text of each prompt (as text and as a chat turn), from the engine alone."""
    texts = {}
    for prompt in PROMPTS:
        texts[("text", prompt)] = demo_engine.generate(prompt, max_new_tokens=NEW_TOKENS).text
        messages = [{"role": "user", "content": prompt}]
        texts[("chat", prompt)] = demo_engine.generate(messages, max_new_tokens=NEW_TOKENS).text
    return texts


def _concurrently(count: int, call: Any) -> list[Any]:
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        results[i] = call(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _metrics(root: str) -> str:
    return httpx.get(f"{root}/metrics", timeout=10).text


@pytest.mark.slow
def test_three_5mb_bodies_are_refused_at_once(server: tuple[str, int], solo: dict[tuple[str, str], str]) -> None:
    root, pid = server
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * FIVE_MB}]}).encode()
    clients = [httpx.Client(base_url=root, timeout=30) for _ in range(3)]
    for client in clients:  # connected before the clock starts
        client.get("/health")
    before = _rss_mb(pid)

    def post(i: int) -> tuple[int, float]:
        started = time.perf_counter()
        response = clients[i].post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        return response.status_code, time.perf_counter() - started

    results = _concurrently(3, post)
    time.sleep(0.2)
    growth = _rss_mb(pid) - before
    for client in clients:
        client.close()
    print(f"\n3 x 5 MB: {[f'{s}: {t * 1000:.1f} ms' for s, t in results]}, RSS +{growth:.1f} MB")
    assert [status for status, _ in results] == [413] * 3
    assert max(seconds for _, seconds in results) < 0.1
    assert growth < 50

    # under the body limit, over the context window: refused before tokenizing, memory untouched
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_900_000}]}).encode()
    before = _rss_mb(pid)

    def post_big(i: int) -> tuple[int, float, str]:
        started = time.perf_counter()
        with httpx.Client(base_url=root, timeout=30) as client:
            response = client.post("/v1/chat/completions", content=big, headers={"Content-Type": "application/json"})
        return response.status_code, time.perf_counter() - started, response.json()["error"]["code"]

    results_big = _concurrently(3, post_big)
    time.sleep(0.2)
    growth_big = _rss_mb(pid) - before
    print(f"3 x 1.9 MB prompts: {[f'{s}: {t * 1000:.1f} ms' for s, t, _ in results_big]}, RSS +{growth_big:.1f} MB")
    assert [(status, code) for status, _, code in results_big] == [(400, "context_length_exceeded")] * 3
    assert max(seconds for _, seconds, _ in results_big) < 1.0
    assert growth_big < 50
    # and the server answers the next request with the engine's text
    reply = httpx.post(
        f"{root}/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert reply.json()["choices"][0]["text"] == solo[("text", PROMPTS[0])]


@pytest.mark.slow
def test_sixteen_huge_schemas_and_tools_at_once(server: tuple[str, int], solo: dict[tuple[str, str], str]) -> None:
    """Issue 29: eight 1.6 MB schemas (an enum of 20,000 strings) and eight 2 MB tools (19,000 property
    names of 96 characters) at once: each refused (400 ``invalid_schema``) in under a second, before
    rendering, tokenizing or compiling, and the server's memory stays flat."""
    from test_serving_server import BIG_ENUM, BIG_TOOL

    root, pid = server
    schema_body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": BIG_ENUM}},
    }
    tool_body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [BIG_TOOL]}
    bodies = [json.dumps(schema_body if i % 2 else tool_body).encode() for i in range(16)]
    assert all(1_500_000 < len(body) < 2 * 2**20 for body in bodies)
    clients = [httpx.Client(base_url=root, timeout=30) for _ in range(16)]
    for client in clients:  # connected before the clock starts
        client.get("/health")
    clients[0].post("/v1/chat/completions", content=bodies[0], headers={"Content-Type": "application/json"})
    before, cpu_before = _rss_mb(pid), _cpu_seconds(pid)

    def post(i: int) -> tuple[int, float, str]:
        started = time.perf_counter()
        headers = {"Content-Type": "application/json"}
        response = clients[i].post("/v1/chat/completions", content=bodies[i], headers=headers)
        return response.status_code, time.perf_counter() - started, response.json()["error"]["code"]

    started = time.perf_counter()
    results = _concurrently(16, post)
    wall = time.perf_counter() - started
    cpu = _cpu_seconds(pid) - cpu_before
    health_started = time.perf_counter()
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200
    health = time.perf_counter() - health_started
    time.sleep(0.2)
    growth = _rss_mb(pid) - before
    for client in clients:
        client.close()
    times = sorted(seconds for _, seconds, _ in results)
    print(
        f"\n16 huge schemas/tools at once: wall {wall:.2f} s, each {times[0] * 1000:.0f}-{times[-1] * 1000:.0f} ms "
        f"(median {times[8] * 1000:.0f}), server CPU {cpu:.2f} s, /health after {health * 1000:.0f} ms, RSS "
        f"+{growth:.1f} MB, load {os.getloadavg()[0]:.1f}"
    )
    assert [(status, code) for status, _, code in results] == [(400, "invalid_schema")] * 16
    assert cpu < 16 * 0.25  # no rendering, tokenizing or compiling: was 56 s of server CPU (issue 29)
    # under a second each on an idle machine; a machine shared by other jobs stretches wall time
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    assert times[-1] < 1.0 * busy and health < 1.0 * busy
    assert growth < 100
    reply = httpx.post(
        f"{root}/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert reply.json()["choices"][0]["text"] == solo[("text", PROMPTS[0])]


KINDS = ["text", "text-stream", "chat", "chat-stream", "drop-stream", "drop-wait", "oversized"]


async def _one(client: Any, kind: str, prompt: str, rng: random.Random) -> tuple[str, str, int, str | None]:
    """One request of the mix: (kind, prompt, status, text or None when the client left)."""
    chat = kind.startswith("chat")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind == "oversized":
        body["prompt"] = "x" * (3 * 2**20)
        response = await client.post(path, json=body)
        return kind, prompt, response.status_code, None
    if kind == "drop-wait":  # a client that gives up before the answer
        try:
            response = await client.post(path, json={**body, "max_tokens": 400}, timeout=rng.uniform(0.05, 1.0))
            return kind, prompt, response.status_code, None
        except httpx.TimeoutException:
            return kind, prompt, 0, None
    if kind.endswith("stream"):
        body["stream"] = True
        if kind == "drop-stream":
            body["max_tokens"] = 400
        pieces = []
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return kind, prompt, response.status_code, await response.aread() and None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                for choice in event["choices"]:
                    pieces.append(choice["delta"].get("content") or "" if chat else choice["text"])
                if kind == "drop-stream" and len(pieces) >= rng.randint(1, 4):
                    return kind, prompt, response.status_code, None  # leaves mid-stream
        return kind, prompt, response.status_code, "".join(pieces)
    response = await client.post(path, json=body)
    if response.status_code != 200:
        return kind, prompt, response.status_code, None
    choice = response.json()["choices"][0]
    return kind, prompt, 200, choice["message"]["content"] if chat else choice["text"]


@pytest.mark.slow
def test_64_concurrent_mixed_requests(server: tuple[str, int], solo: dict[tuple[str, str], str]) -> None:
    root, pid = server
    rng = random.Random(18)
    plan = [(KINDS[i % len(KINDS)], PROMPTS[rng.randrange(len(PROMPTS))]) for i in range(64)]

    async def load() -> list[tuple[str, str, int, str | None]]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=root, timeout=60, limits=limits) as client:
            for prompt in PROMPTS[:2]:  # warm-up, then the baseline
                await _one(client, "text", prompt, rng)
            return await asyncio.gather(*(_one(client, kind, prompt, rng) for kind, prompt in plan))

    before = _rss_mb(pid)
    started = time.monotonic()
    results = asyncio.run(load())
    elapsed = time.monotonic() - started
    time.sleep(0.5)
    growth = _rss_mb(pid) - before
    statuses: dict[str, list[int]] = {}
    for kind, _, status, _ in results:
        statuses.setdefault(kind, []).append(status)
    print(f"\n64 mixed requests in {elapsed:.1f} s, RSS +{growth:.1f} MB, statuses {statuses}")
    assert elapsed < 60
    assert all(status != 500 for _, _, status, _ in results)
    assert statuses["oversized"] == [413] * len(statuses["oversized"])
    completed = 0
    for kind, prompt, status, text in results:
        if kind in ("text", "text-stream", "chat", "chat-stream"):
            assert status == 200, (kind, status)
            assert text == solo[("chat" if kind.startswith("chat") else "text", prompt)], (kind, prompt)
            completed += 1
    assert completed == sum(kind in ("text", "text-stream", "chat", "chat-stream") for kind, _ in plan)
    assert growth < LOAD_RSS_BOUND_MB
    # the abandoned generations were cancelled and counted, none as a 500; the server still answers exactly
    deadline = time.monotonic() + 30
    while "selfspec_generations_running 0" not in (metrics := _metrics(root)) and "running 0.0" not in metrics:
        assert time.monotonic() < deadline, metrics
        time.sleep(0.1)
    assert 'status="500"' not in metrics and 'finish_reason="cancelled"' in metrics
    reply = httpx.post(
        f"{root}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS[3]}],
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
        },
        timeout=60,
    )
    assert reply.json()["choices"][0]["message"]["content"] == solo[("chat", PROMPTS[3])]


def _trims(root: str) -> float:
    """``selfspec_malloc_trims_total`` of the server."""
    for line in _metrics(root).splitlines():
        if line.startswith("selfspec_malloc_trims_total "):
            return float(line.split()[1])
    raise AssertionError("no selfspec_malloc_trims_total in /metrics")


@pytest.mark.slow
def test_bursts_do_not_grow_memory(server: tuple[str, int], solo: dict[tuple[str, str], str]) -> None:
    """Issue 44: RSS grew 70-100 MB per burst of 100 requests; the server now caps arenas and trims when idle."""
    root, pid = server
    rng = random.Random(44)
    kinds = [kind for kind in KINDS if kind != "oversized"]

    async def burst() -> list[tuple[str, str, int, str | None]]:
        limits = httpx.Limits(max_connections=BURST_SIZE + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=root, timeout=60, limits=limits) as client:
            plan = [(kinds[i % len(kinds)], PROMPTS[rng.randrange(len(PROMPTS))]) for i in range(BURST_SIZE)]
            return await asyncio.gather(*(_one(client, kind, prompt, rng) for kind, prompt in plan))

    def settled(trims: float) -> float:
        """Wait for the trim of the pause that has begun (``trims`` + 1), then return the RSS."""
        deadline = time.monotonic() + BURST_SETTLE_S * 10
        while _trims(root) < trims + 1:
            assert time.monotonic() < deadline, "the server did not trim once idle"
            time.sleep(0.1)
        return _rss_mb(pid)

    time.sleep(4 * BURST_SETTLE_S)  # the trim after the previous test's last request is done
    started = time.monotonic()
    count = _trims(root)
    asyncio.run(burst())  # the warm-up: the first concurrent generations of a process allocate caches
    warm = settled(count)
    trims_before = _trims(root)
    after = []
    for _ in range(BURSTS):
        count = _trims(root)
        results = asyncio.run(burst())
        after.append(settled(count))
        assert all(status != 500 for _, _, status, _ in results)
        for kind, prompt, status, text in results:
            if kind in ("text", "text-stream", "chat", "chat-stream"):
                assert status == 200 and text == solo[("chat" if kind.startswith("chat") else "text", prompt)]
    trims = _trims(root) - trims_before
    elapsed = time.monotonic() - started
    shown = ", ".join(f"{rss:.0f}" for rss in after)
    load = os.getloadavg()[0]
    print(f"\n{BURSTS} bursts of {BURST_SIZE} in {elapsed:.1f} s: RSS {warm:.0f} -> {shown} MB, {trims:.0f} trims, "
          f"load {load:.1f}")  # fmt: skip
    assert trims == BURSTS  # once per idle period: each pause, never during a burst (that would be 2 a pause)
    assert after[-1] - warm < BURST_RSS_BOUND_MB
    assert elapsed < 60
