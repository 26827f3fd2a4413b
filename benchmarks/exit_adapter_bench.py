"""Exit adapter and draft model on the bundled models: tau and speed, with and without.

Two interleaved benchmarks (``selfspec.calibration.bench``), greedy, outputs checked against transformers:

1. The stock model ``selfspec-demo-draft`` (6 layers, trained without early-exit losses):
   the fixed early exit at layer E with k drafts, without and with the exit adapter shipped
   beside it (``selfspec_E{E}_k{k}`` vs ``selfspec_exit_adapter_E{E}_k{k}``; and
   ``selfspec_hybrid`` vs ``selfspec_hybrid_exit_adapter``).
2. The demo model ``selfspec-demo`` with ``selfspec-demo-draft`` as a separate draft model
   (``selfspec_draft_model``) next to its early-exit methods.

The adapter itself is made by (about 4 minutes on one CPU thread)::

    selfspec train-adapter --model selfspec-demo-draft --exit-layer 2 --steps 600 --threads 1

Usage::

    PYTHONPATH=src python benchmarks/exit_adapter_bench.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from selfspec.calibration.bench import format_category_table, format_table, run_benchmark, write_report
from selfspec.drafting.exit_adapter.adapter import find_exit_adapter, load_exit_adapter
from selfspec.modeling.loading import DEMO_DRAFT_MODEL, DEMO_MODEL, demo_model_path

logger = logging.getLogger("exit_adapter_bench")


def main() -> int:
    """Run both benchmarks and write their JSON and markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--exit-layer", type=int, default=2)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--categories", nargs="*", default=None)
    p.add_argument("--skip-draft-model", action="store_true", help="only the exit-adapter benchmark")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    folder = find_exit_adapter(str(demo_model_path(DEMO_DRAFT_MODEL)))  # shipped beside the model
    assert folder is not None
    adapter = load_exit_adapter(folder)
    if adapter.exit_layer != args.exit_layer:
        raise SystemExit(f"the shipped adapter is for exit layer {adapter.exit_layer}, not {args.exit_layer}")
    common = {
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": 1,
        "temperatures": (),
        "categories": args.categories,
        "num_draft_tokens": args.num_draft_tokens,
    }
    stock = run_benchmark(DEMO_DRAFT_MODEL, exit_layer=args.exit_layer, draft_model=None, **common)
    stock.settings["exit_adapter"] = {"folder": "selfspec-demo-draft/exit_adapter", **vars(adapter.config)}
    written = write_report(stock, args.out, "exit_adapter_cpu")
    plain = stock.methods[f"selfspec_E{args.exit_layer}_k{args.num_draft_tokens}"]
    adapted = stock.methods[f"selfspec_exit_adapter_E{args.exit_layer}_k{args.num_draft_tokens}"]
    base = stock.methods["selfspec_plain"]["tokens_per_second"]
    summary = {
        "exit_layer": args.exit_layer,
        "num_draft_tokens": args.num_draft_tokens,
        "tau_without_adapter": plain["tau"],
        "tau_with_adapter": adapted["tau"],
        "speedup_without_adapter": plain["speedup"],
        "speedup_with_adapter": adapted["speedup"],
        "speedup_over_selfspec_plain_without_adapter": round(plain["tokens_per_second"] / base, 3),
        "speedup_over_selfspec_plain_with_adapter": round(adapted["tokens_per_second"] / base, 3),
        "hybrid_tau_without_adapter": stock.methods["selfspec_hybrid"]["tau"],
        "hybrid_tau_with_adapter": stock.methods["selfspec_hybrid_exit_adapter"]["tau"],
        "hybrid_speedup_without_adapter": stock.methods["selfspec_hybrid"]["speedup"],
        "hybrid_speedup_with_adapter": stock.methods["selfspec_hybrid_exit_adapter"]["speedup"],
        "greedy_identical": all(m["identical_to_greedy"] for m in stock.methods.values()),
        "adapter_agreement_before_after": [
            adapter.config.training.get("agreement_before"),
            adapter.config.training.get("agreement_after"),
        ],
    }
    logger.info("exit adapter: %s", summary)
    training = adapter.config.training
    md = args.out / "exit_adapter_cpu.md"
    note = (
        "Stock model `selfspec-demo-draft` (6 layers, trained without early-exit losses), exit layer "
        f"{args.exit_layer}, {args.num_draft_tokens} drafts, greedy. The exit adapter shipped beside it "
        f"(rank {adapter.config.rank}, {training.get('steps')} self-distillation steps in "
        f"{training.get('seconds', 0):.0f} s, 1 CPU thread) raised held-out greedy agreement "
        f"{training.get('agreement_before')} -> {training.get('agreement_after')}, and here tau "
        f"{summary['tau_without_adapter']} -> {summary['tau_with_adapter']}, speedup over transformers greedy "
        f"{summary['speedup_without_adapter']}x -> {summary['speedup_with_adapter']}x (hybrid: tau "
        f"{summary['hybrid_tau_without_adapter']} -> {summary['hybrid_tau_with_adapter']}, "
        f"{summary['hybrid_speedup_without_adapter']}x -> {summary['hybrid_speedup_with_adapter']}x; "
        "`selfspec_hybrid` uses the calibrated exit layer, the adapter's hybrid its layer). "
        "Made by `benchmarks/exit_adapter_bench.py`."
    )
    title, rest = md.read_text(encoding="utf-8").split("\n\n", 1)
    md.write_text(f"{title}\n\n{note}\n\n{rest}", encoding="utf-8")
    print(format_table(stock))
    if not args.skip_draft_model:
        demo = run_benchmark(DEMO_MODEL, draft_model=DEMO_DRAFT_MODEL, exit_layer=None, **common)
        written += write_report(demo, args.out, "draft_model_cpu")
        draft = demo.methods["selfspec_draft_model"]
        summary["draft_model"] = {
            "tau": draft["tau"],
            "speedup": draft["speedup"],
            "tokens_per_second": draft["tokens_per_second"],
            "greedy_identical": draft["identical_to_greedy"],
            "speedup_over_selfspec_plain": round(
                draft["tokens_per_second"] / demo.methods["selfspec_plain"]["tokens_per_second"], 3
            ),
        }
        print(format_table(demo))
        print(format_category_table(demo))
    path = args.out / "exit_adapter_summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for written_path in [*written, path]:
        print(f"wrote {written_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
