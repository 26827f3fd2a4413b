"""Time SmolLM2-135M-Instruct's first-load calibration on this CPU (fp32, one thread), phase by phase.

Loads the fetched model (``python -m selfspec.modeling.realmodels`` fetches it) without
calibrating, then runs :func:`~selfspec.calibration.calibrate` exactly as the first load does
(32 new tokens per prompt, drafts up to 6, the default budget or ``--budget``), ``repeats``
times, and records the load time; each run's seconds, the process's CPU seconds (about what the
wall time would be on an idle machine: one thread computes), its phases, plan, skipped and
dropped measurements; and the machine's load average before and after. ``--label`` names the
run in the JSON file (results of other labels already there are kept), so a before/after pair
lands side by side:

    SELFSPEC_THREADS=1 python benchmarks/first_load_calibration.py --label after \
        --out benchmarks/results/first_load_calibration_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from selfspec.artifacts import atomic_write_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--budget", type=float, default=None, help="calibration budget (default: the first load's)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    from selfspec import SpeculativeEngine
    from selfspec.calibration import calibrate
    from selfspec.decoding.config import DEFAULT_CALIBRATION_BUDGET

    budget = args.budget or DEFAULT_CALIBRATION_BUDGET
    load_before = os.getloadavg()
    started = time.perf_counter()
    engine = SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct", dtype="float32", threads=1, calibrate=False, drafter="auto"
    )
    load_seconds = time.perf_counter() - started
    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        load_at_start = os.getloadavg()
        cpu_started = time.process_time()
        started = time.perf_counter()
        result = calibrate(engine, max_new_tokens=32, max_draft_tokens=6, save=False, progress="lines", budget=budget)
        runs.append(
            {
                "seconds": round(time.perf_counter() - started, 1),
                "cpu_seconds": round(time.process_time() - cpu_started, 1),  # ~ the wall time on an idle machine
                "phases": {k: round(v, 1) for k, v in getattr(result, "phase_seconds", {}).items()},
                "plan": result.plan.summary(),
                "sampled_plan": None if result.sampled_plan is None else result.sampled_plan.summary(),
                "skipped": list(result.skipped),
                "dropped": list(getattr(result, "dropped", [])),
                "cost_checks": {k: v for k, v in result.cost_checks.items() if k != "load_per_core"},
                "candidates": {k: round(v, 3) for k, v in sorted(result.candidates.items(), key=lambda kv: -kv[1])},
                "verify_cost": {str(k): round(v, 3) for k, v in result.verify_cost.items()},
                "load_average_at_start": [round(x, 2) for x in load_at_start],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    record = {
        "model": "smollm2-135m-instruct (Q4_1 GGUF, dequantized to float32)",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "budget": budget,
        "load_seconds": round(load_seconds, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
    }
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.label] = record
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}))


if __name__ == "__main__":
    main()
