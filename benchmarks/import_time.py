"""Import time of each adapter, measured in fresh interpreters (issue 19: each under 1 s).

For each module the script starts ``--repeats`` new Python processes (interleaved across the
modules) that import it and report the wall time of the import statement alone (interpreter
start-up excluded), then keeps the median. The frameworks themselves (``langchain_core``'s
chat-model base, ``llama_index.core``'s LLM base) are measured the same way, so the adapter's own
share is the difference. Heavy parts
(torch, transformers, the engine, the ``openai`` client) are imported on first use, not here;
``selfspec.decoding.engine`` is measured too, as the cost of that first use.

    python benchmarks/import_time.py            # writes benchmarks/results/import_time.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
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
    "selfspec (core)": "selfspec",
    "selfspec.SpeculativeEngine (first use: torch, transformers)": "selfspec.decoding.engine",
}
#: Adapter -> its framework, for the adapter's own share.
FRAMEWORKS = {
    "langchain_selfspec (adapter)": "langchain_core (framework)",
    "llama_index.llms.selfspec (adapter)": "llama_index.core (framework)",
}
PROBE = (
    "import json, sys, time; t = time.perf_counter(); import {module}; "
    "print(json.dumps([time.perf_counter() - t, 'torch' in sys.modules]))"
)


def import_once(module: str) -> tuple[float, bool]:
    """Wall seconds of ``import module`` in a fresh interpreter, and whether it imported torch."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True, check=True
    ).stdout
    seconds, imported_torch = json.loads(out.strip().splitlines()[-1])
    return float(seconds), bool(imported_torch)


def load_average() -> str:
    """The machine's load average (1, 5, 15 minutes), to judge how noisy the timings are."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = {}
    load_before = load_average()
    runs: dict[str, list[float]] = {label: [] for label in MODULES}
    torch: dict[str, bool] = dict.fromkeys(MODULES, False)
    for _ in range(args.repeats):  # interleaved, so that a change of load hits every module alike
        for label, module in MODULES.items():
            seconds, imported_torch = import_once(module)
            runs[label].append(seconds)
            torch[label] = torch[label] or imported_torch
    for label, module in MODULES.items():
        times = runs[label]
        rows[label] = {"module": module, "median_s": statistics.median(times), "min_s": min(times),
                       "max_s": max(times), "imports_torch": torch[label], "runs": times}
        print(f"{label:40s} median {rows[label]['median_s']:.3f} s  (min {min(times):.3f}, max {max(times):.3f})")
    shares = {
        adapter: round(rows[adapter]["median_s"] - rows[framework]["median_s"], 3)
        for adapter, framework in FRAMEWORKS.items()
    }
    result = {"repeats": args.repeats, "python": platform.python_version(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_average(),
              "target_s": 1.0, "modules": rows, "adapter_own_share_s": shares}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "import_time.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Import time of the adapters",
        "",
        f"Median of {args.repeats} fresh interpreters, import statement only (`benchmarks/import_time.py`); "
        f"target: each adapter under 1 s. {os.cpu_count()} CPUs, load average {load_before} before and "
        f"{result['load_average_after']} after (shared machine: timings are noisy).",
        "",
        "| module | median (s) | min (s) | max (s) | imports torch |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    lines += [f"| `{r['module']}` ({label.split('(', 1)[1][:-1]}) | {r['median_s']:.3f} | {r['min_s']:.3f} | "
              f"{r['max_s']:.3f} | {'yes' if r['imports_torch'] else 'no'} |" for label, r in rows.items()]
    lines += ["", "The adapter's own share (its median minus its framework's):", ""]
    lines += [f"- `{rows[adapter]['module']}`: {share:.3f} s" for adapter, share in shares.items()]
    (RESULTS / "import_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
