"""MkDocs hooks: publish the committed benchmark plots, and link repository files to GitHub.

- Every ``benchmarks/results/*.png`` becomes the site file ``assets/benchmarks/<name>.png``
  (no copy in ``docs/``), so pages link to ``assets/benchmarks/bench_cpu.png`` and
  ``mkdocs build --strict`` checks those links like any other.
- A relative link that leaves ``docs/`` (``../examples/llamaindex_rag.py``) works when the
  Markdown is read on GitHub but not in the built site. When its target exists in the
  repository, it is rewritten to the file's page under ``repo_url``; when it does not, the link
  is left alone and the strict build fails on it, as it should.
- Docstrings cite Python objects with Sphinx roles (``:class:`~selfspec.drafters.Drafter```),
  which the Google-style renderer leaves as text; they are shown as code (``Drafter``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SITE_FOLDER = "assets/benchmarks"
#: ``](../path)`` or ``](../path#anchor)`` in Markdown link syntax.
_OUTSIDE_LINK = re.compile(r"\]\((\.\./[^)\s#]+)(#[^)\s]*)?\)")
#: A Sphinx role as rendered from a docstring: ``:class:<code>~pkg.Name</code>``.
_SPHINX_ROLE = re.compile(r":(?:class|meth|func|mod|attr|obj|exc|data):<code>(~?)([^<]*)</code>")


def on_files(files: Files, config: Any) -> Files:
    """Add the benchmark plots to the site's files."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_FOLDER}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point links to repository files outside ``docs/`` at the repository's web pages."""
    repo_url = (config.get("repo_url") or "").rstrip("/")
    page_dir = (Path(config["docs_dir"]) / page.file.src_path).parent

    def rewrite(match: re.Match[str]) -> str:
        target = (page_dir / match.group(1)).resolve()
        if not repo_url or not target.exists() or ROOT not in target.parents:
            return match.group(0)
        kind = "tree" if target.is_dir() else "blob"
        return f"]({repo_url}/{kind}/main/{target.relative_to(ROOT).as_posix()}{match.group(2) or ''})"

    return _OUTSIDE_LINK.sub(rewrite, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    """Render Sphinx roles left in docstrings as code; ``~`` keeps the last dotted part only."""

    def code(match: re.Match[str]) -> str:
        name = match.group(2).split(".")[-1] if match.group(1) else match.group(2)
        return f"<code>{name}</code>"

    return _SPHINX_ROLE.sub(code, html)
