"""Eager vs compiled on this CPU: the static round against the eager loop, SmolLM2, float32 and bfloat16 (issue 26).

For each dtype, one model object and four engines on it, run side by side in one process,
interleaved (the order rotates each pass), one thread:

- ``eager plain`` / ``eager lookup``: the eager loop (``compile=False``), plain decoding and prompt
  lookup (8 drafts a round, fixed);
- ``compiled plain`` / ``compiled lookup``: the static round compiled by inductor (``compile=True``),
  every width's step compiled before timing (the compile time is reported apart).

Each method's tokens/s over the stock prompts (RAG, summarization, chat, code; 64 new tokens,
greedy), whether every output equals the eager plain loop's, and the verify-cost curve of a step of
``w`` positions at ~300 cached positions (median of 7, relative to ``w = 1``) for the static round's
step eagerly and compiled. Results: ``benchmarks/results/compile_cpu.{json,md}`` (written after each
dtype), with the load average before and after.

    PYTHONPATH=src python benchmarks/compile_bench.py [--repeats 3] [--dtypes float32 bfloat16]
    PYTHONPATH=src python benchmarks/compile_bench.py --model selfspec-demo --drafter early_exit \
        --num-draft-tokens 4 --out compile_demo_cpu   # the bundled model's early exit
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

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
WIDTHS = (1, 2, 3, 5, 9)
NEW_TOKENS = 64


def load_per_core() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def step_curve(engine: Any, backend: str | None) -> dict[int, float]:
    """Seconds of one static step of each width at ~300 cached positions, relative to width 1."""
    from selfspec.modeling.static_step import StaticStep

    step = engine.static_round.step if backend is not None else StaticStep(engine.runner)
    cache = step.reserve(300 + NEW_TOKENS + 33)
    bucket = 512
    times = {}
    with torch.inference_mode():
        for width in WIDTHS:
            tokens = torch.full((1, width), 17, dtype=torch.long)
            zero = torch.zeros((), dtype=torch.long)
            samples = []
            for _ in range(8):
                cache.length.fill_(300)
                started = time.perf_counter()
                step.greedy(tokens, zero, bucket)
                samples.append(time.perf_counter() - started)
            times[width] = statistics.median(samples[1:])
    return {w: t / times[1] for w, t in times.items()} | {"one_step_ms": times[1] * 1e3}  # type: ignore[dict-item]


def run(dtype: str, repeats: int, model_name: str = MODEL, spec: str = "prompt_lookup", k: int = 8) -> dict[str, Any]:
    from selfspec import SpeculativeEngine
    from selfspec.calibration.bench import _encode
    from selfspec.modeling.static_step import WIDTHS as STEP_WIDTHS
    from selfspec.modeling.static_step import width_for
    from selfspec.prompts import STOCK_PROMPT_SETS

    torch.set_num_threads(1)
    load_before = load_per_core()
    base = SpeculativeEngine.from_pretrained(model_name, dtype=dtype, drafter="none", calibrate=False, compile=False)
    model, tokenizer = base.model, base.tokenizer
    prompts = [(cat, _encode(base, p)) for cat, items in STOCK_PROMPT_SETS.items() for p in items]
    engines = {}
    compile_seconds = {}
    label_of = {"none": "plain", "prompt_lookup": "lookup"}
    widths_of = tuple(w for w in STEP_WIDTHS if w <= width_for(k))  # every width a round of <= k drafts uses
    exit_layer = base.config.exit_layer if spec == "early_exit" else None
    for mode in ("eager", "compiled"):
        for drafter in ("none", spec):
            label = label_of.get(drafter, drafter)
            engine = SpeculativeEngine(
                model, tokenizer, drafter=drafter, num_draft_tokens=k, calibration={}, compile=mode == "compiled",
                **({"exit_layer": exit_layer} if drafter == "early_exit" else {}),
            )  # fmt: skip
            if mode == "compiled":
                started = time.perf_counter()
                widths = (1,) if drafter == "none" else widths_of
                layer = exit_layer if drafter == "early_exit" else None
                for slots in sorted({len(ids) + NEW_TOKENS + 33 for _, ids in prompts}, reverse=True):  # largest first
                    engine.static_round.step.prepare(slots, widths=widths, exit_layer=layer)
                compile_seconds[f"{mode} {label}"] = time.perf_counter() - started
            engines[f"{mode} {label}"] = engine
    names = list(engines)
    seconds = {name: 0.0 for name in names}
    tokens = {name: 0 for name in names}
    per_category: dict[str, dict[str, float]] = {name: {} for name in names}
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in names}
    for name in names:  # warm up (first-call allocations)
        engines[name].generate_ids(prompts[0][1], max_new_tokens=8)
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for index, (category, ids) in enumerate(prompts):
            for name in order:
                started = time.perf_counter()
                out = engines[name].generate_ids(ids, max_new_tokens=NEW_TOKENS)
                elapsed = time.perf_counter() - started
                seconds[name] += elapsed
                tokens[name] += len(out.token_ids)
                per_category[name][category] = per_category[name].get(category, 0.0) + elapsed
                outputs[name][index] = out.token_ids
    reference = outputs["eager plain"]
    spec_label = label_of.get(spec, spec)
    result = {
        "model": model_name,
        "drafter": spec,
        "num_draft_tokens": k,
        "exit_layer": exit_layer,
        "dtype": dtype,
        "threads": 1,
        "repeats": repeats,
        "prompts": len(prompts),
        "max_new_tokens": NEW_TOKENS,
        "load_per_core_before": round(load_before, 2),
        "load_per_core_after": round(load_per_core(), 2),
        "compile_seconds": {k: round(v, 1) for k, v in compile_seconds.items()},
        "methods": {
            name: {
                "tokens_per_second": round(tokens[name] / seconds[name], 2),
                "vs_eager_plain": round(seconds["eager plain"] / seconds[name], 3),
                "per_category_vs_eager_plain": {
                    c: round(per_category["eager plain"][c] / t, 3) for c, t in per_category[name].items()
                },
                "identical_to_eager_plain": outputs[name] == reference,
            }
            for name in names
        },
        "step_curve_eager": step_curve(engines[f"compiled {spec_label}"], None),
        "step_curve_compiled": step_curve(engines[f"compiled {spec_label}"], "inductor"),
    }
    return result


def markdown(results: list[dict[str, Any]], command: str) -> str:
    first = results[0]
    exit_note = f" at exit layer {first['exit_layer']}" if first.get("exit_layer") is not None else ""
    lines = [
        f"# Eager loop vs compiled static round, {first.get('model', MODEL)}, this CPU (issue 26)",
        "",
        f"`{command}`: one process, one thread, interleaved; 64 new tokens, greedy, the stock prompts",
        f"(RAG, summarization, chat, code); `{first.get('drafter', 'prompt_lookup')}`{exit_note} drafts "
        f"{first.get('num_draft_tokens', 8)} tokens a round.",
        "",
        "| dtype | method | tok/s | vs eager plain | per category | identical to eager plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, m in r["methods"].items():
            cats = " / ".join(f"{c} {v:.2f}x" for c, v in m["per_category_vs_eager_plain"].items())
            same = "yes" if m["identical_to_eager_plain"] else "NO"
            speed = f"{m['tokens_per_second']:.1f} | {m['vs_eager_plain']:.2f}x"
            lines.append(f"| {r['dtype']} | {name} | {speed} | {cats} | {same} |")
    lines += ["", "Step cost of `w` positions at 300 cached (relative to `w = 1`; one step in ms):", ""]
    lines += ["| dtype | step | " + " | ".join(f"w={w}" for w in WIDTHS) + " | w=1 ms |"]
    lines += ["|---|---|" + "---|" * (len(WIDTHS) + 1)]
    for r in results:
        for kind in ("eager", "compiled"):
            curve = r[f"step_curve_{kind}"]
            cells = " | ".join(f"{curve[w]:.2f}" for w in WIDTHS)
            lines.append(f"| {r['dtype']} | {kind} | {cells} | {curve['one_step_ms']:.1f} |")
    lines += [""]
    for r in results:
        lines.append(
            f"- {r['dtype']}: load per core {r['load_per_core_before']} before, {r['load_per_core_after']} after; "
            f"compile (inductor, every width and bucket, before timing): {r['compile_seconds']}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--model", default=MODEL, help="a model name or path (selfspec-demo: the bundled model)")
    parser.add_argument("--drafter", default="prompt_lookup", help="the speculative method beside plain decoding")
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--out", default="compile_cpu", help="the results' file stem under benchmarks/results")
    args = parser.parse_args()
    command = "PYTHONPATH=src python benchmarks/compile_bench.py" + (
        f" --model {args.model} --drafter {args.drafter} --num-draft-tokens {args.num_draft_tokens} --out {args.out}"
        if args.out != "compile_cpu"
        else ""
    )
    results = []
    for dtype in args.dtypes:
        results.append(run(dtype, args.repeats, args.model, args.drafter, args.num_draft_tokens))
        (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=2) + "\n")
        (RESULTS / f"{args.out}.md").write_text(markdown(results, command))


if __name__ == "__main__":
    main()
