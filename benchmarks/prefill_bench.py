"""Time to first token on a long RAG prompt: selfspec's prefill against transformers' ``generate``.

SmolLM2-135M-Instruct, one thread, a ~1.4k-token RAG prompt (articles and passages from the
built-in prompt banks, then a question), greedy, ``max_new_tokens=1``. Three ways, interleaved,
medians of ``--repeats``:

- ``transformers``: ``model.generate(max_new_tokens=1)``;
- ``selfspec``: ``SpeculativeEngine(drafter="none").generate_ids(max_new_tokens=1)`` (prefill with
  ``is_causal``, as ``generate`` does);
- ``selfspec_mask``: the same engine with the explicit ``[q, kv]`` prefill mask selfspec used
  before (for the before/after comparison).

Writes ``benchmarks/results/prefill_cpu.{json,md}`` with the load average before and after.

    PYTHONPATH=src python benchmarks/prefill_bench.py [--dtypes float32 bfloat16] [--repeats 3]
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
from selfspec.modeling.loading import load_model_and_tokenizer
from selfspec.modeling.realmodels import fetch_model
from selfspec.prompts import ARTICLES, PASSAGES

RESULTS = Path(__file__).parent / "results"


def rag_messages(tokenizer: Any, target_tokens: int) -> list[dict[str, str]]:
    """A RAG prompt of about ``target_tokens`` tokens: passages until long enough, then a question."""
    passages: list[str] = []
    texts = [*ARTICLES, *PASSAGES]
    while len(tokenizer("\n\n".join(passages)).input_ids) < target_tokens - 60:
        passages.append(texts[len(passages) % len(texts)])
    question = "Question: when will the city library reopen, and where can books be returned meanwhile?"
    return [{"role": "user", "content": "Context:\n" + "\n\n".join(passages) + "\n\n" + question}]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def measure(dtype: str, target_tokens: int, repeats: int) -> dict[str, Any]:
    model, tokenizer, _ = load_model_and_tokenizer(fetch_model(), dtype=dtype, device="cpu")
    engine = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
    masked = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
    masked.runner._prefill_plans = masked.runner._chain_plans  # type: ignore[method-assign]
    ids = engine.encode_prompt(rag_messages(tokenizer, target_tokens))
    input_ids = torch.tensor([ids])

    def transformers_first() -> int:
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=1,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        return int(out[0, -1])

    methods = {
        "transformers": transformers_first,
        "selfspec": lambda: engine.generate_ids(ids, max_new_tokens=1).token_ids[0],
        "selfspec_mask": lambda: masked.generate_ids(ids, max_new_tokens=1).token_ids[0],
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    first: dict[str, int] = {}
    with torch.inference_mode():
        for name, run in methods.items():  # warm up each path once
            first[name] = run()
        names = list(methods)
        for turn in range(repeats):  # the order rotates: whoever runs first pays the allocator's first touches
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                started = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "dtype": dtype,
        "prompt_tokens": len(ids),
        "seconds": {name: [round(t, 3) for t in values] for name, values in times.items()},
        "median_seconds": {name: round(t, 3) for name, t in medians.items()},
        "selfspec_vs_transformers": round(medians["selfspec"] / medians["transformers"], 3),
        "mask_vs_transformers": round(medians["selfspec_mask"] / medians["transformers"], 3),
        "same_first_token": len(set(first.values())) == 1,
    }


def write(report: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_cpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        "# Time to first token on a long RAG prompt (CPU)",
        "",
        f"SmolLM2-135M-Instruct, {report['threads']} thread, greedy, `max_new_tokens=1`, medians of "
        f"{report['repeats']} interleaved runs (the order rotating) after one warm-up; "
        f"{report['started']} - {report['finished']} UTC, "
        f"load average {report['load_before']} before, {report['load_after']} after "
        "(2 cores shared with other jobs: read ratios, not absolute times).",
        "",
        "| dtype | prompt tokens | transformers `generate` | selfspec (`is_causal` prefill) | "
        "selfspec, explicit mask (before) | selfspec / transformers | same first token |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        med = row["median_seconds"]
        lines.append(
            f"| {row['dtype']} | {row['prompt_tokens']} | {med['transformers']:.2f} s | {med['selfspec']:.2f} s | "
            f"{med['selfspec_mask']:.2f} s | {row['selfspec_vs_transformers']:.2f}x | {row['same_first_token']} |"
        )
    lines += ["", "Made by `benchmarks/prefill_bench.py`.", ""]
    (RESULTS / "prefill_cpu.md").write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1400, help="approximate prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "threads": 1,
        "repeats": args.repeats,
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_before": load_average(),
        "runs": [],
    }
    for dtype in args.dtypes:
        report["runs"].append(measure(dtype, args.tokens, args.repeats))
        report["load_after"] = load_average()
        report["finished"] = time.strftime("%H:%M", time.gmtime())
        write(report)  # rewritten after each dtype


if __name__ == "__main__":
    main()
