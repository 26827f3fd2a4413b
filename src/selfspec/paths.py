"""Where selfspec keeps what it writes for the user: one leaf module, imported by everything else.

Calibrations, exit adapters, EAGLE heads, dequantized GGUF copies and fetched real checkpoints all
live under :func:`cache_dir`. This module imports nothing from selfspec, so any module may use it
without forming an import cycle.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder: ``$SELFSPEC_CACHE``, else ``~/.cache/selfspec``."""
    root = os.environ.get("SELFSPEC_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "selfspec"
