"""``selfspec train-medusa``: self-distil Medusa heads for a model (registered by :func:`add_train_medusa_parser`)."""

from __future__ import annotations

import argparse
from typing import Any

from ...modeling.loading import DEMO_MODEL
from ...modeling.realmodels import display_name
from ..commands import add_command, add_model_arguments, load_model, settings_from_args


def cmd_train_medusa(args: argparse.Namespace) -> int:
    """Self-distil Medusa heads for a model and save them in the published Medusa layout."""
    from .drafter import medusa_heads_folder
    from .train import MedusaTrainConfig, save_medusa_training, train_medusa_heads

    model, tokenizer, path = load_model(args)
    model.config._name_or_path = path
    out = args.out or medusa_heads_folder(path)
    user_tokens = None
    if args.data:
        if tokenizer is None:
            raise ValueError("--data needs the model's tokenizer, and this model has none")
        with open(args.data, encoding="utf-8") as f:
            user_tokens = list(tokenizer(f.read(), add_special_tokens=False)["input_ids"])
    cfg = settings_from_args(
        MedusaTrainConfig,
        args,
        {"num_heads": "heads", "num_layers": "layers"},
        max_seconds=args.max_minutes * 60 if args.max_minutes else None,
    )
    result = train_medusa_heads(model, cfg, user_tokens=user_tokens)
    result.heads.base_model_name_or_path = str(args.model)
    extra = {"model": display_name(args.model), "data": args.data, "threads": args.threads}
    saved = save_medusa_training(result, cfg, out, extra)
    accuracy = " ".join(f"{a:.2f}" for a in result.head_accuracy)
    print(f"trained {cfg.num_heads} heads, {result.steps_done} steps in {result.seconds:.0f}s")
    print(f"held-out top-1 agreement per head: {accuracy}")
    print(f"saved to {saved}")
    return 0


def _threads(value: str) -> int:
    """``--threads``: an int >= 1."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value!r}")
    return number


def add_train_medusa_parser(subparsers: Any) -> None:
    """Add ``train-medusa`` to the ``selfspec`` command's subparsers."""
    medusa = add_command(
        subparsers,
        "train-medusa",
        summary="train Medusa heads for a model by self-distillation",
        func=cmd_train_medusa,
    )
    add_model_arguments(
        medusa, model_help=f"hub id, local folder, or {DEMO_MODEL!r}", dtype="float32", trust_remote_code=True
    )
    medusa.add_argument("--heads", type=int, default=4, help="number of heads")
    medusa.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    medusa.add_argument("--steps", type=int, default=200)
    medusa.add_argument("--batch-size", type=int, default=64, help="sequences the model writes per round")
    medusa.add_argument("--micro-batch", type=int, default=16, help="sequences per optimizer step")
    medusa.add_argument("--seed-tokens", type=int, default=8, help="length of each prompt")
    medusa.add_argument("--new-tokens", type=int, default=64, help="tokens the model writes per prompt")
    medusa.add_argument("--lr", type=float, default=3e-3)
    medusa.add_argument("--max-minutes", type=float, default=None, help="stop after this long")
    medusa.add_argument("--data", default=None, help="optional text file: prompts are spans of it")
    medusa.add_argument(
        "--out",
        default=None,
        help="output folder (default: <cache>/medusa_heads/<model>/, where drafter='medusa' looks)",
    )
    medusa.add_argument("--seed", type=int, default=0)
    medusa.add_argument("--threads", type=_threads, default=None, help="torch CPU threads")
