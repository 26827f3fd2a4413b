"""Export an EAGLE head for vLLM / SGLang: ``export_eagle`` (and ``selfspec export-eagle``).

Writes vLLM's ``speculators`` layout (:func:`~selfspec.drafting.eagle.speculators.save_speculators_eagle3`)
for any EAGLE-3 head selfspec reads; refuses, with the reason, heads that layout cannot express.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigurationError
from .eagle3 import Eagle3Head
from .head import EagleHead
from .speculators import save_speculators_eagle3

#: Why a selfspec-format or EAGLE-1 head cannot be written to the layout vLLM runs (the message of the refusal).
_NOT_EXPRESSIBLE = (
    "has no exact form in the speculators eagle3 layout that vLLM and SGLang run: selfspec's own heads "
    "(`selfspec train-eagle`) are EAGLE-1-style (fc over [embedding, the last layer's normed feature], a full decoder "
    "layer with its input norm, then the target's final norm and LM head, fed back after that norm), while an EAGLE-3 "
    "head normalises the embedding and the fused feature separately before a 2H-wide attention, feeds back its "
    "pre-norm output and scores with its own norm; and vLLM no longer reads speculators 'eagle' (EAGLE-1) folders. "
    "A converted head would draft other tokens. Only EAGLE-3 heads export (e.g. a SafeAILab/SpecForge EAGLE-3 "
    "folder, which this converts to the speculators layout)"
)


def load_any_head(head: Any, model: Any) -> EagleHead:
    """A head for ``model`` from a folder of any layout selfspec reads, or a loaded head (checked)."""
    from .head import check_fits, load_eagle_head
    from .published import is_published_head, load_published_head  # the dispatcher over every layout

    if isinstance(head, EagleHead):
        check_fits(head.head_config, model)
        return head
    if not isinstance(head, (str, os.PathLike)):
        raise ConfigurationError(f"head must be a folder or a loaded EagleHead, got {head!r}")
    if is_published_head(head):
        return load_published_head(head, model)
    return load_eagle_head(head, model)


def export_eagle(
    model: Any,
    head: Any,
    out: str | os.PathLike[str],
    *,
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write an EAGLE head for ``model`` as a folder in vLLM's ``speculators`` layout.

    The folder runs with ``vllm serve <out>`` (vLLM reads the target from
    ``speculators_config.verifier.name_or_path``) and with SGLang's EAGLE-3 loader
    (``--speculative-draft-model-path <out>``); selfspec reads it back with ``eagle_head=<out>``.

    Args:
        model: the target (a loaded transformers causal LM).
        head: a head folder (SafeAILab or speculators EAGLE-3 layout) or a loaded
            :class:`~selfspec.drafting.eagle.eagle3.Eagle3Head`.
        out: the folder to write.
        verifier: the target's hub id or path, as vLLM should load it (default: the name the
            head names, else the model's ``name_or_path``).
        speculative_tokens: the draft length vLLM uses (default: the head's, else 3).
        dtype: the weights' dtype.

    Returns:
        The folder.

    Raises:
        ConfigurationError: the head is not an EAGLE-3 head (selfspec's own heads and EAGLE-1
            heads have no exact form in the layout vLLM runs), or does not fit the model, or no
            verifier name is known.
        ModelNotFoundError: no such head folder.
    """
    loaded = load_any_head(head, model)
    if not isinstance(loaded, Eagle3Head):
        raise ConfigurationError(f"the EAGLE head {loaded!r} {_NOT_EXPRESSIBLE}.")
    name = verifier or loaded.spec.verifier or str(getattr(model.config, "_name_or_path", "") or "")
    if not name:
        raise ConfigurationError("export_eagle needs the verifier's hub id or path (verifier=, --verifier)")
    architectures = [str(a) for a in (getattr(model.config, "architectures", None) or [type(model).__name__])]
    return save_speculators_eagle3(
        loaded, out, verifier=name, verifier_architectures=architectures, speculative_tokens=speculative_tokens,
        dtype=dtype,
    )  # fmt: skip
