"""The hybrid drafter with and without grafting a rejected lookup beside the early-exit draft.

Both engines share the demo model, draft 3 tokens a round (fixed, so the timing-driven adaptive
controller does not blur the comparison) and run interleaved on the benchmark's prompts; the
greedy texts are checked equal.

    python benchmarks/hybrid_graft.py    # writes benchmarks/results/hybrid_graft_cpu.json
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

from selfspec import SpeculativeEngine
from selfspec.prompts import PROMPT_SETS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = Path(__file__).parent / "results"


def measure(engines: dict[str, SpeculativeEngine], prompts: list[Any], tokens: int, repeats: int) -> dict[str, Any]:
    """Tokens per second (median over repeats) and mean tau of each engine on ``prompts``."""
    speed: dict[str, list[float]] = {name: [] for name in engines}
    tau: dict[str, list[float]] = {name: [] for name in engines}
    texts: dict[str, list[list[int]]] = {name: [] for name in engines}
    for repeat in range(repeats):
        order = list(engines.items()) if repeat % 2 == 0 else list(reversed(engines.items()))
        for name, engine in order:
            emitted, seconds = 0, 0.0
            for prompt in prompts:
                started = time.perf_counter()
                out = engine.generate(prompt, max_new_tokens=tokens)
                seconds += time.perf_counter() - started
                emitted += len(out.token_ids)
                tau[name].append(out.stats.mean_accepted_length)
                if repeat == 0:
                    texts[name].append(out.token_ids)
            speed[name].append(emitted / seconds)
    first = next(iter(texts.values()))
    return {
        "identical": all(t == first for t in texts.values()),
        **{
            name: {
                "tokens_per_second": round(statistics.median(speed[name]), 1),
                "tau": round(statistics.mean(tau[name]), 3),
            }
            for name in engines
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "hybrid_graft_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    graft = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="hybrid", num_draft_tokens=3)
    plain = SpeculativeEngine(graft.model, graft.tokenizer, drafter="hybrid", num_draft_tokens=3)
    plain.drafter.graft_lookup = False  # type: ignore[attr-defined]
    engines = {"graft": graft, "no_graft": plain}
    report: dict[str, Any] = {"model": "selfspec-demo", "num_draft_tokens": 3, "max_new_tokens": args.max_new_tokens}
    for category, prompts in PROMPT_SETS.items():
        report[category] = measure(engines, prompts, args.max_new_tokens, args.repeats)
        print(category, json.dumps(report[category]), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
