"""The EAGLE head on SmolLM2-135M-Instruct (CPU, 1 thread): tau and speed, side by side in one run.

Held-out prompts (subjects and tasks that are not in ``train-eagle``'s prompt mix) in three
categories: chat, code, and RAG (a question over a passage). Methods, all greedy, all on the
same loaded model and checked token-identical to plain decoding:

* ``transformers``: transformers' own greedy ``generate``;
* ``plain``: selfspec's loop without drafts (``drafter="none"``), the baseline of the speedups;
* ``prompt_lookup``: n-gram copies from the prompt and output;
* ``eagle_chain``: the shipped head drafting chains, at the draft length chosen by a short
  calibration on other prompts (best measured tokens/s over 2..5);
* ``eagle_tree``: the head drafting EAGLE-2 dynamic trees (``tree_nodes``) of that depth;
* ``eagle_hybrid``: head chains with prompt-lookup copies grafted beside them.

Per method: tokens/s (median over repeats), speedup over ``plain``, tau (tokens per target
forward), and where a round's time goes: drafting, the target's verify forward, and the rest
(acceptance, cache bookkeeping, Python), in milliseconds per round (the prefill is left out).

    python benchmarks/eagle_bench.py            # writes benchmarks/results/eagle_cpu.{json,md,png}
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


RAG_PASSAGES = [
    "The Amazon river flows for about 6,400 kilometres through Peru, Colombia and Brazil before it reaches the "
    "Atlantic Ocean. It carries more water than any other river, about one fifth of all the fresh water that "
    "rivers pour into the oceans. The river has no bridges along its main course, because it runs mostly "
    "through rainforest with few roads, and its width can exceed 40 kilometres in the wet season.",
    "The museum's new wing opened in March. It holds 120 paintings from the nineteenth century, most of them "
    "landscapes donated by the Harlow family. Guided tours start every hour from 10 a.m. to 4 p.m. and last "
    "45 minutes. Tickets cost 12 euros for adults and 6 euros for students; children under 12 enter for free.",
    "Lithium-ion batteries store energy by moving lithium ions between two electrodes. When the battery "
    "charges, the ions move from the cathode to the anode; when it discharges, they move back and power the "
    "device. Heat speeds up the chemical reactions that wear the battery out, so phones last longer when they "
    "are kept cool and are not left fully charged for days.",
]

#: category -> held-out prompts (not in selfspec.training.eagle_prompts).
HELD_OUT: dict[str, list[Any]] = {
    "chat": [
        _user("How do tides work?"),
        _user("Tell me about the history of the violin."),
        _user("What should I know before adopting a cat?"),
        _user("Describe how a bill becomes a law."),
        _user("What makes a good night's sleep?"),
    ],
    "code": [
        _user("Write a Python function that converts a Roman numeral to an integer."),
        _user("Write a Python class for a simple bank account with deposit and withdraw methods."),
        _user("Write a Python function that returns the second largest number in a list."),
        _user("Implement bubble sort in Python."),
        _user("Write a Python function that counts the vowels in a string."),
    ],
    "rag": [
        _user(f"Context:\n{RAG_PASSAGES[0]}\n\nQuestion: How long is the Amazon river, and why has it no bridges?"),
        _user(f"Context:\n{RAG_PASSAGES[1]}\n\nQuestion: What does a visit cost for a family of two adults?"),
        _user(f"Context:\n{RAG_PASSAGES[2]}\n\nQuestion: Why do phones last longer when kept cool?"),
    ],
}
#: prompts for choosing the chain's draft length (neither training nor held-out prompts).
CALIBRATION = [
    _user("Explain why the sky is blue."),
    _user("Write a Python function that checks whether a year is a leap year."),
]


def run_one(engine: Any, prompt_ids: list[int], tokens: int) -> tuple[Any, float]:
    started = time.perf_counter()
    out = engine.generate_ids(prompt_ids, max_new_tokens=tokens)
    return out, time.perf_counter() - started


def transformers_greedy(model: Any, prompt_ids: list[int], tokens: int) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids])
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens, pad_token_id=2
        )
    return out[0, len(prompt_ids) :].tolist(), time.perf_counter() - started


def calibrate_chain(model: Any, tokenizer: Any, head: Any, tokens: int) -> tuple[int, dict[str, float]]:
    """The chain draft length with the best measured tokens/s on the calibration prompts."""
    from selfspec import SpeculativeEngine

    prompts = [SpeculativeEngine(model, tokenizer, drafter="none").encode_prompt(p) for p in CALIBRATION]
    speeds: dict[str, float] = {}
    for k in (2, 3, 4, 5):
        engine = SpeculativeEngine(model, tokenizer, drafter="eagle", eagle_head=head, num_draft_tokens=k)
        run_one(engine, prompts[0], 8)  # warm
        emitted, seconds = 0, 0.0
        for ids in prompts:
            out, took = run_one(engine, ids, tokens)
            emitted, seconds = emitted + len(out.token_ids), seconds + took
        speeds[str(k)] = round(emitted / seconds, 2)
    best = max(speeds, key=lambda k: speeds[k])
    return int(best), speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tree-nodes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "eagle_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from selfspec import SpeculativeEngine
    from selfspec.eagle import find_eagle_head, load_eagle_head
    from selfspec.loading import load_model_and_tokenizer
    from selfspec.realmodels import fetch_model

    path = fetch_model()
    model, tokenizer, _ = load_model_and_tokenizer(path, dtype="float32", device="cpu")
    head_folder = find_eagle_head(str(path), model)
    assert head_folder is not None, "no EAGLE head for SmolLM2 (train one with selfspec train-eagle)"
    head = load_eagle_head(head_folder, model)
    head_config = json.loads((head_folder / "eagle_config.json").read_text(encoding="utf-8"))

    k, calibration = calibrate_chain(model, tokenizer, head, 32)
    print(f"calibrated chain draft length {k}: {calibration}")
    engines = {
        "plain": SpeculativeEngine(model, tokenizer, drafter="none"),
        "prompt_lookup": SpeculativeEngine(model, tokenizer, drafter="prompt_lookup", num_draft_tokens=k),
        "eagle_chain": SpeculativeEngine(model, tokenizer, drafter="eagle", eagle_head=head, num_draft_tokens=k),
        "eagle_tree": SpeculativeEngine(
            model, tokenizer, drafter="eagle", eagle_head=head, num_draft_tokens=k, tree_nodes=args.tree_nodes
        ),
        "eagle_hybrid": SpeculativeEngine(
            model, tokenizer, drafter="eagle_hybrid", eagle_head=head, num_draft_tokens=k
        ),
    }
    plain = engines["plain"]
    results: dict[str, Any] = {}
    all_identical = True
    for category, prompts in HELD_OUT.items():
        seconds: dict[str, list[float]] = {name: [] for name in [*engines, "transformers"]}
        emitted: dict[str, int] = dict.fromkeys(seconds, 0)
        taus: dict[str, list[float]] = {name: [] for name in engines}
        split: dict[str, list[float]] = {name: [0.0, 0.0, 0.0, 0.0] for name in engines}  # draft, verify, rest, rounds
        for prompt in prompts:
            ids = plain.encode_prompt(prompt)
            prefill = statistics.median(
                plain.generate_ids(ids, max_new_tokens=1).stats.verify_seconds for _ in range(3)
            )  # the prompt's forward, left out of the per-round split
            reference: list[int] | None = None
            for repeat in range(args.repeats):
                order = list(engines.items()) if repeat % 2 == 0 else list(reversed(engines.items()))
                for name, engine in order:
                    out, took = run_one(engine, ids, args.tokens)
                    seconds[name].append(took)
                    if repeat == 0:
                        emitted[name] += len(out.token_ids)
                        taus[name].append(out.stats.mean_accepted_length)
                        rounds = max(out.stats.target_forwards - 1, 1)
                        verify = max(out.stats.verify_seconds - prefill, 0.0)  # the rounds' target forwards
                        rest = took - out.stats.draft_seconds - out.stats.verify_seconds
                        parts = [out.stats.draft_seconds, verify, rest, rounds]
                        split[name] = [a + b for a, b in zip(split[name], parts, strict=True)]
                        if reference is None:
                            reference = out.token_ids
                        all_identical &= out.token_ids == reference
                hf_ids, took = transformers_greedy(model, ids, args.tokens)
                seconds["transformers"].append(took)
                if repeat == 0:
                    emitted["transformers"] += len(hf_ids)
                    all_identical &= hf_ids == reference
        row: dict[str, Any] = {}
        for name in seconds:
            per_repeat = [sum(seconds[name][r :: args.repeats]) for r in range(args.repeats)]
            tokens_per_second = emitted[name] / statistics.median(per_repeat)
            row[name] = {"tokens_per_second": round(tokens_per_second, 2)}
            if name in taus:
                row[name]["tau"] = round(statistics.mean(taus[name]), 3)
                draft, verify, rest, rounds = split[name]
                row[name]["draft_share"] = round(draft / max(draft + verify + rest, 1e-9), 3)
                row[name]["ms_per_round"] = {
                    "draft": round(1000 * draft / rounds, 2),
                    "verify": round(1000 * verify / rounds, 2),
                    "rest": round(1000 * rest / rounds, 2),
                }
        base = row["plain"]["tokens_per_second"]
        for name in row:
            row[name]["speedup_vs_plain"] = round(row[name]["tokens_per_second"] / base, 3)
        results[category] = row
        print(category, json.dumps(row))

    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "machine": f"CPU, torch threads {args.threads}; 2 cores shared with other work (timings are noisy)",
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "tree_nodes": args.tree_nodes,
        "calibrated_chain_draft_length": k,
        "calibration_tokens_per_second": calibration,
        "all_outputs_identical_to_plain_and_transformers": all_identical,
        "head": {
            "folder": str(head_folder.relative_to(Path(__file__).parents[1] / "src")),
            "parameters": head.num_parameters(),
            "file_bytes": (head_folder / "eagle_head.safetensors").stat().st_size,
            "draft_vocab_size": head_config.get("draft_vocab_size"),
            "training": head_config.get("training", {}),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
    plot(report, args.out.with_suffix(".png"))


def markdown(report: dict[str, Any]) -> str:
    """The results as a markdown table per category."""
    lines = [
        "# EAGLE head on SmolLM2-135M-Instruct (CPU)",
        "",
        f"{report['machine']}; {report['new_tokens']} new tokens per prompt, greedy, median of "
        f"{report['repeats']} repeats. Chains draft {report['calibrated_chain_draft_length']} tokens (calibrated: "
        f"tokens/s by draft length {report['calibration_tokens_per_second']}); trees at most "
        f"{report['tree_nodes']} nodes. All outputs identical to plain decoding and transformers: "
        f"{report['all_outputs_identical_to_plain_and_transformers']}.",
        "",
        f"Head: {report['head']['parameters']:,} parameters, {report['head']['file_bytes'] / 1e6:.1f} MB (fp16), "
        f"draft vocabulary {report['head']['draft_vocab_size']}; training: "
        f"{json.dumps({k: v for k, v in report['head']['training'].items() if k != 'kinds'})}",
        "",
    ]
    for category, row in report["results"].items():
        lines += [
            f"## {category}",
            "",
            "| method | tokens/s | vs plain | tau | ms per round: draft / verify / rest |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, values in row.items():
            tau = values.get("tau")
            ms = values.get("ms_per_round")
            split = "" if ms is None else f"{ms['draft']:.1f} / {ms['verify']:.1f} / {ms['rest']:.1f}"
            lines.append(
                f"| {name} | {values['tokens_per_second']:.1f} | {values['speedup_vs_plain']:.2f}x | "
                f"{'' if tau is None else f'{tau:.2f}'} | {split} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Speedup over plain decoding per category and method (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    categories = list(report["results"])
    methods = list(next(iter(report["results"].values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [report["results"][c][method]["speedup_vs_plain"] for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories)
    ax.set_ylabel("speedup over selfspec plain loop")
    ax.set_title("SmolLM2-135M-Instruct, CPU 1 thread, greedy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
