"""What holds between an engine's greedy speculative text and its plain text (``row_exact=``, ``docs/kernels.md``)."""

from __future__ import annotations

from typing import Any

import torch

from ..modeling.attention import ROW_EXACT_DTYPES
from ..modeling.kernels import KERNELS, ROWS, RowExactness, resolve_row_exact, uses_row_invariant_kernels
from ..modeling.runner import ModelRunner
from .options import EngineOptions


def set_row_exactness(runner: ModelRunner, options: EngineOptions, model: Any) -> RowExactness:
    """Resolve ``row_exact=`` for this model and set the runner's forwards to match."""
    unsupported = runner.row_kernels_refusal()
    if unsupported is None and options.batching:
        unsupported = "single calls (batching=False)"
    elif unsupported is None and (options.tree_nodes is not None or options.drafter == "medusa"):
        unsupported = "chain drafts (no token trees)"
    exactness = resolve_row_exact(
        options.row_exact,
        runner.device,
        runner.dtype,
        unsupported=unsupported,
        marked=uses_row_invariant_kernels(model),
    )
    runner.use_row_kernels(exactness.kernels)
    runner.row_exact = exactness.mode == ROWS
    return exactness


def describe_exactness(exactness: RowExactness, dtype: torch.dtype, *, static: bool) -> str:
    """:attr:`~selfspec.decoding.engine.SpeculativeEngine.exactness`: the guarantee in one line.

    Args:
        exactness: the resolved ``row_exact=`` (:func:`set_row_exactness`).
        dtype: the model's compute dtype.
        static: whether the engine has a static round (``compile=``).
    """
    mode, reason = exactness.mode, exactness.reason
    if mode == KERNELS:
        return (
            f"row-exact ({reason}): the plain loop and every verify run through the row-invariant kernels, so "
            "the greedy speculative text is selfspec's plain text bit for bit; transformers' generate uses "
            "other kernels, and in half precision its text may differ (measured: docs/kernels.md)"
        )
    if mode == ROWS:
        note = "; calls in the static round (compile=) verify in one block, so their text may differ" if static else ""
        return (
            f"row-exact ({reason}): each verify row gets a one-token decode's bits, so the greedy speculative "
            f"text is the plain text bit for bit{note}"
        )
    if dtype in ROW_EXACT_DTYPES:
        return (
            f"not row-exact ({reason}): the verify runs as one block, whose rows may round differently from "
            "a one-token decode's in half precision, so the speculative text may differ from the plain text"
        )
    return f"float32 ({reason}): greedy text is transformers' generate text (tested on CPUs)"
