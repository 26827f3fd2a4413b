"""MkDocs hooks: publish the committed benchmark plots without copying them into ``docs/``.

Every ``benchmarks/results/*.png`` becomes the site file ``assets/benchmarks/<name>.png``, so
pages link to it as ``assets/benchmarks/bench_cpu.png`` and ``mkdocs build --strict`` checks
those links like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SITE_FOLDER = "assets/benchmarks"


def on_files(files: Files, config: Any) -> Files:
    """Add the benchmark plots to the site's files."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_FOLDER}/{png.name}", abs_src_path=str(png)))
    return files
