"""Time `make demo` as a new user runs it: a fresh clone, an empty selfspec cache, phase by phase.

Clones this repository's committed ``HEAD`` into a temporary folder, points ``SELFSPEC_CACHE`` at an
empty one (so the model is fetched, converted and calibrated as on a first run; pip's own cache and
the machine's package index are left as they are: say so when you quote the figure), runs
``make demo`` there and stamps every line of its output with the seconds since the start. The
phases are cut at the lines the demo prints when each starts:

- ``setup``: the virtual environment and pip (up to the demo script's start);
- ``fetch``: imports and the model's download (up to ``loading ...``);
- ``convert``: the GGUF file dequantized once (up to the calibration's first line);
- ``calibrate``: the thread choice and first-load calibration (up to ``answering: ...``);
- ``answer``: the untimed call on each side and the interleaved timing rounds (to the end).

Writes ``first_run_cpu.json`` and ``first_run_cpu.md`` (and appends the run; earlier runs are
kept) under ``benchmarks/results/``::

    python benchmarks/first_run.py --label "after: one GGUF parse, pip --no-compile"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from selfspec.artifacts import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: Where each phase ends: the first output line that matches (in order).
PHASE_ENDS = (
    ("setup", re.compile(r"benchmarks/real_demo\.py$")),
    ("fetch", re.compile(r"loading \S+ \(a first run")),
    ("convert", re.compile(r"first load of \S+ on .*: measuring")),
    ("calibrate", re.compile(r"^answering: ")),
)
#: The demo's own lines kept in the record (what a user reads at the end).
KEPT = re.compile(r"^(plan|plain|speculative|speedup|identical text|calibrated .*|demo took .*):?")


def run_demo(clone: Path, cache: Path, timeout: float) -> tuple[list[tuple[float, str]], int, float]:
    """``make demo`` in ``clone``: its output lines with their times, the exit status and the wall seconds."""
    env = {**os.environ, "SELFSPEC_CACHE": str(cache)}
    started = time.perf_counter()
    process = subprocess.Popen(
        ["make", "demo"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []
    assert process.stdout is not None
    for raw in process.stdout:
        for line in raw.replace("\r", "\n").splitlines():
            if line.strip():
                lines.append((time.perf_counter() - started, line.strip()))
    status = process.wait(timeout=timeout)
    return lines, status, time.perf_counter() - started


def phases_of(lines: list[tuple[float, str]], total: float) -> dict[str, float]:
    """Seconds per phase, cut at :data:`PHASE_ENDS` (a phase whose end line never came is left out)."""
    out: dict[str, float] = {}
    start = 0.0
    position = 0
    for name, pattern in PHASE_ENDS:
        found = next(((i, t) for i, (t, line) in enumerate(lines[position:], position) if pattern.search(line)), None)
        if found is None:
            return out
        position, end = found
        out[name] = round(end - start, 1)
        start = end
    out["answer"] = round(total - start, 1)
    return out


def render(results: dict[str, Any]) -> str:
    """The markdown table of every run recorded."""
    rows = [
        "# `make demo` from a fresh clone, phase by phase",
        "",
        "`benchmarks/first_run.py`: a clone of the committed tree, an empty `SELFSPEC_CACHE` (the model is",
        "fetched, converted and calibrated as on a first run), `make demo`, each output line stamped. pip's",
        "cache and this machine's local package index are as they were (torch comes from a local wheel), so",
        "`setup` is the install, not a download. Seconds; the load average is the machine's before and after.",
        "",
        "| run | total | setup | fetch | convert | calibrate | answer | load before / after | speedup | identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in results.items():
        p = run["phases"]
        rows.append(
            f"| {label} | **{run['seconds']:.0f}** | {p.get('setup', '-')} | {p.get('fetch', '-')} | "
            f"{p.get('convert', '-')} | {p.get('calibrate', '-')} | {p.get('answer', '-')} | "
            f"{run['load_before'][0]:.2f} / {run['load_after'][0]:.2f} | {run.get('speedup', '-')} | "
            f"{run.get('identical', '-')} |"
        )
    rows += ["", "The demo's closing lines of the latest run:", "", "```text"]
    rows += list(results[list(results)[-1]]["closing"])
    rows += ["```", ""]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the run's name in the results")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "first_run_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="selfspec-first-run-") as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "cache"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True, check=True
        ).stdout.strip()
        load_before = os.getloadavg()
        lines, status, seconds = run_demo(clone, cache, args.timeout)
        load_after = os.getloadavg()
        shutil.rmtree(clone / ".venv", ignore_errors=True)
    said = {line.split(":")[0]: line.split(":", 1)[1].strip() for _, line in lines if ":" in line}
    run = {
        "commit": commit,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "exit_status": status,
        "seconds": round(seconds, 1),
        "phases": phases_of(lines, seconds),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "speedup": said.get("speedup"),
        "identical": said.get("identical text"),
        "closing": [line for _, line in lines if KEPT.match(line)],
    }
    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else {}
    results[args.label] = run
    atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), render(results))
    print(json.dumps({k: v for k, v in run.items() if k != "closing"}, indent=1))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
