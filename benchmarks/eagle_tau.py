"""Tokens per verify of EAGLE heads on SmolLM2-135M-Instruct, on prompts no head was trained on (issue 43).

tau (tokens per target forward, the bonus token counted) at a fixed draft length, greedy, float32,
for each head named, per category of ``eagle_bench.HELD_OUT`` (chat, code, RAG: prompts that are
not in :mod:`selfspec.drafting.eagle.prompts`). Every output is checked against selfspec's plain
loop (which equals transformers' ``generate`` in float32, tested). tau counts tokens and forwards,
not time, so it does not depend on the machine's load; no speed is measured here
(``eagle_bench.py`` does that).

    PYTHONPATH=src python benchmarks/eagle_tau.py --head shipped --head /path/to/eagle3_head

Writes ``benchmarks/results/eagle_tau_cpu.{json,md}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from eagle_bench import HELD_OUT
from result_files import write_result

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import SHIPPED_HEADS
from selfspec.drafting.eagle.train import render_prompt

RESULTS = Path(__file__).parent / "results" / "eagle_tau_cpu"
MODEL = "smollm2-135m-instruct"


def head_record(folder: Path) -> dict[str, Any]:
    """What the head's folder says of it: format, layers, training figures."""
    config_file = next((folder / n for n in ("eagle_config.json", "config.json") if (folder / n).is_file()), None)
    config = json.loads(config_file.read_text()) if config_file else {}
    training_file = folder / "eagle_training.json"
    figures = json.loads(training_file.read_text()).get("figures", {}) if training_file.is_file() else {}
    keep = ("samples", "answer_tokens", "steps", "train_seconds", "write_seconds", "heldout_agreement_per_step")
    return {
        "format": config.get("format") or config.get("speculators_model_type"),
        "training": {k: figures[k] for k in keep if k in figures},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    loaded = SpeculativeEngine.from_pretrained(MODEL, dtype="float32", device="cpu", drafter="none", calibrate=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompts = {kind: [render_prompt(tokenizer, m) for m in messages] for kind, messages in HELD_OUT.items()}
    plain = {
        kind: [loaded.generate_ids(p, max_new_tokens=args.tokens).token_ids for p in ids]
        for kind, ids in prompts.items()
    }
    heads: dict[str, Any] = {}
    for name in args.head:
        folder = Path(SHIPPED_HEADS) / MODEL if name == "shipped" else Path(name)
        engine = SpeculativeEngine(
            model, tokenizer, drafter="eagle", eagle_head=str(folder), num_draft_tokens=args.drafts, calibration={}
        )
        per_kind: dict[str, Any] = {}
        identical = True
        vocab = engine.drafter.head.draft_token_ids
        for kind, ids in prompts.items():
            tokens = rounds = 0
            for prompt, expected in zip(ids, plain[kind], strict=True):
                out = engine.generate_ids(prompt, max_new_tokens=args.tokens)
                identical &= out.token_ids == expected
                forwards = max(out.stats.target_forwards - 1, 1)  # the prefill is not a verify
                rounds += forwards
                tokens += out.stats.mean_accepted_length * forwards
            written = [t for text in plain[kind] for t in text]
            inside = len(written) if vocab is None else int(torch.isin(torch.tensor(written), vocab.cpu()).sum())
            per_kind[kind] = {
                "tau": round(tokens / rounds, 3),
                "verifies": rounds,
                "prompts": len(ids),
                "greedy_tokens_in_draft_vocab": round(inside / len(written), 4),  # caps acceptance
            }
        heads[name] = {"folder": str(folder), **head_record(folder), "tau": per_kind, "identical_to_plain": identical}
        print(name, {k: v["tau"] for k, v in per_kind.items()}, "identical" if identical else "DIFFERENT", flush=True)
    return {
        "model": MODEL,
        "dtype": "float32",
        "threads": 1,
        "num_draft_tokens": args.drafts,
        "max_new_tokens": args.tokens,
        "heads": heads,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def markdown(result: dict[str, Any]) -> str:
    kinds = list(HELD_OUT)
    lines = [
        f"# EAGLE heads on {result['model']}: tokens per verify at {result['num_draft_tokens']} fixed drafts",
        "",
        f"{result['when']}; float32, greedy, {result['max_new_tokens']} new tokens per prompt, held-out prompts "
        f"(`eagle_bench.HELD_OUT`: {', '.join(f'{k} {len(v)}' for k, v in HELD_OUT.items())}); "
        "tau counts the bonus token; produced by `benchmarks/eagle_tau.py`.",
        "",
        "| head | format | samples / steps | held-out agreement (training) | "
        + " | ".join(f"tau {k}" for k in kinds)
        + f" | greedy tokens in the draft vocabulary ({' / '.join(kinds)}) | identical to plain |",
        "|---|---|---|---|" + "---:|" * len(kinds) + "---|:---:|",
    ]
    for name, head in result["heads"].items():
        training = head["training"]
        agreement = " / ".join(f"{a:.2f}" for a in training.get("heldout_agreement_per_step", []))
        taus = " | ".join(f"{head['tau'][k]['tau']:.2f}" for k in kinds)
        covered = " / ".join(f"{head['tau'][k]['greedy_tokens_in_draft_vocab']:.3f}" for k in kinds)
        lines.append(
            f"| {name} | {head['format']} | {training.get('samples', '?')} / {training.get('steps', '?')} | "
            f"{agreement} | {taus} | {covered} | {'yes' if head['identical_to_plain'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", action="append", required=True, help="'shipped' or a head's folder (repeatable)")
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
