"""The verify-cost curve: what verifying ``k`` drafts costs relative to one plain step, and why.

python benchmarks/verify_cost.py [--model PATH] [--repeats 25] [--out benchmarks/results]

On the model (default: SmolLM2-135M-Instruct from :func:`selfspec.modeling.realmodels.fetch_model`),
fp32, one thread, with 200 cached positions, it times (interleaved medians, the order rotating
every repeat) one target forward over ``k + 1`` tokens (``k = 0 .. 8``): the decoder layers,
the final norm + LM head, and both together (what a verify costs). Then the parts of one layer
on their own: every linear layer of the model's shape for ``M = 1 .. 9`` rows, and scaled
dot-product attention with ``M`` queries (with the boolean causal mask the loop passes for
``M > 1``, and without a mask). Writes ``verify_cost_<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"


def interleaved(variants: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, float]:
    """Median seconds of each variant, timed round-robin with a rotating order."""
    for fn in variants.values():
        fn()
        fn()
    times: dict[Any, list[float]] = {key: [] for key in variants}
    keys = list(variants)
    for turn in range(repeats):
        order = keys[turn % len(keys) :] + keys[: turn % len(keys)]
        for key in order:
            started = time.perf_counter()
            variants[key]()
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(v) for key, v in times.items()}


def model_curve(engine: Any, context: int, max_k: int, repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of layers, LM head, and both, over ``k + 1`` tokens after ``context`` cached ones."""
    runner = engine.runner
    cache = runner.new_cache(context + max_k + 2)
    ids = torch.randint(100, 10000, (1, context + max_k + 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        runner.run_layers(runner.embed(ids[:, :context]), 0, runner.num_layers, torch.arange(context), cache)
        hidden_for = {}
        for k in range(max_k + 1):
            tokens = ids[:, context : context + k + 1]
            positions = torch.arange(context, context + k + 1)
            hidden_for[k] = runner.run_layers(runner.embed(tokens), 0, runner.num_layers, positions, cache)
            cache.crop_to(context)

    def layers(k: int, head: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                tokens = ids[:, context : context + k + 1]
                positions = torch.arange(context, context + k + 1)
                out = runner.run_layers(runner.embed(tokens), 0, runner.num_layers, positions, cache)
                if head:
                    runner.logits(out)
                cache.crop_to(context)

        return run

    def head_only(k: int) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                runner.logits(hidden_for[k])

        return run

    variants: dict[Any, Callable[[], None]] = {}
    for k in range(max_k + 1):
        variants[("verify", k)] = layers(k, True)
        variants[("layers", k)] = layers(k, False)
        variants[("head", k)] = head_only(k)
    seconds = interleaved(variants, repeats)
    return {part: {k: seconds[(part, k)] for k in range(max_k + 1)} for part in ("verify", "layers", "head")}


def layout_curves(engine: Any, context: int, max_k: int, repeats: int) -> dict[str, dict[int, float]]:
    """Verify seconds for ``k = 0 .. max_k`` with the weights row-major (as loaded) and column-major.

    Both layouts live in one process (a copy of the model), timed interleaved.
    """
    import copy

    from selfspec import SpeculativeEngine

    other = copy.deepcopy(engine.model)
    column_major(other)
    engines = {
        "row_major": engine,
        "column_major": SpeculativeEngine(other, engine.tokenizer, drafter="none", calibration={}),
    }
    ids = torch.randint(100, 10000, (1, context + max_k + 1), generator=torch.Generator().manual_seed(0))
    caches = {}
    for name, e in engines.items():
        runner = e.runner
        caches[name] = runner.new_cache(context + max_k + 2)
        with torch.inference_mode():
            runner.run_layers(runner.embed(ids[:, :context]), 0, runner.num_layers, torch.arange(context), caches[name])

    def verify(name: str, k: int) -> Callable[[], None]:
        runner, cache = engines[name].runner, caches[name]

        def run() -> None:
            with torch.inference_mode():
                positions = torch.arange(context, context + k + 1)
                out = runner.run_layers(
                    runner.embed(ids[:, context : context + k + 1]), 0, runner.num_layers, positions, cache
                )
                runner.logits(out)
                cache.crop_to(context)

        return run

    variants = {(name, k): verify(name, k) for name in engines for k in range(max_k + 1)}
    seconds = interleaved(variants, repeats)
    return {name: {k: seconds[(name, k)] for k in range(max_k + 1)} for name in engines}


def op_curves(config: Any, context: int, max_m: int, repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of each linear layer shape and of attention, for ``M = 1 .. max_m`` rows."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", heads))
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    shapes = {
        "q/o_proj": (hidden, heads * head_dim),
        "k/v_proj": (hidden, kv_heads * head_dim),
        "gate/up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "lm_head": (hidden, int(config.vocab_size)),
    }
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(out, inp, generator=gen) * 0.02) for name, (inp, out) in shapes.items()}
    inputs = {
        name: {m: torch.randn(1, m, inp, generator=gen) for m in range(1, max_m + 1)}
        for name, (inp, _) in shapes.items()
    }
    key = torch.randn(1, kv_heads, context + max_m, head_dim, generator=gen)
    value = torch.randn(1, kv_heads, context + max_m, head_dim, generator=gen)
    queries = {m: torch.randn(1, heads, m, head_dim, generator=gen) for m in range(1, max_m + 1)}

    def linear(name: str, m: int) -> Callable[[], Any]:
        return lambda: F.linear(inputs[name][m], weights[name])

    def attention(m: int, masked: bool) -> Callable[[], Any]:
        kv = context + m
        slots = torch.arange(kv)
        mask = (slots[None, :] <= torch.arange(context, kv)[:, None])[None, None] if masked else None
        k, v = key[:, :, :kv], value[:, :, :kv]
        return lambda: F.scaled_dot_product_attention(queries[m], k, v, attn_mask=mask, enable_gqa=kv_heads != heads)

    variants: dict[Any, Callable[[], Any]] = {}
    for m in range(1, max_m + 1):
        for name in shapes:
            variants[(name, m)] = linear(name, m)
        variants[("sdpa_mask", m)] = attention(m, True)
        variants[("sdpa_nomask", m)] = attention(m, False)
    with torch.inference_mode():
        seconds = interleaved(variants, repeats)
    names = [*shapes, "sdpa_mask", "sdpa_nomask"]
    return {name: {m: seconds[(name, m)] for m in range(1, max_m + 1)} for name in names}


def column_major(model: Any) -> int:
    """Re-lay every ``nn.Linear`` weight column-major in place (same values and shape); returns how many.

    ``F.linear(x, W)`` with a row-major ``W [out, in]`` goes to MKL's sgemm with a transposed B,
    which on this CPU handles the rows of ``x`` three at a time and reads ``W`` again for each
    block: a verify of 4-6 tokens costs two weight reads, 7-9 three. With ``W`` stored
    column-major the same call is a plain ``x @ W.T`` over a contiguous ``[in, out]`` matrix.
    """
    count = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
                module.weight.data = module.weight.data.t().contiguous().t()
                count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--name", default="smollm2_cpu")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--column-major",
        action="store_true",
        help="store every linear weight column-major (x @ W.T without MKL's 3-row blocks) before timing",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from selfspec import SpeculativeEngine
    from selfspec.modeling.realmodels import display_name

    model = args.model
    if model is None:
        model = "smollm2-135m-instruct"  # fetched on first use, named by its short name in the results
    engine = SpeculativeEngine.from_pretrained(model, drafter="none", calibrate=False)
    if args.column_major:
        column_major(engine.model)
        engine = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none", calibration={})
    load = os.getloadavg()
    started = time.time()
    curve = model_curve(engine, args.context, args.max_k, args.repeats)
    ops = op_curves(engine.model.config, args.context, args.max_k + 1, args.repeats * 2)
    layouts = layout_curves(engine, args.context, args.max_k, args.repeats) if not args.column_major else {}
    plain = curve["verify"][0]
    relative = {part: {k: round(v / plain, 3) for k, v in values.items()} for part, values in curve.items()}
    ops_relative = {name: {m: round(v / values[1], 3) for m, v in values.items()} for name, values in ops.items()}
    result = {
        "model": display_name(model),
        "settings": {
            "threads": torch.get_num_threads(),
            "dtype": "float32",
            "context": args.context,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "mkldnn": torch.backends.mkldnn.is_available(),
            "machine": f"{platform.machine()} x{os.cpu_count()}",
            "loadavg_before": [round(x, 2) for x in load],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "seconds": round(time.time() - started, 1),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "plain_step_ms": round(plain * 1000, 2),
        "verify_cost": relative["verify"],
        "layers_cost": relative["layers"],
        "head_cost": relative["head"],
        "verify_ms": {k: round(v * 1000, 2) for k, v in curve["verify"].items()},
        "layers_ms": {k: round(v * 1000, 2) for k, v in curve["layers"].items()},
        "head_ms": {k: round(v * 1000, 2) for k, v in curve["head"].items()},
        "layouts_ms": {name: {k: round(v * 1000, 2) for k, v in values.items()} for name, values in layouts.items()},
        "layouts_relative_to_row_major_plain": {
            name: {k: round(v / layouts["row_major"][0], 3) for k, v in values.items()}
            for name, values in layouts.items()
        },
        "op_us": {name: {m: round(v * 1e6, 1) for m, v in values.items()} for name, values in ops.items()},
        "op_relative_to_one_row": ops_relative,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"verify_cost_{args.name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    ks = list(range(args.max_k + 1))
    lines = [
        f"# Verify-cost curve: {Path(str(model)).name} (CPU fp32, {torch.get_num_threads()} thread(s), "
        f"{args.context} cached positions)",
        "",
        f"Interleaved medians of {args.repeats} repeats; plain step {result['plain_step_ms']} ms; load average "
        f"before {result['settings']['loadavg_before']}, after {result['settings']['loadavg_after']}; "
        f"{result['settings']['date']}.",
        "",
        "| k drafts (k+1 tokens) | " + " | ".join(str(k) for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
    ]
    for part in ("verify", "layers", "head"):
        lines.append(f"| {part} (x plain step) | " + " | ".join(f"{relative[part][k]:.2f}" for k in ks) + " |")
    if layouts:
        lines += [
            "",
            "Weight layout (verify cost relative to the row-major plain step, interleaved in one process):",
            "",
            "| layout | " + " | ".join(str(k) for k in ks) + " |",
            "|---|" + "---:|" * len(ks),
        ]
        for name, values in result["layouts_relative_to_row_major_plain"].items():
            lines.append(f"| {name} | " + " | ".join(f"{values[k]:.2f}" for k in ks) + " |")
    lines += [
        "",
        "Ops alone (microseconds; rows M = k + 1):",
        "",
        "| op | " + " | ".join(str(m) for m in range(1, args.max_k + 2)) + " |",
        "|---|" + "---:|" * (args.max_k + 1),
    ]
    for name, values in result["op_us"].items():
        lines.append(f"| {name} | " + " | ".join(f"{values[m]:.0f}" for m in range(1, args.max_k + 2)) + " |")
    (out / f"verify_cost_{args.name}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
