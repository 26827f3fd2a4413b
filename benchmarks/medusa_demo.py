"""Medusa heads vs the early exit on the demo model: tau and speed on held-out Austen prompts.

Greedy, one torch thread, every method interleaved in one process on the same model object;
every output is checked against plain decoding. Writes the numbers into the heads'
``medusa_training.json`` (key ``"measured"``) and prints a markdown table.

    python benchmarks/medusa_demo.py [--heads DIR] [--new-tokens 48] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from selfspec import SpeculativeEngine
from selfspec.drafting.medusa.drafter import find_medusa_heads

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    """Measure and record."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default=None)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="none")
    heads = args.heads or find_medusa_heads(base.name_or_path)
    model, tok = base.model, base.tokenizer
    paragraphs = json.loads((ROOT / "tests/data/heldout_austen.json").read_text())["paragraphs"]
    prompts = [tok(p)["input_ids"][: args.prompt_tokens] for p in paragraphs]
    engines = {
        "plain": base,
        "early_exit_auto": SpeculativeEngine(model, tok, drafter="early_exit"),
        "early_exit_E2_k3": SpeculativeEngine(model, tok, exit_layer=2, num_draft_tokens=3, drafter="early_exit"),
        "medusa_k3": SpeculativeEngine(model, tok, drafter="medusa", medusa_heads=heads, num_draft_tokens=3),
        "medusa_auto": SpeculativeEngine(model, tok, drafter="medusa", medusa_heads=heads),
    }
    reference = {i: base.generate_ids(p, max_new_tokens=args.new_tokens).token_ids for i, p in enumerate(prompts)}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    taus: dict[str, list[float]] = {name: [] for name in engines}
    identical = dict.fromkeys(engines, True)
    names = list(engines)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for i, prompt in enumerate(prompts):
            for name in order:
                started = time.perf_counter()
                out = engines[name].generate_ids(prompt, max_new_tokens=args.new_tokens)
                seconds[name].append(time.perf_counter() - started)
                taus[name].append(out.stats.mean_accepted_length)
                identical[name] &= out.token_ids == reference[i]
    tokens = args.new_tokens * len(prompts) * args.repeats
    plain_rate = tokens / sum(seconds["plain"])
    results = {
        name: {
            "tau": round(statistics.mean(taus[name]), 3),
            "tokens_per_second": round(tokens / sum(seconds[name]), 1),
            "speedup_vs_plain": round(tokens / sum(seconds[name]) / plain_rate, 3),
            "identical_to_plain": identical[name],
        }
        for name in names
    }
    print("| method | tau | tok/s | vs selfspec plain | identical |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['tau']:.2f} | {r['tokens_per_second']:.1f} | {r['speedup_vs_plain']:.2f}x "
            f"| {r['identical_to_plain']} |"
        )
    if not args.no_save and heads is not None:
        path = Path(heads) / "medusa_training.json"
        meta = json.loads(path.read_text()) if path.is_file() else {}
        meta["measured"] = {
            "setup": (
                f"CPU, 1 torch thread, greedy, {args.new_tokens} new tokens, first {args.prompt_tokens} tokens of "
                f"the {len(prompts)} held-out Austen paragraphs (tests/data/heldout_austen.json) as prompts, "
                f"{args.repeats} interleaved repeats; benchmarks/medusa_demo.py"
            ),
            "results": results,
        }
        path.write_text(json.dumps(meta, indent=2) + "\n")
        print(f"recorded in {path}")


if __name__ == "__main__":
    main()
