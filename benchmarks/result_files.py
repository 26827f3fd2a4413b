"""A benchmark's result written as ``<out>.json`` and ``<out>.md`` (atomic files), the Markdown printed too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfspec.artifacts import atomic_write_text


def write_result(out: str | Path, result: dict[str, Any], markdown: str) -> None:
    """Write ``result`` beside its Markdown rendering and print the Markdown."""
    out = Path(out)
    atomic_write_text(out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    atomic_write_text(out.with_suffix(".md"), markdown)
    print(markdown)
