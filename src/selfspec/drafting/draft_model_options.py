"""The draft-model drafter's option, declared in its registration (no torch: the CLI and adapters read it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .declaring import DrafterOption


def load_draft_model(value: Any, loading: Mapping[str, Any]) -> Mapping[str, Any]:
    """A name or folder loads like the target (same quantization, dtype and device), with its tokenizer."""
    if not isinstance(value, (str, os.PathLike)):
        return {}
    from ..modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(value, **loading)
    return {"draft_model": model, "draft_tokenizer": tokenizer}


#: ``draft_model=``: the draft model, loaded or by name.
DRAFT_MODEL = DrafterOption(
    "draft_model",
    "with --drafter draft_model: the draft model (name or folder)",
    text_type=Any,
    load=load_draft_model,
)

OPTIONS = (DRAFT_MODEL,)
