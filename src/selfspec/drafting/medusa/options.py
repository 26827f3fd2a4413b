"""The Medusa drafter's option, declared in its registration (no torch: the CLI and adapters read it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..declaring import DrafterOption


def load_pickled_heads(value: Any, loading: Mapping[str, Any]) -> Mapping[str, Any]:
    """With ``allow_pickle=True``, a folder's ``medusa_lm_head.pt`` loads now (the drafter reads safetensors only)."""
    if not (loading.get("allow_pickle") and isinstance(value, (str, os.PathLike))):
        return {}
    from .drafter import load_medusa_heads

    return {"medusa_heads": load_medusa_heads(value, allow_pickle=True)}


#: ``medusa_heads=``: a folder of heads in the published layout, or loaded heads.
MEDUSA_HEADS = DrafterOption(
    "medusa_heads",
    "with --drafter medusa: a folder of Medusa heads (default: the model's)",
    annotation="str | os.PathLike[str] | Any",
    load=load_pickled_heads,
)

OPTIONS = (MEDUSA_HEADS,)
