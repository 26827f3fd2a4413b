"""Long-run check: many generations in a row on one engine must not grow memory or step time.

    python benchmarks/long_run.py                     # 1,000 generations on the demo model
    python benchmarks/long_run.py --count 100         # a shorter run

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


#: Growth allowed between the first and last tenth of a run (the test and the docs state these).
RSS_GROWTH_BOUND_MB = 30.0
STEP_TIME_GROWTH_BOUND = 1.25


def long_run(
    engine: SpeculativeEngine, prompts: list[Any], count: int, max_new_tokens: int, progress: bool = False
) -> dict[str, Any]:
    """Run ``count`` generations cycling through ``prompts``; sample memory and speed.

    Greedy and sampled calls alternate; every 10th call is a stream abandoned after its first
    delta (a client that went away) and every 25th a refused call (an empty prompt), so the
    run also covers the paths that free a cache early.
    """
    samples = []
    cancelled = refused = 0
    steps = range(count)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="generations", unit="gen")
    for i in steps:
        prompt = prompts[i % len(prompts)]
        if i % 25 == 24:
            try:
                engine.generate("", max_new_tokens=max_new_tokens)
            except ValueError:
                refused += 1
        if i % 10 == 9:
            with engine.stream(prompt, max_new_tokens=max_new_tokens) as stream:
                next(iter(stream), None)
            cancelled += stream.finish_reason == "cancelled"
        started = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=max_new_tokens, temperature=0.0 if i % 2 else 0.8, seed=i)
        seconds = time.perf_counter() - started
        samples.append({"i": i, "seconds_per_token": seconds / max(1, len(out.token_ids)), "rss_mb": rss_mb()})
    gc.collect()
    window = max(1, count // 10)
    first, last = samples[:window], samples[-window:]
    rss_start = statistics.median(s["rss_mb"] for s in first)
    rss_end = statistics.median(s["rss_mb"] for s in last)
    step_start = statistics.median(s["seconds_per_token"] for s in first)
    step_end = statistics.median(s["seconds_per_token"] for s in last)
    return {
        "count": count,
        "max_new_tokens": max_new_tokens,
        "streams_cancelled": cancelled,
        "calls_refused": refused,
        "rss_mb_start": round(rss_start, 1),
        "rss_mb_end": round(rss_end, 1),
        "rss_mb_max": round(max(s["rss_mb"] for s in samples), 1),
        "seconds_per_token_start": step_start,
        "seconds_per_token_end": step_end,
        "rss_growth_bound_mb": RSS_GROWTH_BOUND_MB,
        "step_time_growth_bound": STEP_TIME_GROWTH_BOUND,
        "memory_within_bound": rss_end - rss_start < RSS_GROWTH_BOUND_MB,
        "step_time_within_bound": step_end / step_start < STEP_TIME_GROWTH_BOUND,
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
    long_run(engine, prompts, 20, args.max_new_tokens)  # warm up allocator pools
    result = long_run(engine, prompts, args.count, args.max_new_tokens, progress=True)
    print(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
