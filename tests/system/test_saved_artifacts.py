"""A cache that cannot be written (``SELFSPEC_CACHE`` on a read-only folder): the work is kept, one warning says why.

Each test runs selfspec in a child process whose cache folder is really read-only: a read-only
bind mount in a private mount namespace when the tests run as root (where permissions do not
bind), the folder's permissions otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_calibration_saving import save_tiny_model

_BIND_READ_ONLY = 'mount --bind -o ro "$0" "$0" && exec "$@"'


@dataclass(frozen=True)
class ReadOnlyCache:
    """A cache folder and the command prefix under which it is read-only."""

    folder: Path
    prefix: list[str]
    reason: str  # the error text a write there gives


@pytest.fixture
def read_only_cache(tmp_path: Path) -> Iterator[ReadOnlyCache]:
    folder = tmp_path / "read-only-cache"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield ReadOnlyCache(folder, [], "Permission denied")
        finally:
            folder.chmod(0o755)
        return
    prefix = ["unshare", "-m", "sh", "-c", _BIND_READ_ONLY, str(folder)]
    probe = [*prefix, "sh", "-c", f"touch {folder}/probe"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        pytest.skip("running as root without a way to mount a read-only folder (unshare -m)")
    if (folder / "probe").exists():
        pytest.fail("the read-only mount did not hold")
    yield ReadOnlyCache(folder, prefix, "Read-only file system")


def _run(cache: ReadOnlyCache, *command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SELFSPEC_CACHE": str(cache.folder), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*cache.prefix, *command], capture_output=True, text=True, env=env, timeout=300, check=False)


def _unsaved_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "could not save" in line]


def test_generate_on_a_read_only_cache_exits_0_with_one_warning(tmp_path: Path, read_only_cache: ReadOnlyCache) -> None:
    model = save_tiny_model(tmp_path / "tiny")
    result = _run(
        read_only_cache,
        sys.executable, "-m", "selfspec", "generate", "--model", str(model),
        "--max-new-tokens", "8", "--calibration-budget", "5", "Hello",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), result.stderr[-2000:]
    lines = _unsaved_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-2000:]
    assert str(read_only_cache.folder) in lines[0] and "cpu-float32.json" in lines[0]
    assert read_only_cache.reason in lines[0] and "kept in memory for this process" in lines[0]
    assert "Traceback" not in result.stderr
    assert list(read_only_cache.folder.iterdir()) == []  # nothing written (not even a lock file)


_TWO_LOADS = """
import json, sys
import torch
torch.set_num_threads(1)
from selfspec import SpeculativeEngine
first = SpeculativeEngine.from_pretrained(sys.argv[1], calibration_budget=5)
second = SpeculativeEngine.from_pretrained(sys.argv[1], calibration_budget=5)
print(json.dumps([first.plan.summary(), second.plan.summary(), first.plan.calibrated]))
"""


def test_the_engine_keeps_a_first_load_plan_it_cannot_save_for_the_process(
    tmp_path: Path, read_only_cache: ReadOnlyCache
) -> None:
    """Two loads in one process: one measurement, one warning; the second load uses the first's plan."""
    model = save_tiny_model(tmp_path / "tiny")
    result = _run(read_only_cache, sys.executable, "-c", _TWO_LOADS, str(model))
    assert result.returncode == 0, result.stderr[-2000:]
    first, second, calibrated = json.loads(result.stdout.strip().splitlines()[-1])
    assert calibrated and first == second
    assert sum("first load of" in line for line in result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert len(_unsaved_lines(result.stderr)) == 1, result.stderr[-2000:]
