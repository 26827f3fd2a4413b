"""Saved calibration: what was measured for a model on some hardware, and the plan chosen.

Stored as ``selfspec.json`` beside a local model folder, under the user cache
(``$SELFSPEC_CACHE`` or ``~/.cache/selfspec/<model id>/selfspec.json``) for a hub model or the
bundled demo models, and beside the dequantized copy in the user cache (never beside the
user's file) for a ``.gguf`` file. Each file records :data:`CALIBRATION_VERSION` and the
hardware it was measured on; a file from an older version or another machine is not used
(the next load measures afresh), and an unreadable one is ignored the same way. The file
shipped beside a bundled model is used on any machine (its version must match).
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

from ..artifacts import BUNDLED_MODELS, cache_dir

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "selfspec.json"
#: Version of the calibration format and measurement; older files are measured again.
CALIBRATION_VERSION = 3


def machine_fingerprint() -> str:
    """This machine, as a calibration sees it: architecture, CPU model and count, GPU names."""
    import torch

    parts = [platform.machine(), _cpu_name(), f"x{os.cpu_count()}"]
    if torch.cuda.is_available():
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return " ".join(parts)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _bundled(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether the path is one of the models bundled inside the package (never written to)."""
    models = BUNDLED_MODELS.resolve()
    try:
        return models in Path(name_or_path).resolve().parents
    except OSError:
        return False


def calibration_path(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """Where the calibration of a model is written (``None`` when the model has no name)."""
    if not name_or_path:
        return None
    path = Path(name_or_path)
    if path.is_dir() and not _bundled(path):
        return path / CALIBRATION_FILE
    if path.suffix.lower() == ".gguf":  # beside its dequantized copy (selfspec.modeling.loading)
        from ..modeling.loading import dequantized_folder

        return dequantized_folder(str(path.parent), path.name) / CALIBRATION_FILE
    if path.is_dir():  # a bundled model: the user cache, by folder name
        return cache_dir() / path.name / CALIBRATION_FILE
    return cache_dir() / str(name_or_path).replace("/", "--") / CALIBRATION_FILE


def _candidates(name_or_path: str | os.PathLike[str]) -> list[Path]:
    """Where a calibration is read from: the written place, then the one shipped beside a bundled model."""
    paths = [p for p in [calibration_path(name_or_path)] if p is not None]
    folder = Path(name_or_path)
    if folder.is_dir() and _bundled(folder):
        paths.append(folder / CALIBRATION_FILE)
    return paths


def load_calibration(
    name_or_path: str | os.PathLike[str] | None, *, check_machine: bool = True
) -> dict[str, Any] | None:
    """Read a saved calibration, or ``None`` when there is none usable.

    Args:
        name_or_path: the model's folder, ``.gguf`` file or hub id.
        check_machine: ignore a file measured on another machine (:func:`machine_fingerprint`).

    Returns:
        The saved settings, or ``None`` (no file, unreadable, an older version, another
        machine: each logged, and the caller measures afresh).
    """
    if not name_or_path:
        return None
    for path in _candidates(name_or_path):
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            logger.warning("ignoring the unreadable calibration %s (%s); it will be measured again", path, error)
            continue
        if not isinstance(data, dict):
            logger.warning("ignoring the calibration %s: not a JSON object", path)
            continue
        if data.get("version") != CALIBRATION_VERSION:
            logger.info(
                "calibration %s is from an older selfspec (version %s, now %s); measuring again",
                path,
                data.get("version"),
                CALIBRATION_VERSION,
            )
            continue
        shipped = _bundled(path)  # shipped with the package: measured when the model was built
        here = machine_fingerprint() if check_machine and not shipped else None
        if here is not None and data.get("machine") != here:
            logger.info(
                "calibration %s was measured on %r, not this machine (%r); measuring again",
                path,
                data.get("machine"),
                here,
            )
            continue
        return data
    return None


def save_calibration(name_or_path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Write a calibration (stamped with :data:`CALIBRATION_VERSION` and this machine) and return its path (logged)."""
    path = calibration_path(name_or_path)
    if path is None:
        raise ValueError("cannot save a calibration for a model without a name or path")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**data, "version": CALIBRATION_VERSION, "machine": data.get("machine") or machine_fingerprint()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    logger.info("saved the calibration of %s to %s", name_or_path, path)
    return path
