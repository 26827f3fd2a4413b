"""Import time of each adapter, measured in fresh interpreters (issue 19: each under 1 s).

For each module the script starts ``--repeats`` new Python processes that import it and report
the wall time of the import statement alone (interpreter start-up excluded), then keeps the
median. The frameworks themselves (``langchain_core``'s chat-model base, ``llama_index.core``'s
LLM base) are measured the same way, so the adapter's own share is the difference. Heavy parts
(torch, transformers, the engine, the ``openai`` client) are imported on first use, not here.

    python benchmarks/import_time.py            # writes benchmarks/results/import_time.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODULES = {
    "langchain_core (framework)": "langchain_core.language_models.chat_models",
    "langchain_selfspec (adapter)": "langchain_selfspec",
    "llama_index.core (framework)": "llama_index.core.llms.function_calling",
    "llama_index.llms.selfspec (adapter)": "llama_index.llms.selfspec",
    "selfspec (core, loads torch)": "selfspec",
}
PROBE = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def import_seconds(module: str, repeats: int) -> list[float]:
    """Wall seconds of ``import module`` in ``repeats`` fresh interpreters."""
    times = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, check=True
        ).stdout
        times.append(float(out.strip().splitlines()[-1]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = {}
    for label, module in MODULES.items():
        times = import_seconds(module, args.repeats)
        rows[label] = {"module": module, "median_s": statistics.median(times), "min_s": min(times),
                       "max_s": max(times), "runs": times}
        print(f"{label:40s} median {rows[label]['median_s']:.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    result = {"repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine(),
              "target_s": 1.0, "modules": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "import_time.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Import time of the adapters",
        "",
        f"Median of {args.repeats} fresh interpreters, import statement only (`benchmarks/import_time.py`); "
        "target: each adapter under 1 s.",
        "",
        "| module | median (s) | min (s) | max (s) |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| `{r['module']}` ({label.split('(')[1][:-1]}) | {r['median_s']:.3f} | {r['min_s']:.3f} | "
              f"{r['max_s']:.3f} |" for label, r in rows.items()]
    (RESULTS / "import_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
