"""Saved calibration: the exit layer and draft length chosen for a model on some hardware.

Stored as ``selfspec.json`` beside a local model folder, under the user cache
(``$SELFSPEC_CACHE`` or ``~/.cache/selfspec/<model id>/selfspec.json``) for a hub model, and
beside the dequantized copy in the user cache (never beside the user's file) for a ``.gguf`` file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CALIBRATION_FILE = "selfspec.json"


def cache_dir() -> Path:
    """The user cache folder for calibrations of hub models."""
    root = os.environ.get("SELFSPEC_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "selfspec"


def calibration_path(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """Where the calibration of a model lives (``None`` when the model has no name)."""
    if not name_or_path:
        return None
    path = Path(name_or_path)
    if path.is_dir():
        return path / CALIBRATION_FILE
    if path.suffix.lower() == ".gguf":  # beside its dequantized copy (selfspec.loading)
        from .loading import dequantized_folder

        return dequantized_folder(str(path.parent), path.name) / CALIBRATION_FILE
    return cache_dir() / str(name_or_path).replace("/", "--") / CALIBRATION_FILE


def load_calibration(name_or_path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """Read a saved calibration, or ``None`` when there is none (or it is unreadable)."""
    path = calibration_path(name_or_path)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_calibration(name_or_path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write a calibration beside the model (or in the user cache) and return its path."""
    path = calibration_path(name_or_path)
    if path is None:
        raise ValueError("cannot save a calibration for a model without a name or path")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
