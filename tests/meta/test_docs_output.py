"""The console output the adapter docs show is what the examples print now (issue 19, item 7).

``docs/langchain.md`` and ``docs/llamaindex.md`` show a run of ``examples/langchain_chain.py``
and ``examples/llamaindex_rag.py``. Each such ``console`` block is compared with a fresh run of
its command, line by line, after blanking what varies from run to run on a shared machine
(seconds, tokens per second, draft statistics, call ids); the text, the token counts, the tool
calls and the structured output must match.
"""

from __future__ import annotations

import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "langchain.md", ROOT / "docs" / "llamaindex.md"]
_COMMAND = re.compile(r"^\$ (?:HF_HUB_OFFLINE=1 )?python (examples/\S+\.py)(.*)$")
#: Lines whose numbers vary with the machine's load (timings, the adaptive draft statistics).
_VARYING = ("tokens_per_second", "tokens/s", "speculation:")


def console_runs(page: Path) -> list[tuple[str, list[str], list[str]]]:
    """``(script, arguments, shown output lines)`` for every console block that runs an example."""
    runs = []
    blocks = re.findall(r"```console\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    for block in blocks:
        lines = block.rstrip("\n").splitlines()
        match = _COMMAND.match(lines[0]) if lines else None
        if match is not None:
            runs.append((match.group(1), shlex.split(match.group(2)), lines[1:]))
    return runs


def normalized(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if any(word in line for word in _VARYING):
            continue
        line = re.sub(r"\(\d+(\.\d+)?s\)", "(…s)", line)
        line = re.sub(r"call_[0-9a-f]{8,}", "call_…", line)
        out.append(line.rstrip())
    while out and not out[-1]:
        out.pop()
    return out


CASES = [(page.name, *run) for page in PAGES for run in console_runs(page)]


def test_both_pages_show_a_run() -> None:
    assert {case[1] for case in CASES} == {"examples/langchain_chain.py", "examples/llamaindex_rag.py"}


@pytest.mark.slow
@pytest.mark.parametrize(("page", "script", "arguments", "shown"), CASES, ids=[c[1] for c in CASES])
def test_shown_output_matches_a_run(
    page: str, script: str, arguments: list[str], shown: list[str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from llama_index.core import Settings

    monkeypatch.setattr(sys, "argv", [script, *arguments])
    previous = Settings._llm, Settings._embed_model
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    finally:
        Settings._llm, Settings._embed_model = previous
    printed = capsys.readouterr().out.splitlines()
    assert normalized(printed) == normalized(shown), f"{page} shows output that {script} no longer prints"
