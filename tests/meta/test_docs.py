"""The documentation works: every Python block runs, and the site builds with ``--strict``.

Code blocks are extracted from ``docs/*.md`` (and ``README.md``, if it has Python blocks): a
fenced block whose info string starts with ``python`` or ``py`` runs, unless the line before
its fence is an HTML comment ``<!-- no-run: why -->`` (for code that needs a GPU, a network or a
server). The blocks of one page run in order in one fresh namespace, offline, on the bundled
demo model; they keep generations short (``max_new_tokens <= 32``), which a test checks too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [p for p in (ROOT / "README.md",) if p.is_file()]
RUNNABLE = {"python", "py"}
MAX_NEW_TOKENS = 32

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run\b")
_MAX_NEW_TOKENS = re.compile(r"max_(?:new_)?tokens\s*=\s*(\d+)")
#: Pages written with their own packages (and the README): they run, but keep their own lengths.
LENGTH_EXEMPT = {"langchain.md", "llamaindex.md", "README.md"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    no_run: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced code block of a Markdown page, with its language and no-run marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    previous = ""  # the last non-blank line before the current one
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            if lines[i].strip():
                previous = lines[i]
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        words = match["info"].replace("{", " ").replace(".", " ", 1).split()
        language = words[0].lower() if words else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            stripped = lines[j].strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append(Block(page, i + 1, language, "\n".join(body) + "\n", bool(_NO_RUN.match(previous))))
        previous = lines[j] if j < len(lines) else ""
        i = j + 1
    return blocks


def runnable_blocks(page: Path) -> list[Block]:
    return [b for b in code_blocks(page) if b.language in RUNNABLE and not b.no_run]


PAGES_WITH_CODE = [p for p in PAGES if runnable_blocks(p)]


def test_the_extractor_sees_every_page() -> None:
    assert (DOCS / "index.md") in PAGES_WITH_CODE, "the quickstart must have runnable code"
    assert all(b.no_run for b in code_blocks(DOCS / "scaling.md") if b.language in RUNNABLE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_markers_sit_on_a_code_block(page: Path) -> None:
    """A ``<!-- no-run -->`` comment must be the line right before a fence, or it skips nothing."""
    lines = page.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if _NO_RUN.match(line):
            following = next((n for n in lines[number:] if n.strip()), "")
            assert _FENCE.match(following), f"{page.name}:{number}: no-run marker not followed by a code fence"


@pytest.mark.parametrize(
    "page", [p for p in PAGES_WITH_CODE if p.name not in LENGTH_EXEMPT], ids=lambda p: str(p.relative_to(ROOT))
)
def test_generations_in_docs_stay_short(page: Path) -> None:
    for block in runnable_blocks(page):
        for tokens in _MAX_NEW_TOKENS.findall(block.code):
            assert int(tokens) <= MAX_NEW_TOKENS, f"{block.where}: max_new_tokens={tokens} > {MAX_NEW_TOKENS}"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_runs(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a page's Python blocks in order, in one namespace, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(ROOT)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for block in runnable_blocks(page):
        try:
            exec(compile(block.code, block.where, "exec"), namespace)
        except Exception:  # noqa: BLE001 - report which block failed, with its code
            pytest.fail(f"code block at {block.where} failed:\n{block.code}\n{traceback.format_exc()}")


def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: broken links, anchors, snippets or API references fail it."""
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if not _importable(m)]
    if missing:
        pytest.skip(f"docs dependencies not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("SpeculativeEngine", "GenerationOutput", "GenerationStats", "GenerationStream", "get_engine"):
        assert name in api, f"{name} is missing from the API reference"
    for png in (ROOT / "benchmarks" / "results").glob("*.png"):
        assert (site / "assets" / "benchmarks" / png.name).is_file(), f"{png.name} was not published"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
