"""``selfspec serve``'s malloc settings: its own arena limit (unless ``MALLOC_ARENA_MAX`` is set), the idle trim."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from selfspec.core import memory
from selfspec.serving.server import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize("arenas", [0, -1, 1.5, True, "2"])
def test_a_bad_limit_is_refused(arenas: object) -> None:
    with pytest.raises(ValueError, match="arena limit"):
        allocator.limit_arenas(arenas)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0", "2", "8"])
def test_a_limit_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", value)
    assert allocator.limit_arenas(2) is None  # glibc read it at start-up; mallopt is not called


@pytest.mark.skipif(not GLIBC, reason="mallopt and malloc_trim are glibc's")
def test_the_limit_is_set_in_a_fresh_process_without_the_variable() -> None:
    # in a child process: the limit holds for the rest of a process, so not in the test runner's own
    # (importing the module pulls in neither torch nor the server, so the child starts in a fraction of a second)
    code = "import selfspec.serving.server.allocator as a; print(a.limit_arenas(), a.release_free_memory())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    limit, _ = result.stdout.split()
    assert int(limit) == allocator.ARENA_MAX


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(memory, "glibc", lambda: None)
    assert allocator.limit_arenas() is None
    assert allocator.release_free_memory() is False


def _wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


DELAY = 0.05


def test_idle_trims_once_per_idle_period() -> None:
    trim = allocator.IdleTrim(lambda: True, delay=DELAY)  # the real malloc_trim(0) (a no-op off glibc)
    trim.idle()
    assert _wait_for(lambda: trim.trims == 1)
    trim.idle()  # idle again without work in between: the same period
    time.sleep(DELAY * 4)
    assert trim.trims == 1
    trim.busy()
    trim.idle()
    assert _wait_for(lambda: trim.trims == 2)
    assert trim.seconds > 0


def test_work_within_the_delay_puts_the_trim_off() -> None:
    trim = allocator.IdleTrim(lambda: True, delay=DELAY * 4)
    for _ in range(5):  # requests one after another, gaps shorter than the delay: no trim between them
        trim.busy()
        trim.idle()
        time.sleep(DELAY)
    assert trim.trims == 0
    assert _wait_for(lambda: trim.trims == 1)  # then one, when the gap lasts
    trim.busy()
    trim.idle()
    trim.close()  # the server stops: the pending trim is dropped
    time.sleep(DELAY * 8)
    assert trim.trims == 1


def test_a_straggler_delays_the_trim_until_it_ends() -> None:
    running = threading.Event()
    running.set()
    trim = allocator.IdleTrim(lambda: not running.is_set(), delay=DELAY)
    trim.idle()
    time.sleep(DELAY * 5)
    assert trim.trims == 0  # a cancelled generation still finishing its round
    running.clear()
    assert _wait_for(lambda: trim.trims == 1)
    time.sleep(DELAY * 4)
    assert trim.trims == 1


def test_trimming_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_IDLE_TRIM", "0")
    assert not allocator.idle_trim_enabled()
    monkeypatch.setenv("SELFSPEC_IDLE_TRIM", "1")
    assert allocator.idle_trim_enabled()
    monkeypatch.delenv("SELFSPEC_IDLE_TRIM")
    assert allocator.idle_trim_enabled()
