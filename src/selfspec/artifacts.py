"""Where selfspec keeps what it writes for the user, and what it ships: one leaf module.

Calibrations, exit adapters, EAGLE heads, dequantized GGUF copies and fetched real checkpoints all
live under :func:`cache_dir`: ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else
``~/.cache/selfspec``. What the package ships (the demo models, their heads, the heads trained for
real models) lives under :data:`BUNDLED_MODELS`, never written to. This module imports nothing
from selfspec, so any module may use it without forming an import cycle.
"""

from __future__ import annotations

import os
from pathlib import Path

#: What the package ships: the demo models (``selfspec-demo``, ``selfspec-demo-draft``) and heads.
BUNDLED_MODELS = Path(__file__).parent / "models"


def cache_dir() -> Path:
    """The user cache folder: ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``."""
    root = os.environ.get("SELFSPEC_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "selfspec"
    return Path.home() / ".cache" / "selfspec"
