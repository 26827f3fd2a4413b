"""What ``train-eagle`` keeps between runs, as safetensors plus JSON: no pickle is ever loaded.

A run with a state folder keeps two things there, each as a ``.safetensors`` file of tensors
and a ``.json`` file of everything else (written first to a temporary name, then renamed):

- ``data``: the written answers (per sample: token ids, features, log-normalisers, greedy
  tokens, and an EAGLE-3 head's taps; its answer start and kind in the JSON) and the writing figures;
- ``checkpoint``: the head's weights, the optimizer's tensors (per parameter ``step``,
  ``exp_avg``, ``exp_avg_sq``), its parameter groups, the step, the seconds trained and the
  held-out history.

A file that is missing, unreadable or inconsistent is ignored with a warning: the run writes
its data again or starts training from step 0. The previous format (``data.pt`` and
``checkpoint.pt``, read with ``torch.load(weights_only=False)``, which runs pickle) is never read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ...artifacts import atomic_path, atomic_write_text, make_folder

logger = logging.getLogger(__name__)

DATA = "data"
CHECKPOINT = "checkpoint"
_SAMPLE_TENSORS = ("ids", "features", "log_norm", "argmax")


def _write(folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    make_folder(folder)
    with atomic_path(folder / f"{name}.safetensors") as partial:
        save_file({key: value.detach().cpu().contiguous().clone() for key, value in tensors.items()}, partial)
    atomic_write_text(folder / f"{name}.json", json.dumps(meta))


def _read(folder: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights, info = folder / f"{name}.safetensors", folder / f"{name}.json"
    if not weights.is_file() or not info.is_file():
        return None
    try:
        meta = json.loads(info.read_text(encoding="utf-8"))
        tensors = load_file(weights)
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        logger.warning("ignoring the unreadable training state %s (%s)", weights, error)
        return None
    if not isinstance(meta, dict):
        logger.warning("ignoring the training state %s: its JSON is not an object", info)
        return None
    return tensors, meta


def save_data(folder: Path, samples: list[Any], figures: dict[str, Any]) -> None:
    """Keep the written answers (:class:`~selfspec.drafting.eagle.train.Sample` objects) and the figures."""
    tensors = {f"{i}.{part}": getattr(sample, part) for i, sample in enumerate(samples) for part in _SAMPLE_TENSORS}
    tensors.update({f"{i}.taps": s.taps for i, s in enumerate(samples) if s.taps is not None})
    meta = {"samples": [{"answer_start": s.answer_start, "kind": s.kind} for s in samples], "figures": figures}
    _write(folder, DATA, tensors, meta)


def load_data(folder: Path, sample_type: type) -> tuple[list[Any], dict[str, Any]] | None:
    """The kept answers and figures, or ``None`` (none kept, or unreadable: logged)."""
    read = _read(folder, DATA)
    if read is None:
        return None
    tensors, meta = read
    try:
        samples = [
            sample_type(
                **{part: tensors[f"{i}.{part}"] for part in _SAMPLE_TENSORS},
                **({"taps": tensors[f"{i}.taps"]} if f"{i}.taps" in tensors else {}),
                answer_start=int(info["answer_start"]),
                kind=str(info.get("kind", "")),
            )
            for i, info in enumerate(meta["samples"])
        ]
        figures = dict(meta["figures"])
    except (KeyError, TypeError, ValueError) as error:
        logger.warning("ignoring the inconsistent training data in %s (%s); writing it again", folder, error)
        return None
    return samples, figures


def save_checkpoint(
    folder: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, seconds: float, history: list
) -> None:
    """Keep the head, the optimizer's state and the progress."""
    state = optimizer.state_dict()
    tensors = {f"head.{key}": value for key, value in head.state_dict().items()}
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {
        "step": step,
        "seconds": seconds,
        "history": history,
        "param_groups": state["param_groups"],
        "optimizer_scalars": scalars,
    }
    _write(folder, CHECKPOINT, tensors, meta)


def load_checkpoint(
    folder: Path, head: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, float, list] | None:
    """Restore the head and optimizer in place; ``(step, seconds, history)``, or ``None`` (start afresh)."""
    read = _read(folder, CHECKPOINT)
    if read is None:
        return None
    tensors, meta = read
    try:
        head_state = {key[len("head.") :]: value for key, value in tensors.items() if key.startswith("head.")}
        per_param: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                per_param.setdefault(int(index), {})[name] = value
        for index, values in dict(meta.get("optimizer_scalars") or {}).items():
            per_param.setdefault(int(index), {}).update(values)
        groups = [{**group, "betas": tuple(group["betas"])} if "betas" in group else group
                  for group in meta["param_groups"]]  # fmt: skip
        if set(head_state) != set(head.state_dict()):
            raise KeyError("the head's weights do not match this head")
        head.load_state_dict(head_state)
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
        return int(meta["step"]), float(meta["seconds"]), list(meta["history"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        logger.warning("ignoring the inconsistent checkpoint in %s (%s); training from step 0", folder, error)
        return None
