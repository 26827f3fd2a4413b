"""What bounds speculation in float32 on this CPU: exact small-row matmuls, and drafts on summaries.

python benchmarks/fp32_limits.py [--model PATH] [--repeats 15] [--out benchmarks/results]

Two measurements, fp32, one thread, on SmolLM2-135M-Instruct (default):

1. **Row-exact matmul formulations.** A greedy verify row is exact when it gets the bits that the
   same position gets alone, in a one-row ``F.linear`` (what transformers' ``generate`` runs per
   token: MKL's ``SGEMM(T, N, out, 1, in)``). For every linear shape of the model and its LM head,
   each formulation of an ``M``-row product (``M = 1 .. 4``) is checked bit for bit against the
   rows alone, on data that shows any other summation order (a ``[u, -u]`` weight and ``[a, a]``
   rows: the probe of :func:`selfspec.modeling.attention.linear_is_row_invariant`), and timed
   (interleaved medians, each weight read from memory, not cache, as in a model's step). Then
   the same check under each of MKL's conditional numerical reproducibility modes
   (``MKL_CBWR``, in a child process each: MKL reads it once).
2. **The plain step's share of matrix products** (``torch.profiler`` over one greedy generation)
   and the weight bytes a step reads, which give the bandwidth the step runs at.
3. **Every drafter on the summarization prompts** (the first-contact benchmark's own), greedy,
   interleaved with the plain loop: prompt lookup, the shipped EAGLE head's chains and its
   lookup hybrid at 2, 3 and 4 drafts, each checked token-identical to the plain loop.

Writes ``fp32_limits_<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from verify_cost import interleaved, model_curve

RESULTS = Path(__file__).parent / "results"
ROWS = (1, 2, 3, 4)
#: MKL's conditional numerical reproducibility modes checked (the empty string: MKL's default).
#: Megabytes of weight copies a timing pass streams (more than any cache here).
STREAM_MB = 256
CBWR_MODES = ("", "COMPATIBLE", "AVX2", "AVX2,STRICT", "AVX512", "AVX512,STRICT")


def formulations(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Ways to compute ``F.linear(x, weight)`` for ``x [M, in]``; ``per_row_mv`` is one matrix-vector product a row."""
    column_major = weight.t().contiguous()
    return {
        "linear": lambda x: F.linear(x, weight),
        "x @ W.T (column-major copy)": lambda x: x @ column_major,
        "(W @ x.T).T": lambda x: (weight @ x.t()).t(),
        "einsum": lambda x: torch.einsum("mk,nk->mn", x, weight),
        "bmm": lambda x: torch.bmm(x[:, None, :], weight.t().expand(x.shape[0], *weight.t().shape)).squeeze(1),
        "per_row_mv": lambda x: torch.stack([torch.mv(weight, row) for row in x]),
    }


def probe_data(out_features: int, in_features: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[u, -u]`` weight and ``[a, a]`` rows: any other summation order leaves another tiny value."""
    generator = torch.Generator().manual_seed(seed)
    half = in_features // 2
    u = torch.randn(out_features, half, generator=generator)
    a = torch.randn(rows, half, generator=generator)
    weight = torch.zeros(out_features, in_features)
    weight[:, :half], weight[:, half : 2 * half] = u, -u
    x = torch.zeros(rows, in_features)
    x[:, :half], x[:, half : 2 * half] = a, a
    return weight, x


def shapes_of(config: Any) -> dict[str, tuple[int, int]]:
    """``name -> (out_features, in_features)`` of the model's linear layers and LM head."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", heads))
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    return {
        "q/o_proj": (heads * head_dim, hidden),
        "k/v_proj": (kv_heads * head_dim, hidden),
        "gate/up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (int(config.vocab_size), hidden),
    }


def exact_widths(shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, list[int]]]:
    """Per shape and formulation: the row counts ``M > 1`` whose rows all equal the one-row ``F.linear``."""
    result: dict[str, dict[str, list[int]]] = {}
    with torch.inference_mode():
        for name, (out_features, in_features) in shapes.items():
            weight, x = probe_data(out_features, in_features, max(ROWS))
            alone = torch.cat([F.linear(row[None], weight) for row in x])
            result[name] = {
                label: [m for m in ROWS[1:] if torch.equal(fn(x[:m]), alone[:m])]
                for label, fn in formulations(weight).items()
            }
    return result


def formulation_times(shapes: dict[str, tuple[int, int]], repeats: int) -> dict[str, dict[str, dict[int, float]]]:
    """Median microseconds per call of every formulation and row count, with the weights read from memory.

    A model's step reads each weight once, from memory rather than cache, so each shape gets enough
    copies (:data:`STREAM_MB` in all) that one pass over them does the same; a variant's time is one
    pass divided by the copies. Formulations and row counts of a shape are interleaved.
    """
    generator = torch.Generator().manual_seed(1)
    times: dict[str, dict[str, dict[int, float]]] = {}
    for name, (out_features, in_features) in shapes.items():
        copies = max(1, STREAM_MB * 2**20 // (out_features * in_features * 4))
        weights = [torch.randn(out_features, in_features, generator=generator) * 0.02 for _ in range(copies)]
        x = torch.randn(max(ROWS), in_features, generator=generator)
        per_copy = [formulations(weight) for weight in weights]
        variants: dict[Any, Callable[[], Any]] = {}
        for label in per_copy[0]:
            for m in ROWS:
                fns = [f[label] for f in per_copy]
                variants[(label, m)] = lambda fns=fns, rows=x[:m]: [fn(rows) for fn in fns]
        with torch.inference_mode():
            seconds = interleaved(variants, repeats)
        for (label, m), value in seconds.items():
            times.setdefault(name, {}).setdefault(label, {})[m] = round(value / copies * 1e6, 1)
        del weights, per_copy, variants
    return times


def cbwr_child(shapes_json: str) -> None:
    """In a child process (``MKL_CBWR`` set by the parent): which ``F.linear`` widths are row-exact."""
    torch.set_num_threads(1)
    shapes = {name: (int(o), int(i)) for name, (o, i) in json.loads(shapes_json).items()}
    widths = exact_widths(shapes)
    print(json.dumps({name: by_label["linear"] for name, by_label in widths.items()}))


def cbwr_modes(shapes: dict[str, tuple[int, int]]) -> dict[str, dict[str, list[int]]]:
    """``MKL_CBWR`` mode -> shape -> the row counts ``F.linear`` gets exactly (a child process per mode)."""
    result = {}
    for mode in CBWR_MODES:
        env = {**os.environ, "MKL_CBWR": mode} if mode else {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
        done = subprocess.run(
            [sys.executable, __file__, "--cbwr-child", json.dumps(shapes)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        result[mode or "default"] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def matmul_share(engine: Any, prompt_ids: list[int], tokens: int) -> dict[str, float]:
    """The share of one greedy generation's CPU time in ``aten::mm``, and the bandwidth a step runs at."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate_ids(prompt_ids, max_new_tokens=4)
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.generate_ids(prompt_ids, max_new_tokens=tokens)
    wall = time.perf_counter() - started
    events = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(events.values())
    step_seconds = steady_step_seconds(engine, prompt_ids, tokens)
    layer_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for name, m in engine.model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )
    return {
        "mm_share": round(events.get("aten::mm", 0.0) / total, 3),
        "profiled_seconds": round(wall, 2),
        "step_ms": round(step_seconds * 1000, 2),
        "layer_weight_mb": round(layer_bytes / 2**20, 1),
        "layer_weights_gb_per_s": round(layer_bytes / step_seconds / 1e9, 2),
    }


def steady_step_seconds(engine: Any, prompt_ids: list[int], tokens: int) -> float:
    """Seconds per generated token of the plain loop, the prefill left out (two lengths, differenced)."""

    def timed(n: int) -> float:
        started = time.perf_counter()
        engine.generate_ids(prompt_ids, max_new_tokens=n)
        return time.perf_counter() - started

    short = statistics.median(timed(1) for _ in range(3))
    long = statistics.median(timed(tokens) for _ in range(3))
    return (long - short) / (tokens - 1)


def drafter_sweep(engine: Any, prompts: list[list[int]], tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Each drafter against the plain loop on each prompt: median per-repeat ratio, tau, identical text."""
    from selfspec import SpeculativeEngine

    model, tokenizer = engine.model, engine.tokenizer
    engines = {"plain": engine, "prompt_lookup": SpeculativeEngine(model, tokenizer, drafter="prompt_lookup")}
    for k in (2, 3, 4):
        engines[f"eagle k={k}"] = SpeculativeEngine(model, tokenizer, drafter="eagle", num_draft_tokens=k)
        engines[f"eagle_hybrid k={k}"] = SpeculativeEngine(model, tokenizer, drafter="eagle_hybrid", num_draft_tokens=k)
    rows = []
    for index, ids in enumerate(prompts):
        times: dict[str, list[float]] = {name: [] for name in engines}
        outputs: dict[str, Any] = {}
        names = list(engines)
        for turn in range(repeats):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                started = time.perf_counter()
                out = engines[name].generate_ids(ids, max_new_tokens=tokens)
                times[name].append(time.perf_counter() - started)
                outputs[name] = out
        plain = outputs["plain"].token_ids
        for name in names[1:]:
            ratios = [p / t for p, t in zip(times["plain"], times[name], strict=True)]
            stats = outputs[name].stats
            rows.append(
                {
                    "prompt": index,
                    "method": name,
                    "vs_plain": round(statistics.median(ratios), 3),
                    "vs_plain_range": [round(min(ratios), 3), round(max(ratios), 3)],
                    "tau": round(float(stats.mean_accepted_length), 3),
                    "identical_to_plain": outputs[name].token_ids == plain,
                }
            )
    return rows


def block_forward_curves(engine: Any, repeats: int, max_k: int = 4) -> dict[str, dict[int, float]]:
    """A verify's decoder layers (``k`` drafts, relative to one plain step) with ``F.linear`` and with ``(W @ x.T).T``.

    The second swaps the fast path's multi-row float32 products for the formulation that is fastest
    in isolation, to see whether it makes a forward cheaper (it is not exact either).
    """
    from selfspec.modeling import fastpath

    loaded = fastpath.linear_rows

    def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact: bool) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if exact or rows == 1:
            return loaded(x, weight, bias, exact)
        y = torch.mm(weight, x.reshape(rows, -1).t()).t()
        return (y if bias is None else y + bias).reshape(*x.shape[:-1], weight.shape[0])

    curves: dict[str, list[dict[int, float]]] = {"F.linear": [], "(W @ x.T).T": []}
    try:
        for _ in range(2):  # alternate the two, twice
            for label, fn in (("F.linear", loaded), ("(W @ x.T).T", transposed)):
                fastpath.linear_rows = fn
                curves[label].append(model_curve(engine, 200, max_k, repeats)["layers"])
    finally:
        fastpath.linear_rows = loaded
    plain = statistics.median(c[0] for c in curves["F.linear"])
    return {
        label: {k: round(statistics.median(c[k] for c in runs) / plain, 3) for k in range(max_k + 1)}
        for label, runs in curves.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--name", default="smollm2")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per summarization prompt")
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--cbwr-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cbwr_child is not None:
        cbwr_child(args.cbwr_child)
        return
    torch.set_num_threads(args.threads)
    from selfspec import SpeculativeEngine
    from selfspec.modeling.realmodels import display_name
    from selfspec.prompts import STOCK_PROMPT_SETS

    model = args.model or "smollm2-135m-instruct"
    engine = SpeculativeEngine.from_pretrained(model, drafter="none", dtype="float32", calibrate=False)
    load = os.getloadavg()
    started = time.time()
    shapes = shapes_of(engine.model.config)
    exact = exact_widths(shapes)
    times = formulation_times(shapes, args.repeats)
    modes = cbwr_modes(shapes)
    prompt_ids = [engine.encode_prompt(prompt) for prompt in STOCK_PROMPT_SETS["summarization"]]
    step = matmul_share(engine, prompt_ids[0], args.tokens)
    blocks = block_forward_curves(engine, max(3, args.repeats // 2))
    sweep = drafter_sweep(engine, prompt_ids, args.tokens, args.sweep_repeats)
    result = {
        "model": display_name(model),
        "settings": {
            "threads": torch.get_num_threads(),
            "dtype": "float32",
            "repeats": args.repeats,
            "sweep_repeats": args.sweep_repeats,
            "tokens": args.tokens,
            "torch": torch.__version__,
            "machine": f"{platform.machine()} x{os.cpu_count()}",
            "loadavg_before": [round(x, 2) for x in load],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.time() - started, 1),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "shapes": shapes,
        "exact_row_counts": exact,
        "formulation_us": times,
        "cbwr_exact_row_counts": modes,
        "plain_step": step,
        "layers_cost_by_block_formulation": blocks,
        "summarization_sweep": sweep,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fp32_limits_{args.name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    text = markdown(result)
    (out / f"fp32_limits_{args.name}.md").write_text(text, encoding="utf-8")
    print(text)


def markdown(result: dict[str, Any]) -> str:
    """The results as a markdown page."""
    s = result["settings"]
    step = result["plain_step"]
    lines = [
        f"# What bounds float32 speculation here: {result['model']} (CPU, {s['threads']} thread)",
        "",
        f"Made by `benchmarks/fp32_limits.py`; {s['machine']}, torch {s['torch']}, {s['date']}; load average before "
        f"{s['loadavg_before']}, after {s['loadavg_after']}.",
        "",
        "## Row-exact matrix products",
        "",
        "An exact verify row has the bits of the same position computed alone (`F.linear` of one row, what "
        "`generate` runs per token). Row counts M > 1 whose every row matched, on data that shows any other "
        "summation order, and the median time of one call (microseconds, interleaved, weights read from memory "
        "as in a model's step) for M = 1 / 2 / 3 / 4 rows:",
        "",
        "| shape | formulation | exact at M | us at M = 1 / 2 / 3 / 4 |",
        "|---|---|---|---|",
    ]
    for name, by_label in result["exact_row_counts"].items():
        out_features, in_features = result["shapes"][name]
        for label, widths in by_label.items():
            us = result["formulation_us"][name][label]
            lines.append(
                f"| {name} `{out_features} x {in_features}` | {label} | {', '.join(map(str, widths)) or 'none'} | "
                + " / ".join(f"{us[m]:.0f}" for m in ROWS)
                + " |"
            )
    lines += [
        "",
        "`F.linear` under MKL's reproducibility modes (`MKL_CBWR`; row counts whose rows matched):",
        "",
        "| MKL_CBWR | " + " | ".join(result["shapes"]) + " |",
        "|---|" + "---|" * len(result["shapes"]),
    ]
    for mode, by_shape in result["cbwr_exact_row_counts"].items():
        lines.append(f"| {mode} | " + " | ".join(", ".join(map(str, w)) or "none" for w in by_shape.values()) + " |")
    lines += [
        "",
        "In the model's forward (the decoder layers of a verify of k drafts, 200 cached positions, relative to "
        "one plain step; the fast path's multi-row float32 products swapped):",
        "",
        "| formulation | "
        + " | ".join(f"k={k}" for k in result["layers_cost_by_block_formulation"]["F.linear"])
        + " |",
        "|---|" + "---:|" * len(result["layers_cost_by_block_formulation"]["F.linear"]),
        *(
            f"| {label} | " + " | ".join(f"{v:.2f}" for v in curve.values()) + " |"
            for label, curve in result["layers_cost_by_block_formulation"].items()
        ),
        "",
        "## The plain step",
        "",
        f"- `aten::mm` is {step['mm_share']:.0%} of a greedy generation's CPU time (torch.profiler).",
        f"- A plain step takes {step['step_ms']} ms and reads {step['layer_weight_mb']} MB of layer weights "
        f"(the LM head aside): {step['layer_weights_gb_per_s']} GB/s.",
        "",
        "## Drafters on the summarization prompts (greedy, against the plain loop)",
        "",
        "| prompt | method | vs plain (range) | tau | identical to plain |",
        "|---:|---|---:|---:|:---:|",
    ]
    for row in result["summarization_sweep"]:
        low, high = row["vs_plain_range"]
        lines.append(
            f"| {row['prompt']} | {row['method']} | {row['vs_plain']:.2f}x ({low:.2f}-{high:.2f}) | {row['tau']:.2f} | "
            f"{'yes' if row['identical_to_plain'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
