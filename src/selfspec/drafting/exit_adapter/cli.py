"""``selfspec train-adapter``: the command line of :mod:`selfspec.drafting.exit_adapter.train`.

Kept apart from the training code so that building the ``selfspec`` parser imports no torch. The exit layer
trained for without ``--exit-layer`` comes from a ring above this one (the saved calibration): the ``cli`` ring
passes it in when it registers the command (:func:`add_train_adapter_parser`).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...modeling.realmodels import display_name
from ..commands import add_command, add_model_arguments, load_model, settings_from_args

#: Defaults shared with :class:`~selfspec.drafting.exit_adapter.train.AdapterTrainConfig`.
DEFAULTS = {"steps": 400, "rank": 64, "sequences": 128, "seq_len": 128, "batch_size": 8, "lr": 3e-3}


def add_train_adapter_parser(
    subparsers: Any, *, default_exit_layer: Callable[[str, int], int]
) -> argparse.ArgumentParser:
    """Add ``train-adapter`` to the ``selfspec`` command's subparsers.

    Args:
        subparsers: the ``selfspec`` command's subparsers.
        default_exit_layer: the exit layer to train for when ``--exit-layer`` is not given, from the
            model's resolved path and its number of layers.
    """
    parser = add_command(
        subparsers,
        "train-adapter",
        summary="self-distil an exit adapter for the early-exit drafter (no dataset needed)",
        description="Self-distil an exit adapter: the model teaches its own early exit, no dataset needed.",
        func=functools.partial(cmd_train_adapter, default_exit_layer=default_exit_layer),
    )
    add_model_arguments(parser, model_help="hub id, local folder, or 'selfspec-demo'", trust_remote_code=True)
    parser.add_argument("--exit-layer", type=int, default=None, help="default: the calibrated one, else L // 4")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--rank", type=int, default=DEFAULTS["rank"])
    parser.add_argument("--sequences", type=int, default=DEFAULTS["sequences"], help="self-generated texts")
    parser.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=None, help="optional UTF-8 text file mixed into the training text")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: <cache>/exit_adapters/<model>/ (where exit_adapter='auto' looks)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return parser


def cmd_train_adapter(args: argparse.Namespace, *, default_exit_layer: Callable[[str, int], int]) -> int:
    """Train an exit adapter for ``--model`` and save it in the user cache (or in ``--out``)."""
    from .adapter import exit_adapter_path
    from .train import AdapterTrainConfig, train_exit_adapter

    model, tokenizer, path = load_model(args)
    exit_layer = args.exit_layer
    if exit_layer is None:
        exit_layer = default_exit_layer(path, int(model.config.num_hidden_layers))
    texts = [args.data.read_text(encoding="utf-8")] if args.data is not None else []
    config = settings_from_args(AdapterTrainConfig, args, exit_layer=exit_layer)
    result = train_exit_adapter(model, config, tokenizer=tokenizer, texts=texts)
    out = args.out if args.out is not None else exit_adapter_path(path)
    assert out is not None
    result.adapter.config.training["model"] = display_name(args.model)
    result.adapter.save(out)
    print(
        f"exit layer {exit_layer}: greedy agreement with the last layer {result.agreement_before:.3f} -> "
        f"{result.agreement_after:.3f} (held-out self-generated text), KL {result.kl_first:.3f} -> "
        f"{result.kl_last:.3f}, {result.seconds:.0f}s\nsaved to {out}"
    )
    return 0
