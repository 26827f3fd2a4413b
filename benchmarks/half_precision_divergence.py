"""Where selfspec's plain text leaves transformers' ``generate`` in half precision, per prompt (issue 41, item 5).

selfspec promises two different things, and this measures the second:

- **speculative == selfspec's plain text**, bit for bit, with ``row_exact`` (on a CPU the row-by-row
  verify; on CUDA the row-invariant kernels). Checked here too, for prompt lookup and the early exit,
  and for prompt lookup with ``row_exact=False`` (the verify as one block), which may part.
- **selfspec's plain text vs transformers' ``generate``**: the same model and dtype, but not always
  the same kernels (selfspec's lean layer path, its argmax screen, on CUDA the row-invariant
  kernels; ``generate`` runs transformers' modules and cuBLAS), so in half precision the two texts
  may part where an argmax is near a tie. The first index where they differ is reported per
  prompt, never hidden (``null``: identical for every token generated).

Greedy, one thread, the demo model (``selfspec-demo``, 16 layers, hidden 192) by default, each
dtype asked (float32 is the control: there the texts must agree).

    PYTHONPATH=src python benchmarks/half_precision_divergence.py          # about a minute on one thread
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import transformers

from selfspec import SpeculativeEngine
from selfspec.artifacts import atomic_write_text
from selfspec.modeling.hardware import cpu_features, native_dtypes

RESULTS = Path(__file__).parent / "results"
PROMPTS = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "The committee met on Tuesday to review the budget. The budget covers roads, schools and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of the forest, there lived",
    "The three primary colours are red, yellow and",
)
SPECULATIVE = {
    "prompt_lookup": {"drafter": "prompt_lookup", "num_draft_tokens": 8},
    "early_exit": {"drafter": "early_exit", "exit_layer": 4, "num_draft_tokens": 4},
    # the same drafts verified as one block (library kernels): what row_exact buys
    "prompt_lookup_row_exact_off": {"drafter": "prompt_lookup", "num_draft_tokens": 8, "row_exact": False},
}


def first_divergence(left: list[int], right: list[int]) -> int | None:
    """The first index where two texts differ (one ending first counts), or ``None`` when identical."""
    for index, (a, b) in enumerate(zip(left, right, strict=False)):
        if a != b:
            return index
    return None if len(left) == len(right) else min(len(left), len(right))


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` (``do_sample=False``): the new tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id,
        eos_token_id=model.config.eos_token_id,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def measure_dtype(model_name: str, dtype: str, max_new_tokens: int) -> dict[str, Any]:
    """Every prompt's first divergence in ``dtype``: plain vs ``generate``, and each speculative drafter vs plain."""
    plain_engine = SpeculativeEngine.from_pretrained(
        model_name, dtype=dtype, drafter="none", calibrate=False, compile=False
    )
    model, tokenizer = plain_engine.model, plain_engine.tokenizer
    drafted = {
        name: SpeculativeEngine(model, tokenizer, calibration={}, compile=False, **settings)
        for name, settings in SPECULATIVE.items()
    }
    rows = []
    for text in PROMPTS:
        prompt = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            reference = hf_greedy(model, prompt, max_new_tokens)
        plain = plain_engine.generate_ids(prompt, max_new_tokens=max_new_tokens).token_ids
        row: dict[str, Any] = {
            "prompt": text,
            "prompt_tokens": len(prompt),
            "new_tokens": len(plain),
            "plain_vs_generate": first_divergence(plain, reference),
        }
        for name, engine in drafted.items():
            out = engine.generate_ids(prompt, max_new_tokens=max_new_tokens)
            row[f"{name}_vs_plain"] = first_divergence(out.token_ids, plain)
            row[f"{name}_accepted"] = out.stats.num_accepted
        rows.append(row)
    return {
        "dtype": dtype,
        "exactness": plain_engine.exactness,
        "row_exact_mode": plain_engine.row_exactness.mode,
        "prompts": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    """The result as a short report."""
    env = result["environment"]
    lines = [
        f"# Half precision: selfspec's plain text vs transformers' generate ({result['model']})",
        "",
        f"{env['when']}, torch {env['torch']}, transformers {env['transformers']}, {env['threads']} thread(s), "
        f"load {env['load_before']}, CPU bf16 native: {env['cpu_bf16_native']}; greedy, "
        f"{result['max_new_tokens']} new tokens; {result['seconds']:.0f} s.",
        "",
        "First index where two texts differ (`-`: identical for every generated token).",
        "",
    ]
    for run in result["runs"]:
        names = list(SPECULATIVE)
        lines += [
            f"## {run['dtype']}",
            "",
            f"selfspec: {run['exactness']}",
            "",
            "| prompt | new tokens | plain vs generate | " + " | ".join(f"{n} vs plain" for n in names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for row in run["prompts"]:
            cells = [row["prompt"][:40].replace("\n", " ").replace("|", "/") + "…", str(row["new_tokens"])]
            cells += [_cell(row["plain_vs_generate"])] + [_cell(row[f"{n}_vs_plain"]) for n in names]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "What holds: with `row_exact` the speculative text equals selfspec's plain text bit for bit (the",
        "columns `… vs plain`). Against transformers' `generate` (other kernels) the first divergence is",
        "measured, per prompt; on a GPU the 8B-shape figure comes from `benchmarks/gpu_check.py`.",
        "",
    ]
    return "\n".join(lines)


def _cell(index: int | None) -> str:
    return "-" if index is None else str(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="selfspec-demo")
    parser.add_argument("--dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="half_precision_divergence_cpu")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    started = time.time()
    runs = [measure_dtype(args.model, dtype, args.new_tokens) for dtype in args.dtypes.split(",")]
    result = {
        "model": args.model,
        "max_new_tokens": args.new_tokens,
        "seconds": time.time() - started,
        "environment": {
            "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "threads": args.threads,
            "load_before": [round(value, 2) for value in load],
            "load_after": [round(value, 2) for value in os.getloadavg()],
            "cpu_bf16_native": torch.bfloat16 in native_dtypes(torch.device("cpu")),
            "cpu_flags": sorted(cpu_features() & {"amx_bf16", "avx512_bf16", "avx512f", "avx2"}),
        },
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{args.name}.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / f"{args.name}.md", markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
