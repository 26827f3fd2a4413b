"""The command-line arguments shared by ``selfspec`` and ``selfspec serve``.

Types that check a value as it is parsed (one-line errors, exit status 2, before any model
loads), the sampling flags, and the engine options' flags, built from their one declaration
(:class:`~selfspec.decoding.options.EngineOptions`).

A leaf of the CLI: :mod:`selfspec.cli` and :mod:`selfspec.cli.serve` both import from here, and
this module imports neither.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..decoding.options import EngineOptions, bounded_int, number, option_spec
from ..modeling.loading import DEMO_MODEL


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors are one line: ``selfspec: error: ...`` (exit status 2)."""

    def error(self, message: str) -> Any:  # noqa: D102 - argparse's hook
        self.exit(2, f"selfspec: error: {message} (see '{self.prog} --help')\n")


def checked_type(check: Any) -> Any:
    """An argparse ``type`` that applies a :mod:`selfspec.core.validation` check to the parsed value."""

    def parse(value: str) -> Any:
        try:
            return check(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = getattr(check, "__name__", "value")
    return parse


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an int, got {value!r}") from None


def _max_tokens(value: str) -> int:
    from ..core.validation import check_max_new_tokens

    return check_max_new_tokens(_int(value), name="max_tokens")


def add_max_tokens(parser: argparse.ArgumentParser, default: int) -> None:
    """``--max-tokens`` (as the adapters and OpenAI name the budget), alias ``--max-new-tokens`` (the engine's name)."""
    parser.add_argument(
        "--max-tokens",
        "--max-new-tokens",
        dest="max_new_tokens",
        metavar="N",
        type=checked_type(_max_tokens),
        default=default,
        help=f"the most new tokens (default {default}; --max-new-tokens is the same)",
    )


def _temperature(value: str) -> float:
    from ..core.validation import check_temperature

    return check_temperature(number(value))


def _top_k(value: str) -> int | None:
    from ..core.validation import check_top_k

    return check_top_k(_int(value))


def _top_p(value: str) -> float | None:
    from ..core.validation import check_top_p

    return check_top_p(number(value))


def _seed(value: str) -> int | None:
    from ..core.validation import check_seed

    return check_seed(_int(value))


def _stop(value: str) -> str:
    from ..core.validation import check_stop

    return check_stop([value])[0]


def positive_int(value: str) -> int:
    """An int >= 1 (for ``checked_type``)."""
    return bounded_int(value, 1)


def add_engine_arguments(parser: argparse.ArgumentParser, verb: str, default_model: str | None = None) -> None:
    """Add ``--model`` and the flags of every engine option ``verb`` takes (:class:`EngineOptions`).

    :func:`engine_kwargs` reads them back as ``from_pretrained`` keyword arguments.
    """
    from ..modeling.realmodels import REAL_MODELS

    real_models = ", ".join(REAL_MODELS)
    parser.add_argument(
        "--model",
        "-m",
        default=default_model,
        required=default_model is None,
        help=f"hub id, local folder, .gguf file, {DEMO_MODEL!r}, or a real model's short name ({real_models})",
    )
    defaults = EngineOptions.defaults()
    for name in EngineOptions.for_verb(verb):
        spec = option_spec(name)
        default = spec.verb_defaults.get(verb, defaults[name])
        if isinstance(default, bool):  # a switch: --batching turns on, --no-calibrate turns off
            action = "store_false" if default else "store_true"
            parser.add_argument(spec.flag, dest=name, action=action, help=spec.help)
            continue
        listed = f" (one of {', '.join(spec.listed())})" if spec.listed is not None else ""
        parser.add_argument(
            spec.flag,
            dest=name,
            default=default,
            type=checked_type(spec.parse if spec.parse is not None else str),
            choices=spec.choices,
            help=spec.help + listed,
        )
    parser.set_defaults(engine_verb=verb)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    add_max_tokens(parser, 256)
    parser.add_argument("--temperature", type=checked_type(_temperature), default=0.0, help="0 (greedy) or > 0")
    parser.add_argument("--top-k", type=checked_type(_top_k), default=None)
    parser.add_argument("--top-p", type=checked_type(_top_p), default=None)
    parser.add_argument("--seed", type=checked_type(_seed), default=None, help="an int in [0, 2**64 - 1]")
    parser.add_argument(
        "--stop", action="append", type=checked_type(_stop), default=None, help="stop string (repeatable)"
    )
    parser.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="keep only the end of a prompt that does not fit the context window (default: refuse it)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments (all but the model) given on the command line."""
    return {name: getattr(args, name) for name in EngineOptions.for_verb(args.engine_verb)}
