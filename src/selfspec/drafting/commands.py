"""What the learned heads' commands share: ``train-eagle``, ``export-eagle``, ``train-medusa``, ``train-adapter``.

Each head's ``cli.py`` registers its own command with :func:`add_command`, takes the model and
where it runs with :func:`add_model_arguments`, loads it with :func:`load_model`, and builds
its training settings from the parsed flags with :func:`settings_from_args`. Building the
``selfspec`` parser through these imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def add_command(
    subparsers: Any, name: str, *, summary: str, description: str | None = None, func: Callable[..., int]
) -> argparse.ArgumentParser:
    """Add the command ``name`` to the ``selfspec`` command's subparsers, run by ``func``."""
    parser = subparsers.add_parser(name, help=summary, description=description or summary)
    parser.set_defaults(func=func)
    return parser


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    model_help: str,
    dtype: str = "auto",
    dtypes: tuple[str, ...] | None = None,
    device: str = "auto",
    trust_remote_code: bool = False,
) -> None:
    """``--model``, ``--dtype``, ``--device`` (and ``--trust-remote-code`` when asked)."""
    parser.add_argument("--model", "-m", required=True, help=model_help)
    parser.add_argument("--dtype", default=dtype, choices=dtypes)
    parser.add_argument("--device", default=device)
    if trust_remote_code:
        parser.add_argument("--trust-remote-code", action="store_true")


def load_model(args: argparse.Namespace, dtype: str | None = None) -> tuple[Any, Any, str]:
    """``(model, tokenizer, resolved path)`` of ``--model`` as :func:`add_model_arguments` took it."""
    from ..modeling.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(
        args.model,
        dtype=dtype or args.dtype,
        device=args.device,
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
    )


def settings_from_args(
    settings_type: Callable[..., Any], args: argparse.Namespace, renamed: Mapping[str, str] | None = None, **given: Any
) -> Any:
    """A training-settings dataclass from the parsed flags.

    Every field of ``settings_type`` that a flag of the same name sets (or of the name
    ``renamed`` maps the field to) is taken from ``args``; ``given`` sets fields directly.
    Fields no flag names keep their defaults.
    """
    values, renamed = dict(given), renamed or {}
    for spec in dataclasses.fields(settings_type):  # type: ignore[arg-type]
        flag = renamed.get(spec.name, spec.name)
        if spec.name not in values and hasattr(args, flag):
            values[spec.name] = getattr(args, flag)
    return settings_type(**values)
