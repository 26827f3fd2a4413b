"""The server's admission control and its shutdown, and where ``selfspec serve`` reads its key (no model)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from selfspec.cli.serve import API_KEY_ENV, add_serve_parser, api_key
from selfspec.serving.server.limits import Admission
from selfspec.serving.server.protocol import APIError


async def _settle() -> None:
    """Let every task that can run, run (a handed-over slot takes a few loop turns to be used)."""
    for _ in range(5):
        await asyncio.sleep(0)


def _codes(results: list[object]) -> list[object]:
    return [result.code if isinstance(result, APIError) else result for result in results]


def test_closing_refuses_the_queue_and_later_requests_but_keeps_the_running_ones() -> None:
    async def scenario() -> None:
        admission = Admission(max_concurrent=2, max_queue=3, retry_after=1)
        await admission.enter()
        await admission.enter()  # two inside
        waiting = [asyncio.ensure_future(admission.enter()) for _ in range(3)]
        await asyncio.sleep(0)
        assert (admission.inside, admission.waiting) == (2, 3)
        with pytest.raises(APIError) as busy:  # the queue is full
            await admission.enter()
        assert (busy.value.status, busy.value.code) == (429, "server_busy")
        assert admission.close() == 3
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert _codes(results) == ["shutting_down"] * 3
        assert all(isinstance(error, APIError) and error.status == 503 for error in results)
        with pytest.raises(APIError, match="shutting down"):
            await admission.enter()
        assert (admission.inside, admission.waiting) == (2, 0)  # the running ones keep their slots
        admission.leave()
        admission.leave()
        assert admission.inside == 0

    asyncio.run(scenario())


def test_slots_go_first_come_first_served_and_a_cancelled_waiter_passes_its_slot_on() -> None:
    async def scenario() -> None:
        admission = Admission(max_concurrent=1, max_queue=4, retry_after=1)
        await admission.enter()
        order: list[int] = []

        async def wait(i: int) -> None:
            await admission.enter()
            order.append(i)

        waiters = [asyncio.ensure_future(wait(i)) for i in range(3)]
        await _settle()
        admission.leave()  # the slot is handed to waiter 0 ...
        waiters[0].cancel()  # ... which is cancelled before it runs: the slot goes on to waiter 1
        await _settle()
        assert order == [1] and admission.inside == 1 and admission.waiting == 1
        admission.leave()
        await _settle()
        assert order == [1, 2] and admission.inside == 1 and admission.waiting == 0
        admission.leave()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert admission.inside == 0

    asyncio.run(scenario())


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="selfspec")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", "--model", "m", *argv])


def test_the_key_comes_from_the_environment_and_a_key_on_the_command_line_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(_serve_args()) == "from-env"
    assert capsys.readouterr().err == ""  # the environment is the quiet way
    assert api_key(_serve_args("--api-key", "on-the-line")) == "on-the-line"  # the flag wins, with a warning
    err = capsys.readouterr().err
    assert err.startswith("selfspec: warning: --api-key is visible") and f"${API_KEY_ENV}" in err
    assert len(err.strip().splitlines()) == 1
    monkeypatch.setenv(API_KEY_ENV, "")
    assert api_key(_serve_args()) is None  # an empty variable is no key


def test_the_help_points_to_the_environment_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_args("--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"${API_KEY_ENV}" in help_text and "ps" in help_text
    assert "--shutdown-grace" in help_text and "(default: 30)" in help_text
