"""Marking a model so that selfspec's forwards of it run through the row-invariant kernels."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigurationError
from .launch import KERNELS_EXTRA

#: the attribute :func:`use_row_invariant_kernels` sets on the model (read by ``ModelRunner``)
ROW_KERNELS_ATTRIBUTE = "selfspec_row_invariant_kernels"


def use_row_invariant_kernels(model: Any, enabled: bool = True) -> Any:
    """Route selfspec's forwards of ``model`` through :func:`.linear` and :func:`.chain_attention`.

    Every :class:`~selfspec.modeling.ModelRunner` built on the model afterwards (an engine's) runs
    each decoder layer's linear layers, the LM head and the attention of decodes, chain verifies and
    the prefill through the kernels, so a verify row gets the bits its one-token decode gets and
    greedy speculation gives the text of the plain loop with the same kernels. transformers' own
    forward (``generate``) is untouched. Call it before building the engine.

    The runner refuses (``ConfigurationError``) what the kernels do not cover yet: models off the
    lean path (Llama-family with SDPA and plain ``nn.Linear`` layers), sliding-window layers, token
    trees and batched generation. Not yet wired into the compiled GPU static round.

    Args:
        model: a transformers ``*ForCausalLM``.
        enabled: ``False`` removes the mark.

    Returns:
        ``model``, marked.
    """
    setattr(model, ROW_KERNELS_ATTRIBUTE, bool(enabled))
    return model


def uses_row_invariant_kernels(model: Any) -> bool:
    """Whether :func:`use_row_invariant_kernels` marked ``model``."""
    return bool(getattr(model, ROW_KERNELS_ATTRIBUTE, False))


#: :attr:`RowExactness.mode` values.
KERNELS = "kernels"  # the plain loop and the verify through the row-invariant Triton kernels
ROWS = "rows"  # the verify computes the rows that are not row-invariant one at a time (a decode's call each)
BATCHED = "batched"  # library kernels on the whole verify block


@dataclass(frozen=True)
class RowExactness:
    """How an engine computes a verify's rows, decided once from ``row_exact=`` (:func:`resolve_row_exact`).

    Attributes:
        mode: :data:`KERNELS`, :data:`ROWS` or :data:`BATCHED`.
        reason: one line on why this mode.
    """

    mode: str
    reason: str

    @property
    def kernels(self) -> bool:
        """Whether every forward runs through the row-invariant kernels."""
        return self.mode == KERNELS


def kernels_refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the compiled row-invariant kernels cannot run on ``device`` here, or ``None`` when they can.

    On a CPU they run only in Triton's interpreter (``TRITON_INTERPRET=1`` before their first use:
    slow, for tests), which only :func:`use_row_invariant_kernels` asks for.
    """
    if device.type != "cuda":
        return f"the row-invariant Triton kernels run on CUDA, not {device.type}"
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed ({KERNELS_EXTRA})"
    return None


def resolve_row_exact(
    row_exact: bool | str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    unsupported: str | None = None,
    marked: bool = False,
) -> RowExactness:
    """What ``row_exact=`` means for a model on ``device`` in ``dtype``.

    - On CUDA: ``True``, and ``"auto"`` in half precision, run the plain loop and the verify
      through the row-invariant kernels (``"auto"`` falls back to the row-by-row verify where they
      cannot run; ``True`` refuses).
    - Elsewhere (a CPU): ``True``, and ``"auto"`` in half precision, compute the verify's rows that
      are not row-invariant one at a time (the eager loop's row-exact verify).
    - ``False``, and ``"auto"`` in float32: the verify runs as one block (in half precision its
      rows may round differently from a decode's, and the text may differ).
    - A model marked by :func:`use_row_invariant_kernels` runs through the kernels whatever the
      device (on a CPU: under ``TRITON_INTERPRET=1``), unless ``row_exact=False`` (refused).

    Args:
        row_exact: ``True``, ``False`` or ``"auto"``.
        device: the model's device.
        dtype: the model's dtype.
        unsupported: why the model's runner cannot run the kernels (``None``: it can).
        marked: the model was marked by :func:`use_row_invariant_kernels`.

    Raises:
        ConfigurationError: ``row_exact=True`` on CUDA where the kernels cannot run, or
            ``row_exact=False`` on a marked model.
    """
    half = dtype in (torch.bfloat16, torch.float16)  # half precision (no import of ..attention: it loads this)
    if marked:
        if row_exact is False:
            raise ConfigurationError(
                "row_exact=False, but the model is marked by use_row_invariant_kernels(); unmark it "
                "(use_row_invariant_kernels(model, False)) or leave row_exact on"
            )
        if unsupported is not None:
            raise ConfigurationError(f"the row-invariant kernels need {unsupported}")
        return RowExactness(KERNELS, "the model is marked by use_row_invariant_kernels()")
    if row_exact is False:
        return RowExactness(BATCHED, "row_exact=False")
    if row_exact == "auto" and not half:
        return RowExactness(BATCHED, f"{str(dtype).removeprefix('torch.')}: row-exact rounding is not needed")
    if device.type != "cuda":
        return RowExactness(ROWS, f"{device.type}: the verify computes its rows one at a time")
    refusal = kernels_refusal(device, dtype) or (None if unsupported is None else f"the kernels need {unsupported}")
    if refusal is None:
        return RowExactness(KERNELS, "cuda: every linear and the attention through the row-invariant kernels")
    if row_exact is True:
        raise ConfigurationError(f"row_exact=True: {refusal}; use row_exact='auto' or False")
    return RowExactness(ROWS, f"{refusal}: the eager verify computes its rows one at a time")
