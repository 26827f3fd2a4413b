"""Long-run check: many generations in a row on one engine must not grow memory or step time.

    python benchmarks/long_run.py                     # 1,000 generations on the demo model
    python benchmarks/long_run.py --count 100 --quick # a shorter run

Prints process memory (RSS) and seconds per token at the start and end, and writes
benchmarks/results/long_run.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from selfspec import SpeculativeEngine


def rss_mb() -> float:
    """Resident memory of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def long_run(engine: SpeculativeEngine, prompts: list[Any], count: int, max_new_tokens: int) -> dict[str, Any]:
    """Run ``count`` generations cycling through ``prompts``; sample memory and speed."""
    samples = []
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        started = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0 if i % 2 else 0.8, seed=i)
        seconds = time.perf_counter() - started
        samples.append({"i": i, "seconds_per_token": seconds / max(1, len(out.token_ids)), "rss_mb": rss_mb()})
    gc.collect()
    window = max(1, count // 10)
    first, last = samples[:window], samples[-window:]
    return {
        "count": count,
        "max_new_tokens": max_new_tokens,
        "rss_mb_start": round(statistics.median(s["rss_mb"] for s in first), 1),
        "rss_mb_end": round(statistics.median(s["rss_mb"] for s in last), 1),
        "seconds_per_token_start": statistics.median(s["seconds_per_token"] for s in first),
        "seconds_per_token_end": statistics.median(s["seconds_per_token"] for s in last),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "long_run.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = SpeculativeEngine.from_pretrained("selfspec-demo")
    prompts = ["It is a truth universally acknowledged,", [{"role": "user", "content": "Who is Mr. Darcy?"}]]
    result = long_run(engine, prompts, args.count, args.max_new_tokens)
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
