"""Marking a model so that selfspec's forwards of it run through the row-invariant kernels."""

from __future__ import annotations

from typing import Any

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
