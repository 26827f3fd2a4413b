"""The command-line arguments shared by ``selfspec`` and ``selfspec serve``.

Types that check a value as it is parsed (one-line errors, exit status 2, before any model
loads) and the engine options.

A leaf of the CLI: :mod:`selfspec.cli` and :mod:`selfspec.cli.serve` both import from here, and
this module imports neither.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..decoding.config import DEFAULT_CALIBRATION_BUDGET
from ..drafting import list_drafters
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


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None


def _exit_layer(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        layer = int(value)
    except ValueError:
        raise ValueError(f"exit_layer must be 'auto' or an int >= 1, got {value!r}") from None
    if layer < 1:
        raise ValueError(f"exit_layer must be 'auto' or an int >= 1, got {layer}")
    return layer


def _num_draft_tokens(value: str) -> int | str:
    from ..core.validation import check_num_draft_tokens

    if value == "auto":
        return value
    try:
        number: Any = int(value)
    except ValueError:
        number = value
    return check_num_draft_tokens(number)


def _tree_nodes(value: Any) -> int | str | None:
    from ..core.validation import check_tree_nodes

    if value is None or not isinstance(value, str):
        return check_tree_nodes(value)
    if value.lower() == "none":
        return None
    if value == "auto":
        return value
    try:
        return check_tree_nodes(int(value))
    except ValueError as error:
        if "tree_nodes" in str(error):
            raise
        raise ValueError(f"tree_nodes must be an int, 'auto' or 'none', got {value!r}") from None


def _device(value: str) -> str:
    """``auto``, ``cpu``, or a device this torch build has (checked before any model loads)."""
    kind = value.split(":", 1)[0].lower()
    if kind in ("auto", "cpu"):
        return value
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {value!r}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu or auto"
            )
        index = value.split(":", 1)[1] if ":" in value else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {value!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif kind == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {value!r}: MPS is not available here; use --device cpu or auto")
    else:
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(f"unknown device {value!r}: use auto, cpu, cuda, cuda:N or mps") from None
    return value


def _max_new_tokens(value: str) -> int:
    from ..core.validation import check_max_new_tokens

    return check_max_new_tokens(_int(value))


def _temperature(value: str) -> float:
    from ..core.validation import check_temperature

    return check_temperature(_float(value))


def _top_k(value: str) -> int | None:
    from ..core.validation import check_top_k

    return check_top_k(_int(value))


def _top_p(value: str) -> float | None:
    from ..core.validation import check_top_p

    return check_top_p(_float(value))


def _seed(value: str) -> int | None:
    from ..core.validation import check_seed

    return check_seed(_int(value))


def _stop(value: str) -> str:
    from ..core.validation import check_stop

    return check_stop([value])[0]


def positive_int(value: str) -> int:
    """An int >= 1 (for ``checked_type``)."""
    number = _int(value)
    if number < 1:
        raise ValueError(f"must be an int >= 1, got {number}")
    return number


def calibration_budget(value: str) -> float | None:
    """Seconds (a positive number) or ``none`` (for ``checked_type``)."""
    if value.strip().lower() in ("none", "inf", "unlimited"):
        return None
    from ..decoding.config import check_budget

    seconds = _float(value)
    check_budget(seconds)
    return seconds


def add_engine_arguments(parser: argparse.ArgumentParser, default_model: str | None = None) -> None:
    """Add the engine's loading options (``--model``, ``--drafter``, ...) to a subcommand."""
    from ..modeling.realmodels import REAL_MODELS

    real_models = ", ".join(REAL_MODELS)
    parser.add_argument(
        "--model",
        "-m",
        default=default_model,
        required=default_model is None,
        help=f"hub id, local folder, .gguf file, {DEMO_MODEL!r}, or a real model's short name ({real_models})",
    )
    parser.add_argument("--quantization", choices=["4bit", "8bit"], default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", type=checked_type(_device), help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument(
        "--exit-layer", default="auto", type=checked_type(_exit_layer), help="draft exit layer, or 'auto'"
    )
    parser.add_argument(
        "--num-draft-tokens", default="auto", type=checked_type(_num_draft_tokens), help="draft length, or 'auto'"
    )
    parser.add_argument(
        "--drafter",
        default="auto",
        choices=list_drafters(),  # the drafter registry
        help="how drafts are made (default 'auto': the plan calibration measured fastest, plain decoding "
        "when nothing pays; 'early_exit' for models trained for it)",
    )
    parser.add_argument("--draft-model", default=None, help="with --drafter draft_model: the draft model")
    parser.add_argument(
        "--exit-adapter", default=None, help="trained exit adapter folder for early_exit/hybrid, or 'auto'"
    )
    parser.add_argument(
        "--medusa-heads", default=None, help="with --drafter medusa: a folder of Medusa heads (default: the model's)"
    )
    parser.add_argument(
        "--tree-nodes",
        default=None,
        type=checked_type(_tree_nodes),
        help="draft a token tree of at most N nodes (an int), 'auto' (calibrated choice), or 'none' (a chain)",
    )
    parser.add_argument(
        "--calibration-budget",
        default=DEFAULT_CALIBRATION_BUDGET,
        type=checked_type(calibration_budget),
        help=f"seconds first-load calibration may take, or none (default {DEFAULT_CALIBRATION_BUDGET:.0f})",
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--allow-pickle", action="store_true", help="allow .bin (pickle) weights without safetensors")


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=checked_type(_max_new_tokens), default=256)
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


def _int_or_auto(value: int | str) -> int | str:
    return value if value == "auto" or not isinstance(value, str) else int(value)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments (all but the model) given on the command line."""
    return {
        "quantization": args.quantization,
        "dtype": args.dtype,
        "device": args.device,
        "exit_layer": _int_or_auto(args.exit_layer),
        "num_draft_tokens": _int_or_auto(args.num_draft_tokens),
        "drafter": args.drafter,
        "trust_remote_code": args.trust_remote_code,
        "allow_pickle": args.allow_pickle,
        "draft_model": args.draft_model,
        "exit_adapter": args.exit_adapter,
        "medusa_heads": args.medusa_heads,
        "tree_nodes": _tree_nodes(args.tree_nodes),
        "calibration_budget": args.calibration_budget,
    }
