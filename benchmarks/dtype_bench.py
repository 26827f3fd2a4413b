"""SmolLM2 in both regimes, float32 and bfloat16, side by side (issue 28 item 4).

For each dtype: an empty calibration cache (so ``auto`` measures this machine's verify-cost curve
in that dtype on first load, with the default budget), then ``selfspec bench`` with the plain
loop, ``auto`` (greedy and T=0.7), prompt lookup and transformers' ``generate`` interleaved, one
thread. Each dtype's report (JSON, markdown, PNG) is written as soon as it is done, then a
summary ``smollm2_dtypes.md`` puts the two side by side: the verify-cost curve, tokens/s, tau,
speedups per category and whether every greedy output equals the same dtype's plain loop and
``generate``.

    PYTHONPATH=src python benchmarks/dtype_bench.py [--repeats 3] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def run(dtype: str, repeats: int, max_new_tokens: int) -> dict[str, Any]:
    from selfspec.calibration.bench import run_benchmark, write_report

    report = run_benchmark(
        "smollm2-135m-instruct",
        dtype=dtype,
        methods=["plain", "auto", "prompt_lookup"],
        temperatures=(0.7,),
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        threads=1,
    )
    write_report(report, RESULTS, name=f"smollm2_{dtype}")
    return report.to_json()


def _row(dtype: str, data: dict[str, Any]) -> list[str]:
    methods, settings = data["methods"], data["settings"]
    lines = []
    for name in ("selfspec_plain", "selfspec_auto", "selfspec_prompt_lookup", "selfspec_auto_t0.7"):
        m = methods.get(name)
        if m is None:
            continue
        cats = " / ".join(f"{c} {v.get('vs_plain_median') or 1.0:.2f}x" for c, v in m["per_category"].items())
        exact = {True: "yes", False: "NO", None: "-"}
        lines.append(
            f"| {dtype} | {name} | {m['tokens_per_second']:.1f} | {m['speedup']:.2f}x | "
            f"{m.get('vs_plain_median') or 1.0:.2f}x | {cats} | {m['tau'] or 1.0:.2f} | "
            f"{exact[m['identical_to_greedy']]} | {exact[m.get('identical_to_plain')]} |"
        )
    curve = ", ".join(f"{k}: {float(v):.2f}" for k, v in sorted((settings.get("verify_cost") or {}).items(),
                                                                key=lambda kv: int(kv[0])))  # fmt: skip
    lines.append(f"| {dtype} | verify curve | {curve} | | | plan: {settings.get('plan')} | | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    models = Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")
    reports = {}
    for dtype in args.dtypes:
        with tempfile.TemporaryDirectory() as cache:  # an empty calibration cache, the fetched model reused
            for kept in ("models", "gguf"):
                if (models / kept).exists():
                    os.symlink(models / kept, Path(cache) / kept)
            os.environ["SELFSPEC_CACHE"] = cache
            reports[dtype] = run(dtype, args.repeats, args.max_new_tokens)
    lines = [
        "# SmolLM2-135M-Instruct in float32 and bfloat16 (CPU, 1 thread)",
        "",
        "Each dtype calibrated on first load from an empty cache, then benchmarked with methods interleaved; "
        "speedup vs transformers' greedy `generate` in the same dtype, `vs plain` the median per-repeat ratio "
        "to selfspec's plain loop in the same dtype. Per-dtype reports: `smollm2_<dtype>.md`.",
        "",
        "| dtype | method | tok/s | vs generate | vs plain | vs plain per category | tau | = generate | = plain |",
        "|---|---|---:|---:|---:|---|---:|:---:|:---:|",
    ]
    for dtype, data in reports.items():
        lines += _row(dtype, data)
        settings = data["settings"]
        lines.append(f"| {dtype} | load | before {settings['load_average_before']}, after "
                     f"{settings['load_average_after']} | | | {settings['machine']} | | | |")  # fmt: skip
    (RESULTS / "smollm2_dtypes.md").write_text("\n".join(lines) + "\n\nMade by `benchmarks/dtype_bench.py`.\n")
    (RESULTS / "smollm2_dtypes.json").write_text(json.dumps({d: r["settings"] for d, r in reports.items()}, indent=2))


if __name__ == "__main__":
    main()
