"""Cost of a bf16 verify forward: batched (one attention call per layer) vs batch-invariant rows.

SmolLM2-135M-Instruct in bf16, one thread; ``cached`` positions already in the cache, then one
forward of ``q`` new positions through every layer and the LM head (a verify of ``q - 1`` drafts).
``batched`` is ``runner.row_exact = False`` (one masked SDPA call and batched matmuls, what bf16
did before: not exact), ``row_exact`` the default (each row attends alone, row-by-row matmuls
where bf16 matmuls are not row-invariant). Fastest of ``--repeats`` interleaved runs (medians in
the JSON: on a shared machine the minimum is the steadier estimate); the ratio to a one-token
forward is the verify-cost curve the planner sees.

Writes ``benchmarks/results/verify_exact_cpu.{json,md}``.

    PYTHONPATH=src python benchmarks/verify_exact_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from selfspec.modeling import ModelRunner
from selfspec.modeling.loading import load_model_and_tokenizer
from selfspec.modeling.realmodels import fetch_model

RESULTS = Path(__file__).parent / "results"


def measure(runner: ModelRunner, cached: int, rows: list[int], repeats: int) -> list[dict[str, Any]]:
    ids = torch.randint(10, runner.vocab_size, (1, cached + max(rows)), generator=torch.Generator().manual_seed(0))
    cache = runner.new_cache(cached + max(rows))
    out = []
    with torch.inference_mode():
        runner.run_layers(runner.embed(ids[:, :cached]), 0, runner.num_layers, torch.arange(cached), cache)
        for q in rows:
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(repeats):
                for exact in (False, True):
                    runner.row_exact = exact
                    cache.crop_to(cached)
                    started = time.perf_counter()
                    new = ids[:, cached : cached + q]
                    positions = torch.arange(cached, cached + q)
                    hidden = runner.run_layers(runner.embed(new), 0, runner.num_layers, positions, cache)
                    runner.row_logits(hidden)
                    times[exact].append(time.perf_counter() - started)
            out.append({
                "cached": cached, "rows": q,
                "batched_ms": round(min(times[False]) * 1000, 1),
                "row_exact_ms": round(min(times[True]) * 1000, 1),
                "batched_median_ms": round(statistics.median(times[False]) * 1000, 1),
                "row_exact_median_ms": round(statistics.median(times[True]) * 1000, 1),
            })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cached", type=int, nargs="+", default=[300, 1400])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, _, _ = load_model_and_tokenizer(fetch_model(), dtype="bfloat16", device="cpu")
    runner = ModelRunner(model)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_before": os.getloadavg()}
    report["runs"] = [row for cached in args.cached for row in measure(runner, cached, args.rows, args.repeats)]
    report["load_after"] = os.getloadavg()
    report["finished"] = time.strftime("%H:%M", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verify_exact_cpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        "# bf16 verify cost: batched vs batch-invariant rows (CPU)",
        "",
        f"SmolLM2-135M-Instruct, bf16, 1 thread, fastest of {args.repeats} interleaved runs; {report['started']} - "
        f"{report['finished']} UTC, load average {[round(x, 2) for x in report['load_before']]} before, "
        f"{[round(x, 2) for x in report['load_after']]} after (2 cores shared with other jobs).",
        "",
        "| cached | rows | batched (not exact) | row-exact | batched / 1 row | row-exact / 1 row |",
        "|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        one = next(r for r in report["runs"] if r["cached"] == run["cached"] and r["rows"] == 1)
        lines.append(
            f"| {run['cached']} | {run['rows']} | {run['batched_ms']:.0f} ms | {run['row_exact_ms']:.0f} ms | "
            f"{run['batched_ms'] / one['batched_ms']:.2f} | {run['row_exact_ms'] / one['batched_ms']:.2f} |"
        )
    lines += ["", "Made by `benchmarks/verify_exact_cost.py`.", ""]
    (RESULTS / "verify_exact_cpu.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
