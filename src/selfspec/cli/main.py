"""The ``selfspec`` command line: ``generate``, ``chat``, ``calibrate``, ``bench``, ``demo``, ``serve``, ...

``train-medusa`` trains Medusa heads (:mod:`selfspec.drafting.medusa.train`), ``train-eagle`` an EAGLE-style
head (:mod:`selfspec.drafting.eagle.train`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..calibration.bench import DEFAULT_BENCH_TREE_NODES, method_families
from ..errors import SelfSpecError
from ..modeling.loading import DEMO_MODEL
from ..prompts import PROMPT_SETS, STOCK_PROMPT_SETS
from .args import (
    ArgumentParser,
    _sampling_args,
    add_engine_arguments,
    add_max_tokens,
    engine_kwargs,
)

DEMO_PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune,"


def _load(args: argparse.Namespace) -> Any:
    from ..decoding.engine import SpeculativeEngine

    return SpeculativeEngine.from_pretrained(args.model, **engine_kwargs(args))


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "truncate_prompt": args.truncate_prompt,
    }


def _format_stats(stats: Any) -> str:
    return (
        f"{stats.tokens_per_second:.1f} tok/s, tau {stats.mean_accepted_length:.2f}, "
        f"acceptance {stats.acceptance_rate:.2f}, target forwards {stats.target_forwards}"
    )


def generate_prompt(text: str, tokenizer: Any, *, raw: bool = False, chat: bool = False) -> str | list[dict[str, str]]:
    """What ``selfspec generate`` sends: one user turn when the model has a chat template, else the text.

    An instruct model given bare text often ends at once (SmolLM2 answers the Italy question with an
    empty line), so the text becomes a user message in the model's chat template, as chat UIs and
    servers do. ``raw`` sends the text as is; ``chat`` asks for the template even where the tokenizer
    has none (the engine then says it has none).
    """
    if raw:
        return text
    if chat or getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": text}]
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion for one prompt and print it."""
    engine = _load(args)
    prompt = generate_prompt(args.prompt, engine.tokenizer, raw=args.raw, chat=args.chat)
    if not isinstance(prompt, str):
        print("selfspec: chat template applied (--raw sends the text as is)", file=sys.stderr, flush=True)
    stream = engine.stream(prompt, **_sampling(args))
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    if args.stats and stream.stats is not None:
        print(_format_stats(stream.stats), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat that streams the model's answers; an empty line or EOF quits."""
    engine = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(f"Chatting with {args.model} ({engine.drafter!r}). Empty line to quit.")
    while True:
        try:
            user = input("> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        stream = engine.stream(messages, **_sampling(args))
        parts = []
        for delta in stream:
            parts.append(delta)
            print(delta, end="", flush=True)
        print()
        if stream.stats is not None:
            print(f"  [{_format_stats(stream.stats)}]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(parts)})
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Decode one prompt plainly and speculatively on the demo model; show both side by side."""
    from ..decoding.engine import SpeculativeEngine

    print(f"Loading {args.model} ...")
    engine = _load(args)
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none")
    print(f"{engine!r}\n\nPrompt: {args.prompt!r}\n")
    sampling = {"max_new_tokens": args.max_new_tokens}
    plain.generate(args.prompt, max_new_tokens=8)  # warm up both paths once
    engine.generate(args.prompt, max_new_tokens=8)
    base = plain.generate(args.prompt, **sampling)
    spec = engine.generate(args.prompt, **sampling)
    print(f"--- plain decoding ({_format_stats(base.stats)})\n{base.text}\n")
    print(
        f"--- self-speculative, exit layer {engine.exit_layer}, {engine.num_draft_tokens} drafts "
        f"({_format_stats(spec.stats)})\n{spec.text}\n"
    )
    identical = base.token_ids == spec.token_ids
    speedup = spec.stats.tokens_per_second / max(base.stats.tokens_per_second, 1e-9)
    print(f"identical text: {'yes' if identical else 'NO'}")
    print(
        f"speedup: {speedup:.2f}x   tau: {spec.stats.mean_accepted_length:.2f}   "
        f"acceptance rate: {spec.stats.acceptance_rate:.2f}"
    )
    return 0 if identical else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure agreement and costs on this hardware; save the best exit layer and draft length."""
    from ..calibration.measure import calibrate, show_progress
    from ..decoding.engine import SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(
        args.model,
        **engine_kwargs(args),  # loading options only: calibrate measures with its own engine
        drafter="early_exit",  # a fixed engine to measure with; the plan it saves is for drafter="auto"
        exit_layer=1,
        num_draft_tokens=1,
    )
    result = calibrate(
        engine,
        max_new_tokens=args.max_new_tokens,
        save=not args.no_save,
        layer_skip=args.drafter == "layer_skip",
        trees=args.trees,
        budget=args.calibration_budget,
        progress=show_progress(),  # a bar on a terminal, a line per phase and every few seconds off one
    )
    print(f"{'exit layer':>10} {'agreement':>10} {'draft cost':>11}")
    for layer, agreement in result.agreement.items():
        print(f"{layer:>10} {agreement:>10.3f} {result.draft_cost[layer]:>11.3f}")
    print("verify cost (k drafts): " + ", ".join(f"{k}: {v:.2f}" for k, v in result.verify_cost.items()))
    print(
        f"chosen: exit_layer={result.exit_layer}, num_draft_tokens={result.num_draft_tokens}, "
        f"expected speedup {result.expected_speedup:.2f}x"
    )
    print(f"drafter='auto' plan: {result.plan.summary()}")
    if result.sampled_plan is not None:
        print(f"when sampling: {result.sampled_plan.summary()}")
    if result.skipped:
        print(f"skipped for the {args.calibration_budget:.0f} s budget: {', '.join(result.skipped)}")
    if result.dropped:
        print(f"dropped after their pilot (could not pay here): {', '.join(result.dropped)}")
    for note in result.notes:  # what each drafter's calibration saved
        print(note)
    advice = result.plan.advice(engine.name_or_path, has_head=bool(result.figures.get("eagle")))
    if advice:
        print(advice)
    if result.tree_speed:
        speeds = ", ".join(f"{k}: {v:.1f}" for k, v in result.tree_speed.items())
        print(f"tokens/s by tree nodes ({speeds}); chosen tree_nodes={result.tree_nodes}")
    if not args.no_save:
        from ..calibration import calibration_path
        from ..calibration.store import unsaved_reason

        where = calibration_path(engine.name_or_path, engine.runner.device, engine.runner.dtype)
        reason = unsaved_reason(where)
        print(f"not saved ({reason}): kept for this process only" if reason else f"saved to {where}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the side-by-side benchmark and write JSON, markdown and a PNG plot."""
    import json as _json

    from ..calibration.bench import format_category_table, format_table, run_benchmark, write_report

    prompt_sets = None
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompt_sets = _json.load(f)
    report = run_benchmark(
        args.model,
        prompt_sets=prompt_sets,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        exit_layer=args.exit_layer,
        num_draft_tokens=args.num_draft_tokens,
        categories=args.categories,
        methods=args.methods,
        temperatures=args.temperatures,
        tree_nodes=args.tree_nodes,
        **engine_kwargs(args),
    )
    print(format_table(report))
    print()
    print(format_category_table(report))
    if args.out:
        for path in write_report(report, args.out, args.name):
            print(f"wrote {path}")
    return 0


#: The entry-point group of installed drafters: each entry names a module that calls ``register_drafter``.
DRAFTER_ENTRY_POINTS = "selfspec.drafters"
#: Modules to import for their drafters too, comma-separated (a drafter not installed as a package).
DRAFTERS_ENV = "SELFSPEC_DRAFTERS"


def load_drafter_plugins() -> None:
    """Import the drafters installed for ``selfspec`` (entry points) and named by ``$SELFSPEC_DRAFTERS``.

    Their registrations declare their options, so their flags are on every verb they apply to
    (``docs/custom_drafter.md``). Nothing is imported when none is installed.

    Raises:
        SystemExit: a module that does not import, with its error.
    """
    import importlib
    from importlib.metadata import entry_points

    names = [entry.value.split(":")[0] for entry in entry_points(group=DRAFTER_ENTRY_POINTS)]
    names += [name.strip() for name in os.environ.get(DRAFTERS_ENV, "").split(",") if name.strip()]
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
        except Exception as error:  # a broken plugin: say which, before any model loads
            raise SystemExit(f"selfspec: error: the drafter module {name!r} does not import: {error}") from error


def calibrated_exit_layer(path: str, num_layers: int) -> int:
    """The exit layer ``train-adapter`` trains for without ``--exit-layer``: the calibrated one, else ``L // 4``.

    Here rather than in the head's folder: the saved calibration is a ring above ``drafting``.
    """
    from ..calibration import load_calibration
    from ..decoding.config import default_exit_layer

    saved = (load_calibration(path) or {}).get("exit_layer")
    return saved if isinstance(saved, int) else default_exit_layer(num_layers)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``selfspec`` command (with the flags of every installed drafter's options)."""
    from .. import __version__

    load_drafter_plugins()
    parser = ArgumentParser(prog="selfspec", description="Lossless self-speculative decoding.")
    parser.add_argument("--version", action="version", version=f"selfspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_engine_arguments(gen, "generate", default_model=DEMO_MODEL)
    _sampling_args(gen)
    gen.add_argument("prompt")
    template = gen.add_mutually_exclusive_group()
    template.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is (default: as a user turn in the model's chat template, when it has one)",
    )
    template.add_argument("--chat", action="store_true", help="deprecated, the default: the prompt as a user turn")
    gen.add_argument("--stats", action="store_true", help="print speculation stats to stderr")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    add_engine_arguments(chat, "chat", default_model=DEMO_MODEL)
    _sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    cal = sub.add_parser("calibrate", help="choose exit layer and draft length by measurement")
    add_engine_arguments(cal, "calibrate")
    add_max_tokens(cal, 48)
    cal.add_argument("--no-save", action="store_true", help="print the result without saving it")
    cal.add_argument(
        "--trees", action="store_true", help="also race early-exit token trees against the chain (tree_nodes='auto')"
    )
    cal.add_argument(
        "--drafter",
        default="early_exit",
        choices=["early_exit", "layer_skip"],
        help="layer_skip also searches the layer-skip drafter's layers",
    )
    cal.set_defaults(func=cmd_calibrate)

    bench = sub.add_parser("bench", help="benchmark plain, transformers' speculative modes and selfspec")
    add_engine_arguments(bench, "bench", default_model=DEMO_MODEL)
    bench.add_argument("--prompts", default=None, help='JSON file {"category": [prompt, ...]}')
    add_max_tokens(bench, 96)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--exit-layer", type=int, default=None)
    bench.add_argument("--num-draft-tokens", type=int, default=None)
    bench.add_argument(
        "--categories",
        nargs="*",
        default=None,
        help="prompt categories to run (checked before loading): for selfspec-demo "
        + ", ".join(PROMPT_SETS)
        + "; for any other model "
        + ", ".join(STOCK_PROMPT_SETS)
        + "; or those of --prompts",
    )
    bench.add_argument(
        "--methods",
        nargs="*",
        default=None,
        help="method families to run (baselines always run): " + ", ".join(method_families()) + "; default all",
    )
    bench.add_argument("--temperatures", nargs="*", type=float, default=[0.7, 1.0])
    bench.add_argument(
        "--tree-nodes",
        nargs="*",
        type=int,
        default=list(DEFAULT_BENCH_TREE_NODES),
        help="node budgets of early-exit token trees to compare with the chain (no value: no trees)",
    )
    bench.add_argument("--out", default=None, help="folder for JSON, markdown and PNG results")
    bench.add_argument("--name", default="bench", help="file name stem of the results")
    bench.set_defaults(func=cmd_bench)

    demo = sub.add_parser("demo", help="plain vs speculative decoding on the bundled demo model")
    add_engine_arguments(demo, "demo", default_model=DEMO_MODEL)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    add_max_tokens(demo, 128)
    demo.set_defaults(func=cmd_demo)

    from ..drafting.eagle.catalog_cli import add_eagle_heads_parser
    from ..drafting.eagle.cli import add_train_eagle_parser
    from ..drafting.eagle.export_cli import add_export_eagle_parser
    from ..drafting.exit_adapter.cli import add_train_adapter_parser
    from ..drafting.medusa.cli import add_train_medusa_parser

    add_train_adapter_parser(sub, default_exit_layer=calibrated_exit_layer)
    add_train_eagle_parser(sub)
    add_export_eagle_parser(sub)
    add_eagle_heads_parser(sub)

    add_train_medusa_parser(sub)

    from .serve import add_serve_parser  # FastAPI/uvicorn are imported only when `serve` runs

    add_serve_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``selfspec`` console script.

    Argument errors are one ``selfspec: error: ...`` line and exit status 2, before any model
    loads; so are the errors the engine raises for bad input (``ValueError``, ``OSError``).
    """
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help, --version and argument errors (already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    threads = getattr(args, "threads", None)
    if isinstance(threads, int):  # the verbs that load an engine also pass it on (threads="auto" chooses there)
        import torch

        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args))
    except (SelfSpecError, ValueError, OSError) as exc:
        print(f"selfspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
