"""The files of a published head folder: ``config.json`` and safetensors weights, read header first.

Shared by the published-head readers (:mod:`selfspec.drafting.eagle.published`, :mod:`selfspec.drafting.eagle.eagle3`,
:mod:`selfspec.drafting.eagle.speculators`): names and shapes come from the safetensors headers, so a head
is checked before any weight is read; pickle-only folders are refused with a one-line conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...errors import ConfigurationError, ModelNotFoundError, UnsafeCheckpointError

#: The files of a published head folder.
PUBLISHED_CONFIG = "config.json"
PUBLISHED_WEIGHTS = "model.safetensors"
PUBLISHED_INDEX = "model.safetensors.index.json"
PUBLISHED_PICKLE = "pytorch_model.bin"
_CONVERT = (
    "import torch, safetensors.torch as st; "
    "state = torch.load('pytorch_model.bin', map_location='cpu', weights_only=True); "
    "st.save_file({k: v.contiguous() for k, v in state.items()}, 'model.safetensors')"
)


def _read_config(path: Path) -> dict[str, Any]:
    """The head's ``config.json`` (malformed JSON or no object: a clear error, as for model folders)."""
    from ...modeling.loading import _read_local_config

    raw = _read_local_config(str(path))
    if raw is None:
        raise ConfigurationError(f"{path / PUBLISHED_CONFIG} is missing: a published EAGLE head folder needs it")
    return raw


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a published head; clear errors for pickle-only or empty folders."""
    if (path / PUBLISHED_WEIGHTS).is_file():
        return [path / PUBLISHED_WEIGHTS]
    if (path / PUBLISHED_INDEX).is_file():
        try:
            weight_map = json.loads((path / PUBLISHED_INDEX).read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigurationError(f"{path / PUBLISHED_INDEX} is not a readable safetensors index ({exc})") from exc
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelNotFoundError(f"{path / PUBLISHED_INDEX} names missing files: {', '.join(missing)}")
        return files
    pickles = sorted(p.name for p in path.glob("*.bin"))
    if pickles:
        raise UnsafeCheckpointError(
            f"the EAGLE head in {path} holds only pickle weights ({', '.join(pickles)}); selfspec loads "
            f"safetensors only (pickle can run arbitrary code when loaded). Convert it once, in that folder: "
            f'python -c "{_CONVERT}"'
        )
    raise ModelNotFoundError(
        f"{path} has a {PUBLISHED_CONFIG} but no head weights ({PUBLISHED_WEIGHTS}); a published EAGLE head "
        f"folder holds config.json and model.safetensors, a selfspec head eagle_config.json and "
        "eagle_head.safetensors (`selfspec train-eagle`)"
    )


def _weight_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, read from the safetensors headers (no weights loaded yet)."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in reader.keys():
                    shapes[name] = tuple(reader.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigurationError(f"{file} is not a readable safetensors file ({exc})") from exc
    return shapes


def _read_weights(files: list[Path], wanted: set[str]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as reader:
                for name in wanted & set(reader.keys()):
                    state[name] = reader.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigurationError(f"{file} is not a readable safetensors file ({exc})") from exc
    return state
