"""Where selfspec keeps what it writes for the user, and what it ships: one leaf module, one rule.

**Written.** Everything selfspec writes lives under :func:`cache_dir` (``$SELFSPEC_CACHE``, else
``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``), a model's artifacts of one kind in
:func:`model_cache` ``= cache_dir() / kind / model_key(model)``: calibrations, exit adapters,
EAGLE heads and their training state, Medusa heads, dequantized GGUF copies (one folder per
version of the file inside). Fetched real checkpoints live in ``cache_dir() / "models"``.
Nothing is written inside a model's folder or inside the package.

**Read.** :func:`find_artifact` looks where selfspec writes first, then, read only, in the
places published and shipped artifacts sit: sub-folders of a local model folder (``beside``:
``<model>/eagle_head``, ``<model>/exit_adapter``, ``<model>/medusa``, the folder itself for a
published Medusa repository), and the places earlier selfspec versions wrote to (so an existing
user cache keeps working). What the package ships (the demo models, their heads, the heads
trained for real models) lives under :data:`BUNDLED_MODELS`, never written to.

This module imports nothing from selfspec, so any module may use it without forming an import cycle.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

#: What the package ships: the demo models (``selfspec-demo``, ``selfspec-demo-draft``) and heads.
BUNDLED_MODELS = Path(__file__).parent / "models"

# The kinds of artifact: each a folder of the user cache, with one folder per model inside.
#: Measured calibrations (``<device>-<dtype>.json``).
CALIBRATIONS = "calibrations"
#: Exit adapters written by ``selfspec train-adapter``.
EXIT_ADAPTERS = "exit_adapters"
#: EAGLE heads written by ``selfspec train-eagle``.
EAGLE_HEADS = "eagle_heads"
#: ``train-eagle``'s resumable state (the written data and a checkpoint), one folder per head format.
EAGLE_TRAINING = "eagle_training"
#: Medusa heads written by ``selfspec train-medusa``.
MEDUSA_HEADS = "medusa_heads"
#: Dequantized copies of GGUF checkpoints (safetensors, config and tokenizer), one folder per file version.
DEQUANTIZED = "gguf"
#: Fetched real checkpoints (``models/<short name>/<file>``; keyed by short name, not by model).
MODELS = "models"


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


def loose_name(name: str | os.PathLike[str]) -> str:
    """A model name reduced for matching: the last path part, lower case, without ``.gguf`` and quant tags.

    ``"/models/SmolLM2-135M-Instruct.Q4_1.gguf"`` and ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` both give
    ``"smollm2-135m-instruct"``: how shipped EAGLE heads are matched to a model.
    """
    stem = Path(os.fspath(name).rstrip("/")).name.lower()
    stem = re.sub(r"\.gguf$", "", stem)
    return re.sub(r"[.-](q\d\w*|f16|f32|bf16)(-[0-9a-f]{12})?$", "", stem)


def model_cache(name_or_path: str | os.PathLike[str], kind: str) -> Path:
    """Where selfspec writes artifacts of one kind for a model: ``cache_dir() / kind / model_key(model)``."""
    return cache_dir() / kind / model_key(name_or_path)


def local_folder(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The model's own folder when it is given as a local folder (``None`` for a hub id or a file)."""
    if not name_or_path:
        return None
    path = Path(os.fspath(name_or_path)).expanduser()
    try:
        return path if path.is_dir() else None
    except OSError:
        return None


def artifact_places(name_or_path: str | os.PathLike[str], kind: str, *, beside: Sequence[str] = ()) -> list[Path]:
    """Where a model's artifact of one kind is looked for, in order.

    1. :func:`model_cache` (where selfspec writes it);
    2. read only: each of ``beside`` inside a local model folder (``""``: the folder itself), where
       published or shipped artifacts sit;
    3. read only: where earlier selfspec versions wrote it in the user cache.
    """
    places = [model_cache(name_or_path, kind)]
    folder = local_folder(name_or_path)
    if folder is not None:
        places += [folder / sub if sub else folder for sub in beside]
    places += _former_places(name_or_path, kind)
    return places


def find_artifact(
    name_or_path: str | os.PathLike[str] | None,
    kind: str,
    holds: Callable[[Path], bool],
    *,
    beside: Sequence[str] = (),
) -> Path | None:
    """The first of :func:`artifact_places` that ``holds`` the artifact, or ``None`` (also for no model name)."""
    if not name_or_path:
        return None
    for place in artifact_places(name_or_path, kind, beside=beside):
        if holds(place):
            return place
    return None


def dequantized_places(folder: str, gguf_file: str) -> list[Path]:
    """Where the dequantized copy of a GGUF checkpoint is written (first), then where it was written before.

    ``model_cache(file, DEQUANTIZED) / <version>``: the version a hash of the file's size and
    modification time (``hub`` for a file in a hub repository), so an edited file gets a new copy.
    """
    local = Path(folder) / gguf_file
    if local.is_file():
        resolved = local.resolve()
        info = resolved.stat()
        version = hashlib.sha256(f"{info.st_size}|{info.st_mtime_ns}".encode()).hexdigest()[:12]
        former_ident = f"{resolved}|{info.st_size}|{info.st_mtime_ns}"
        current = model_cache(resolved, DEQUANTIZED) / version
    else:
        former_ident = f"hub:{folder}/{gguf_file}"
        current = model_cache(f"{folder}/{gguf_file}", DEQUANTIZED) / "hub"
    former = hashlib.sha256(former_ident.encode()).hexdigest()[:12]
    return [current, cache_dir() / DEQUANTIZED / f"{Path(gguf_file).stem}-{former}"]


def _former_places(name_or_path: str | os.PathLike[str], kind: str) -> list[Path]:
    """Where selfspec up to 0.x (before one rule) wrote a model's artifact in the user cache: read only."""
    if local_folder(name_or_path) is not None:
        return []  # those were written beside the model: artifact_places' ``beside`` looks there
    name = os.fspath(name_or_path)
    if kind == EXIT_ADAPTERS:
        return [cache_dir() / name.replace("/", "--") / "exit_adapter"]
    if kind == EAGLE_HEADS:
        return [cache_dir() / "eagle" / loose_name(name) / "eagle_head"]
    return []
