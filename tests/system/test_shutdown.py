"""``selfspec serve`` stops within its grace: SIGTERM under load, as its own process on loopback.

- The first SIGTERM: new connections are refused, queued requests get 503 ``shutting_down`` at
  once, running streams that outlive ``--shutdown-grace`` end with a ``shutting_down`` error event,
  and the process exits with status 0 within the grace plus 5 s.
- A second SIGTERM: the process exits at once (status 0).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from serve_process import wait_until_serving  # noqa: E402

MODEL = "selfspec-demo"
GRACE = 2.0
RUNNING = 2  # --max-concurrent: the requests that run
QUEUED = 3  # the requests waiting for a slot when the signal comes
#: Long enough to outlive the grace: 1,500 tokens take the demo model several seconds alone.
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0}


def _start() -> tuple[str, subprocess.Popen[str]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [sys.executable, "-m", "selfspec", "serve", "--model", MODEL, "--port", str(port), "--threads", "1"]
    command += ["--max-concurrent", str(RUNNING), "--max-queue", "8", "--shutdown-grace", str(GRACE)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return f"http://127.0.0.1:{port}", subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def servers() -> Iterator[list[tuple[str, subprocess.Popen[str]]]]:
    """Two servers, one per test (each test ends its own), started together to save time."""
    started = [_start() for _ in range(2)]
    try:
        for root, process in started:
            wait_until_serving(root, process)
        yield started
    finally:
        for _, process in started:
            if process.poll() is None:
                process.kill()
            process.communicate()


async def _stream(client: Any, started: asyncio.Event) -> list[dict[str, Any]]:
    """A long streamed completion's events (``started`` is set at its first text)."""
    events = []
    async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
                started.set()
            elif line == "data: [DONE]":
                events.append({"done": True})
    return events


async def _whole(client: Any) -> tuple[int, dict[str, Any], float]:
    response = await client.post("/v1/completions", json=LONG)
    return response.status_code, response.json(), time.monotonic()


def _exit_status(process: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
        pytest.fail(f"selfspec serve did not exit within {timeout:g} s: {stderr[-3000:]}")
    return process.returncode, stderr


@pytest.mark.slow
def test_sigterm_refuses_the_queue_bounds_the_running_and_exits_0(servers: list[tuple[str, Any]]) -> None:
    root, process = servers[0]

    async def load() -> tuple[float, list[list[dict[str, Any]]], list[tuple[int, dict[str, Any], float]]]:
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=root, timeout=60, limits=limits) as client:
            started = [asyncio.Event() for _ in range(RUNNING)]
            streams = [asyncio.ensure_future(_stream(client, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            queued = [asyncio.ensure_future(_whole(client)) for _ in range(QUEUED)]
            await asyncio.sleep(1.0)  # their bodies are read: they wait for a slot
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections
                await client.get("/health")
            return signalled, await asyncio.gather(*streams), await asyncio.gather(*queued)

    signalled, streams, queued = asyncio.run(load())
    status, stderr = _exit_status(process, GRACE + 5 - (time.monotonic() - signalled))
    exited = time.monotonic() - signalled
    answered = [round(at - signalled, 2) for *_, at in queued]
    print(f"\nqueued answered {answered} s after SIGTERM, exit after {exited:.1f} s")
    for code, body, at in queued:
        assert (code, body["error"]["code"]) == (503, "shutting_down")
        assert at - signalled < 1.0  # at once, not after the running ones
    for events in streams:  # cut off at the grace, with an error event, then [DONE]
        assert events[-1] == {"done": True} and events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert 0 < len(events) - 2 < LONG["max_tokens"]
    assert status == 0, stderr[-3000:]
    assert exited < GRACE + 5
    assert "Traceback" not in stderr, stderr[-3000:]


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once(servers: list[tuple[str, Any]]) -> None:
    root, process = servers[1]

    async def load() -> float:
        async with httpx.AsyncClient(base_url=root, timeout=60) as client:
            started = [asyncio.Event() for _ in range(RUNNING)]
            streams = [asyncio.ensure_future(_stream(client, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            second = time.monotonic()
            process.send_signal(signal.SIGTERM)
            await asyncio.gather(*streams, return_exceptions=True)  # cut off: the process has gone
            return second

    second = asyncio.run(load())
    status, stderr = _exit_status(process, 10)
    exited = time.monotonic() - second
    print(f"\nexit {exited:.2f} s after the second SIGTERM")
    assert status == 0, stderr[-3000:]
    assert exited < GRACE / 2  # well before the grace would have ended
    assert "second signal: exiting now" in stderr
