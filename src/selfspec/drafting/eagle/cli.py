"""``selfspec train-eagle``: the command line of :mod:`selfspec.drafting.eagle.train`.

Kept apart from the training code so that building the ``selfspec`` parser imports no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..commands import add_command, add_model_arguments, load_model, settings_from_args

#: ``selfspec --help``'s line for the command.
SUMMARY = "self-distil an EAGLE-style draft head for drafter='eagle' (no dataset needed)"
#: ``selfspec train-eagle --help``'s description.
DESCRIPTION = (
    "Self-distil an EAGLE draft head: the model answers a built-in prompt mix, and a one-layer head learns "
    "its next-token distribution from its own features. By default an EAGLE-3 head (three tapped layers, saved "
    "in vLLM's speculators layout, which vllm serve, SGLang and `selfspec export-eagle` take as it is); "
    "--format selfspec trains selfspec's EAGLE-1-style head instead. Resumable: run it again to continue."
)
#: Seconds of the ``--minutes`` budget kept for Python start-up, the final evaluation and saving.
SAVE_RESERVE_SECONDS = 30.0


def add_train_eagle_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``train-eagle`` to the ``selfspec`` command's subparsers."""
    parser = add_command(subparsers, "train-eagle", summary=SUMMARY, description=DESCRIPTION, func=cmd_train_eagle)
    add_model_arguments(parser, model_help="hub id, local folder, .gguf file, or 'selfspec-demo'", dtype="float32")
    parser.add_argument(
        "--minutes", type=float, default=20.0, help="wall-time budget, writing and training (default 20)"
    )
    parser.add_argument("--data", type=Path, default=None, help="prompts, one per line or JSON lines with 'messages'")
    parser.add_argument(
        "--out", type=Path, default=None, help="default: <cache>/eagle_heads/<model>/ (where eagle_head='auto' looks)"
    )
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens the model writes per prompt")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts written together")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary (0: full)")
    parser.add_argument("--unroll", type=int, default=3, help="training-time-test steps")
    parser.add_argument(
        "--format",
        default="eagle3",
        choices=("eagle3", "selfspec"),
        help="eagle3 (default): an EAGLE-3 head on three layers, saved in vLLM's speculators layout (vllm serve "
        "and `selfspec export-eagle` take it as it is); selfspec: an EAGLE-1-style head on the last layer",
    )
    parser.add_argument("--max-samples", type=int, default=None, help="the most prompts answered")
    parser.add_argument("--max-steps", type=int, default=None, help="the most optimizer steps")
    parser.add_argument("--restart", action="store_true", help="ignore the saved data and checkpoint of an earlier run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser


def cmd_train_eagle(args: argparse.Namespace) -> int:
    """Train a head for ``--model`` and save it in the user cache (or in ``--out``)."""
    import shutil
    import time

    from ...artifacts import EAGLE_TRAINING, model_cache
    from ...errors import ConfigurationError
    from .head import head_folder_for
    from .prompts import prompt_mix, read_prompt_file
    from .train import EagleTrainConfig, save_trained_head, train_eagle_head

    if not args.minutes > 0:
        raise ConfigurationError(f"--minutes must be > 0 (the wall-time budget), got {args.minutes}")
    started = time.perf_counter()  # the budget covers loading the model and saving the head too
    prompts = None
    if args.data is not None:
        try:
            prompts = read_prompt_file(str(args.data))
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"--data {args.data}: {exc}") from exc
        prompts = prompts + prompt_mix(args.seed)
    model, tokenizer, path = load_model(args)
    if tokenizer is None:
        raise ConfigurationError(f"{args.model} has no tokenizer: train-eagle needs one to write its prompts")
    out = args.out if args.out is not None else head_folder_for(path)
    state_dir = model_cache(path, EAGLE_TRAINING) / args.format
    if args.restart and state_dir.is_dir():
        shutil.rmtree(state_dir)
    config = settings_from_args(
        EagleTrainConfig,
        args,
        {"draft_vocab_size": "draft_vocab", "head_format": "format"},
        max_seconds=max(args.minutes * 60.0 - (time.perf_counter() - started) - SAVE_RESERVE_SECONDS, 1.0),
    )
    target_name = Path(str(path)).name if Path(str(path)).exists() else str(path)
    if args.format == "eagle3":  # the verifier vLLM loads: the hub id or path as given
        target_name = str(args.model)
    result = train_eagle_head(model, tokenizer, config, target_name=target_name, prompts=prompts, state_dir=state_dir)
    saved = save_trained_head(result, out)
    figures = result.figures
    agreement = " / ".join(f"{a:.2f}" for a in figures["heldout_agreement_per_step"])
    print(
        f"{figures['answer_tokens']} answer tokens written ({figures['samples']} answers), {figures['steps']} steps, "
        f"{figures['train_seconds']:.0f}s training; held-out agreement per draft step {agreement} "
        f"(~{figures['heldout_expected_chain_tokens']:.2f} tokens per round)\nsaved to {saved}\n"
        f"use it with drafter='eagle' (eagle_head='auto' finds it); run again to train further "
        f"(state in {state_dir})"
    )
    return 0
