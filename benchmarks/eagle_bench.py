"""The EAGLE head on SmolLM2-135M-Instruct (CPU, 1 thread): tau and speed, side by side in one run.

Held-out prompts (subjects and tasks that are not in ``train-eagle``'s prompt mix) in three
categories: chat, code, and RAG (a question over a passage). Methods, all greedy, all on the
same loaded model and checked token-identical to plain decoding:

* ``transformers``: transformers' own greedy ``generate``;
* ``plain``: selfspec's loop without drafts (``drafter="none"``), the baseline of the speedups;
* ``prompt_lookup``: n-gram copies from the prompt and output;
* ``eagle_chain``: the shipped head drafting chains, at the draft length chosen by a short
  calibration on other prompts (best measured tokens/s over 1..5);
* ``eagle_tree``: the head drafting EAGLE-2 dynamic trees (``tree_nodes``) of that depth;
* ``eagle_hybrid``: head chains with prompt-lookup copies grafted beside them;
* ``eagle_gated`` / ``eagle_hybrid_gated``: the same with the cost gate ``drafter="auto"``
  uses (a token is drafted only while the head's confidence says it pays, judged with the verify
  curve measured here and the head's draft cost; a round may draft nothing), at draft length
  ``GATED_MAX`` (the gate, not a fixed length, decides how many tokens a round drafts);
* ``exit_adapter_chain``: the Kangaroo-style alternative: the model's own early exit read
  through a self-distilled exit adapter (``selfspec train-adapter``, saved under
  ``benchmarks/assets/smollm2_exit_adapter``), drafting chains at the draft length chosen by
  the same short calibration over 2..5;
* ``exit_adapter_hybrid``: the ``hybrid`` drafter (prompt lookup when a match pays, else that
  adapted early exit) at the same draft length.

Per method: tokens/s (median over repeats), speedup over ``plain``, tau (tokens per target
forward), and where a round's time goes: drafting, the target's verify forward, and the rest
(acceptance, cache bookkeeping, Python), in milliseconds per round (the prefill is left out).

For the exit adapter it also reports its greedy agreement with the last layer, teacher-forced
on the held-out prompts and plain decoding's outputs (with and without the adapter).

    python benchmarks/eagle_bench.py            # writes benchmarks/results/eagle_cpu.{json,md,png}
    python benchmarks/eagle_bench.py --methods exit_adapter_chain --out /tmp/quick   # a quick subset
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
#: the most tokens a gated chain drafts
GATED_MAX = 4
EXIT_ADAPTER = Path(__file__).parent / "assets" / "smollm2_exit_adapter"
#: every method, in table order (``plain`` always runs: it is the baseline and the reference).
METHODS = (
    "plain",
    "prompt_lookup",
    "eagle_chain",
    "eagle_tree",
    "eagle_hybrid",
    "eagle_gated",
    "eagle_hybrid_gated",
    "exit_adapter_chain",
    "exit_adapter_hybrid",
    "transformers",
)


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

#: category -> held-out prompts (not in selfspec.drafting.eagle.prompts).
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


def calibrate_chain(model: Any, tokenizer: Any, tokens: int, **engine_options: Any) -> tuple[int, dict[str, float]]:
    """The chain draft length with the best measured tokens/s on the calibration prompts."""
    from selfspec import SpeculativeEngine

    prompts = [SpeculativeEngine(model, tokenizer, drafter="none").encode_prompt(p) for p in CALIBRATION]
    speeds: dict[str, float] = {}
    for k in (1, 2, 3, 4, 5):
        engine = SpeculativeEngine(model, tokenizer, num_draft_tokens=k, **engine_options)
        run_one(engine, prompts[0], 8)  # warm
        emitted, seconds = 0, 0.0
        for ids in prompts:
            out, took = run_one(engine, ids, tokens)
            emitted, seconds = emitted + len(out.token_ids), seconds + took
        speeds[str(k)] = round(emitted / seconds, 2)
    best = max(speeds, key=lambda k: speeds[k])
    return int(best), speeds


@torch.no_grad()
def exit_agreement(model: Any, adapter: Any, ids: list[int], output: list[int]) -> tuple[int, int, int]:
    """Teacher-forced greedy agreement of the exit layer with the last layer on ``output``.

    Returns:
        (positions, agreeing without the adapter, agreeing with the adapter), over the
        positions that predict ``output``'s tokens.
    """
    tokens = torch.tensor([ids + output])
    out = model(input_ids=tokens, output_hidden_states=True, use_cache=False)
    start, end = len(ids) - 1, len(ids) + len(output) - 1
    target = out.logits[0, start:end].argmax(-1)
    state = out.hidden_states[adapter.exit_layer][0, start:end]
    plain = model.lm_head(model.model.norm(state)).argmax(-1)
    adapted = model.lm_head(model.model.norm(adapter(state))).argmax(-1)
    return len(output), int((plain == target).sum()), int((adapted == target).sum())


def measure_gate_costs(model: Any, tokenizer: Any, head: Any) -> Any:
    """The gate's cost model, measured here as calibration does: the verify curve and the head's draft step."""
    from selfspec import SpeculativeEngine
    from selfspec.calibration.measure import measure_costs
    from selfspec.core.speed import CostModel
    from selfspec.drafting.eagle.calibration import measure_eagle

    engine = SpeculativeEngine(model, tokenizer, drafter="none")
    ids = [engine.encode_prompt(p) for p in CALIBRATION]
    _, verify, step_seconds = measure_costs(engine, ids[0], [1], list(range(1, GATED_MAX + 1)))
    draft = measure_eagle(engine, ids, 16, step_seconds, head=head)["draft_cost"]
    return CostModel(round(float(draft), 4), {k: round(v, 4) for k, v in verify.items()})


def parse_methods(text: str) -> list[str]:
    """``--methods``: ``all`` or a comma-separated subset of :data:`METHODS` (``plain`` is always added)."""
    if text == "all":
        return list(METHODS)
    chosen = {m.strip() for m in text.split(",") if m.strip()}
    unknown = chosen - set(METHODS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    return [m for m in METHODS if m in chosen or m == "plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tree-nodes", type=int, default=10)
    parser.add_argument("--calibration-tokens", type=int, default=32, help="new tokens per calibration prompt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "eagle_cpu")
    parser.add_argument(
        "--methods",
        type=parse_methods,
        default=list(METHODS),
        help=f"'all' (default) or a comma-separated subset of: {', '.join(METHODS)} (plain always runs)",
    )
    parser.add_argument("--exit-adapter", type=Path, default=EXIT_ADAPTER, help="exit adapter folder")
    parser.add_argument(
        "--eagle-head",
        type=Path,
        default=None,
        help="an EAGLE head's folder (default: the one eagle_head='auto' finds)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    uptime_before = os.popen("uptime").read().strip()
    print(f"uptime: {uptime_before}")
    methods: list[str] = args.methods

    from selfspec import SpeculativeEngine
    from selfspec.drafting.eagle.drafter import EagleDrafter
    from selfspec.drafting.eagle.head import find_eagle_head, load_eagle_head
    from selfspec.drafting.exit_adapter.adapter import load_exit_adapter
    from selfspec.modeling.loading import load_model_and_tokenizer
    from selfspec.modeling.realmodels import fetch_model

    path = fetch_model()
    model, tokenizer, _ = load_model_and_tokenizer(path, dtype="float32", device="cpu")
    eagle_methods = [m for m in methods if m.startswith("eagle_")]
    adapter_methods = [m for m in methods if m.startswith("exit_adapter_")]
    engines: dict[str, Any] = {"plain": SpeculativeEngine(model, tokenizer, drafter="none")}
    report_head: dict[str, Any] | None = None
    k: int | None = None
    calibration: dict[str, float] = {}
    if eagle_methods:
        head_folder = args.eagle_head or find_eagle_head(str(path), model)
        assert head_folder is not None, "no EAGLE head for SmolLM2 (train one with selfspec train-eagle)"
        head = load_eagle_head(head_folder, model)
        config_file = head_folder / "eagle_config.json"
        if not config_file.is_file():  # a speculators-layout (EAGLE-3) head
            config_file = head_folder / "config.json"
        head_config = json.loads(config_file.read_text(encoding="utf-8"))
        training_file = head_folder / "eagle_training.json"
        if "training" not in head_config and training_file.is_file():
            head_config["training"] = json.loads(training_file.read_text(encoding="utf-8")).get("figures", {})
        weights = next(
            f for f in (head_folder / "eagle_head.safetensors", head_folder / "model.safetensors") if f.is_file()
        )
        src = Path(__file__).parents[1] / "src"
        k, calibration = calibrate_chain(
            model, tokenizer, args.calibration_tokens, drafter="eagle", eagle_head=head, calibration={}
        )
        print(f"calibrated chain draft length {k}: {calibration}")
        costs: Any = None
        if any(m.endswith("_gated") for m in methods):
            costs = measure_gate_costs(model, tokenizer, head)
            print(f"cost model of the gate: {costs}")
        report_head = {
            "folder": str(head_folder.relative_to(src) if head_folder.is_relative_to(src) else head_folder),
            "parameters": head.num_parameters(),
            "file_bytes": weights.stat().st_size,
            "draft_vocab_size": head_config.get("draft_vocab_size"),
            "training": head_config.get("training", {}),
            "gate_costs": None if costs is None else {"draft": costs.draft, "verify": costs.verify},
        }
    adapter: Any = None
    report_adapter: dict[str, Any] | None = None
    k_adapter: int | None = None
    if adapter_methods:
        adapter = load_exit_adapter(args.exit_adapter)
        adapter_options = {"exit_layer": adapter.exit_layer, "exit_adapter": adapter}
        k_adapter, adapter_calibration = calibrate_chain(
            model, tokenizer, args.calibration_tokens, drafter="early_exit", **adapter_options
        )
        print(f"calibrated exit-adapter chain draft length {k_adapter}: {adapter_calibration}")
        training = adapter.config.training
        repo = Path(__file__).parents[1]
        folder = args.exit_adapter.resolve()
        report_adapter = {
            "folder": str(folder.relative_to(repo)) if folder.is_relative_to(repo) else str(folder),
            "exit_layer": adapter.exit_layer,
            "rank": adapter.config.rank,
            "parameters": sum(p.numel() for p in adapter.parameters()),
            "file_bytes": (args.exit_adapter / "adapter.safetensors").stat().st_size,
            "steps": training.get("steps"),
            "train_seconds": training.get("seconds"),
            "heldout_agreement_before": training.get("agreement_before"),
            "heldout_agreement_after": training.get("agreement_after"),
            "training": training,
            "calibrated_chain_draft_length": k_adapter,
            "calibration_tokens_per_second": adapter_calibration,
            "benchmark_output_agreement": {},
        }
    k_lookup = k if k is not None else (k_adapter if k_adapter is not None else 3)
    factories: dict[str, Any] = {
        "prompt_lookup": lambda: SpeculativeEngine(
            model, tokenizer, drafter="prompt_lookup", num_draft_tokens=k_lookup
        ),
        # calibration={}: fixed-length chains (with the model's saved calibration the gate would apply)
        "eagle_chain": lambda: SpeculativeEngine(
            model, tokenizer, drafter="eagle", eagle_head=head, num_draft_tokens=k, calibration={}
        ),
        "eagle_tree": lambda: SpeculativeEngine(
            model,
            tokenizer,
            drafter="eagle",
            eagle_head=head,
            num_draft_tokens=k,
            tree_nodes=args.tree_nodes,
            calibration={},
        ),
        "eagle_hybrid": lambda: SpeculativeEngine(
            model, tokenizer, drafter="eagle_hybrid", eagle_head=head, num_draft_tokens=k, calibration={}
        ),
        "eagle_gated": lambda: SpeculativeEngine(
            model, tokenizer, drafter=EagleDrafter(head, costs=costs), num_draft_tokens=GATED_MAX
        ),
        "eagle_hybrid_gated": lambda: SpeculativeEngine(
            model, tokenizer, drafter=EagleDrafter(head, costs=costs, lookup=True), num_draft_tokens=GATED_MAX
        ),
        "exit_adapter_chain": lambda: SpeculativeEngine(
            model, tokenizer, drafter="early_exit", num_draft_tokens=k_adapter, **adapter_options
        ),
        "exit_adapter_hybrid": lambda: SpeculativeEngine(
            model, tokenizer, drafter="hybrid", num_draft_tokens=k_adapter, **adapter_options
        ),
    }
    for name in methods:
        if name in factories:
            engines[name] = factories[name]()
    run_transformers = "transformers" in methods
    plain = engines["plain"]
    results: dict[str, Any] = {}
    all_identical = True
    for category, prompts in HELD_OUT.items():
        seconds: dict[str, list[float]] = {name: [] for name in [*engines, *(["transformers"] * run_transformers)]}
        emitted: dict[str, int] = dict.fromkeys(seconds, 0)
        taus: dict[str, list[float]] = {name: [] for name in engines}
        split: dict[str, list[float]] = {name: [0.0, 0.0, 0.0, 0.0] for name in engines}  # draft, verify, rest, rounds
        agree = [0, 0, 0]  # exit adapter: positions, plain exit agreeing, adapted exit agreeing
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
                if run_transformers:
                    hf_ids, took = transformers_greedy(model, ids, args.tokens)
                    seconds["transformers"].append(took)
                    if repeat == 0:
                        emitted["transformers"] += len(hf_ids)
                        all_identical &= hf_ids == reference
            if adapter is not None and reference is not None:
                counts = exit_agreement(model, adapter, ids, reference)
                agree = [a + b for a, b in zip(agree, counts, strict=True)]
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
        if report_adapter is not None:
            report_adapter["benchmark_output_agreement"][category] = {
                "positions": agree[0],
                "plain_exit": round(agree[1] / max(agree[0], 1), 3),
                "with_adapter": round(agree[2] / max(agree[0], 1), 3),
            }

    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)",
        "machine": f"CPU, torch threads {args.threads}; 2 cores shared with other work (timings are noisy)",
        "uptime_before": uptime_before,
        "uptime_after": os.popen("uptime").read().strip(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "new_tokens": args.tokens,
        "repeats": args.repeats,
        "tree_nodes": args.tree_nodes,
        "methods": list(engines) + (["transformers"] if run_transformers else []),
        "calibrated_chain_draft_length": k,
        "calibration_tokens_per_second": calibration,
        "prompt_lookup_draft_length": k_lookup,
        "all_outputs_identical_to_plain_and_transformers": all_identical,
        "head": report_head,
        "exit_adapter": report_adapter,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
    plot(report, args.out.with_suffix(".png"))


def markdown(report: dict[str, Any]) -> str:
    """The results as a markdown table per category."""
    lines = [
        "# EAGLE head and exit adapter on SmolLM2-135M-Instruct (CPU)",
        "",
        f"{report['machine']}; {report['new_tokens']} new tokens per prompt, greedy, median of "
        f"{report['repeats']} repeats; load before/after: `{report.get('uptime_before', '')}` / "
        f"`{report.get('uptime_after', '')}`. All outputs identical to plain decoding"
        f"{' and transformers' if 'transformers' in report.get('methods', ['transformers']) else ''}: "
        f"{report['all_outputs_identical_to_plain_and_transformers']}.",
        "",
    ]
    if report.get("calibrated_chain_draft_length") is not None:
        lines += [
            f"EAGLE chains draft {report['calibrated_chain_draft_length']} tokens (calibrated: tokens/s by draft "
            f"length {report['calibration_tokens_per_second']}); trees at most {report['tree_nodes']} nodes; "
            f"prompt lookup drafts {report.get('prompt_lookup_draft_length', report['calibrated_chain_draft_length'])}"
            ".",
            "",
        ]
    head = report.get("head")
    if head:
        lines += [
            f"Head: {head['parameters']:,} parameters, {head['file_bytes'] / 1e6:.1f} MB (fp16), "
            f"draft vocabulary {head['draft_vocab_size']}; training: "
            f"{json.dumps({k: v for k, v in head['training'].items() if k != 'kinds'})}",
            "",
        ]
        if head.get("gate_costs"):
            lines += [
                f"The gated rows' cost model, measured in this run (relative to one plain step): "
                f"{json.dumps(head['gate_costs'])}; they draft at most {GATED_MAX} tokens.",
                "",
            ]
    adapter = report.get("exit_adapter")
    if adapter:
        agreement = "; ".join(
            f"{c} {v['plain_exit']:.2f} -> {v['with_adapter']:.2f}"
            for c, v in adapter["benchmark_output_agreement"].items()
        )
        lines += [
            f"Exit adapter (`{adapter['folder']}`, Kangaroo-style: the model's own layers "
            f"0..{adapter['exit_layer'] - 1} plus a rank-{adapter['rank']} residual SwiGLU adapter before the "
            f"shared norm and head): exit layer "
            f"{adapter['exit_layer']}, {adapter['parameters']:,} parameters, "
            f"{adapter['file_bytes'] / 1e6:.2f} MB (fp32); {adapter['steps']} steps, "
            f"{adapter['train_seconds']:.0f} s of training (sampling included); greedy agreement with the last "
            f"layer on held-out self-generated text {adapter['heldout_agreement_before']:.3f} -> "
            f"{adapter['heldout_agreement_after']:.3f}; teacher-forced on this benchmark's outputs (plain exit -> "
            f"adapted): {agreement}. Chains (and the hybrid) draft {adapter['calibrated_chain_draft_length']} "
            f"tokens (calibrated: tokens/s by draft length {adapter['calibration_tokens_per_second']}).",
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
    fig, ax = plt.subplots(figsize=(9.5, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [report["results"][c][method]["speedup_vs_plain"] for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories)
    ax.set_ylabel("speedup over selfspec plain loop")
    ax.set_title("SmolLM2-135M-Instruct, CPU 1 thread, greedy")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
