"""Where selfspec keeps what it writes for the user, and what it ships: one leaf module.

Calibrations, exit adapters, EAGLE heads, dequantized GGUF copies and fetched real checkpoints all
live under :func:`cache_dir`: ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else
``~/.cache/selfspec``. What the package ships (the demo models, their heads, the heads trained for
real models) lives under :data:`BUNDLED_MODELS`, never written to. This module imports nothing
from selfspec, so any module may use it without forming an import cycle.
"""

from __future__ import annotations

import hashlib
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


def model_key(name_or_path: str | os.PathLike[str]) -> str:
    """A file-system-safe name for a model.

    A hub id with ``--`` for ``/``; a bundled model's name; a local folder or file as its name plus a
    short hash of its absolute path (two folders named ``model`` differ).
    """
    text = os.fspath(name_or_path)
    path = Path(text)
    try:
        local = path.exists()
    except OSError:
        local = False
    if not local:
        return text.replace("/", "--")
    resolved = path.resolve()
    if BUNDLED_MODELS.resolve() in resolved.parents:
        return resolved.name
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:10]
    return f"{resolved.name}-{digest}"


def model_cache(name_or_path: str | os.PathLike[str], kind: str) -> Path:
    """Where selfspec writes artifacts of one kind for a model: ``cache_dir() / kind / model_key(model)``."""
    return cache_dir() / kind / model_key(name_or_path)
