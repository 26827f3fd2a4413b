"""``selfspec serve``'s malloc settings: the arena limit it sets itself, unless ``MALLOC_ARENA_MAX`` is set."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

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
    # the module alone (standard library only), so the child starts in milliseconds
    code = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('allocator', sys.argv[1]); "
        "a = u.module_from_spec(s); s.loader.exec_module(a); print(a.limit_arenas(), a.release_free_memory())"
    )
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    command = [sys.executable, "-S", "-c", code, allocator.__file__]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    limit, _ = result.stdout.split()
    assert int(limit) == allocator.ARENA_MAX


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert allocator.limit_arenas() is None
    assert allocator.release_free_memory() is False
