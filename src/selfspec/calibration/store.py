"""Saved calibration: what was measured for a model on some hardware, and the plan chosen.

A calibration is keyed by the model, the device type and the dtype, and stored in the user cache
(:func:`selfspec.artifacts.cache_dir`: ``$SELFSPEC_CACHE``, then ``$XDG_CACHE_HOME/selfspec``, then
``~/.cache/selfspec``) as ``calibrations/<model>/<device>-<dtype>.json``, never inside the user's
model folder. Each file records :data:`CALIBRATION_VERSION`, the selfspec version and the machine it
was measured on; a file from another version, another machine, device type or dtype is not used
(the next load measures afresh), and an unreadable one is ignored the same way. The file shipped
beside a bundled model is used on any machine of the device type and dtype it was measured in.

A calibration is saved atomically (:func:`selfspec.artifacts.atomic_write_text`: a reader sees the
old file or the new one, whole). One that cannot be saved (a read-only cache, a full disk) is kept
in memory for the process (:func:`save_or_keep_calibration`: the next load in the process uses it,
and one warning says where it could not be saved and why). :func:`calibration_lock` lets one
process at a time measure a model: another one waits for it and then uses what it saved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..artifacts import BUNDLED_MODELS, ArtifactLock, artifact_lock, atomic_write_text, model_cache

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


def _kind(device: Any) -> str:
    """``"cuda:1"`` / ``torch.device("cuda", 1)`` -> ``"cuda"``."""
    return str(getattr(device, "type", None) or str(device).split(":")[0])


def _dtype(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def calibration_path(
    name_or_path: str | os.PathLike[str] | None, device: Any = "cpu", dtype: Any = "float32"
) -> Path | None:
    """Where the calibration of a model on this device type and dtype is written (``None``: no name)."""
    if not name_or_path:
        return None
    return model_cache(name_or_path, "calibrations") / f"{_kind(device)}-{_dtype(dtype)}.json"


def _candidates(name_or_path: str | os.PathLike[str], device: Any, dtype: Any) -> list[Path]:
    """Where a calibration is read from: the user cache, then the file shipped beside a bundled model."""
    paths = [p for p in [calibration_path(name_or_path, device, dtype)] if p is not None]
    folder = Path(name_or_path)
    if folder.is_dir() and _bundled(folder):
        paths.append(folder / CALIBRATION_FILE)
    return paths


def load_calibration(
    name_or_path: str | os.PathLike[str] | None,
    *,
    device: Any = "cpu",
    dtype: Any = "float32",
    check_machine: bool = True,
) -> dict[str, Any] | None:
    """Read a saved calibration, or ``None`` when there is none usable.

    Args:
        name_or_path: the model's folder, ``.gguf`` file or hub id.
        device: the device the model runs on (its type is part of the key).
        dtype: the dtype the model runs in (part of the key).
        check_machine: ignore a file measured on another machine (:func:`machine_fingerprint`).

    Returns:
        The saved settings, or ``None`` (no file, unreadable, corrupt (:func:`calibration_problem`), an
        older version, another machine, device type or dtype, or costs measured on a busy machine
        (:data:`BUSY_LOAD`) that is quiet now (:data:`QUIET_LOAD`): each logged, and the caller
        measures afresh).
    """
    if not name_or_path:
        return None
    kept = _KEPT.get(calibration_path(name_or_path, device, dtype) or Path())
    if kept is not None:  # measured by this process, which could not save it
        return dict(kept)
    for path in _candidates(name_or_path, device, dtype):
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
        measured_in = (_kind(data.get("device", "cpu")), _dtype(data.get("dtype", "float32")))
        if measured_in != (_kind(device), _dtype(dtype)):
            logger.info("calibration %s was measured on %s %s, not %s %s; measuring again", path, *measured_in,
                        _kind(device), _dtype(dtype))  # fmt: skip
            continue
        problem = calibration_problem(data)
        if problem is not None:
            logger.warning("ignoring the corrupt calibration %s (%s); it will be measured again", path, problem)
            continue
        shipped = _bundled(path)  # shipped with the package: measured when the model was built
        if not shipped and data.get("selfspec_version") != _selfspec_version():
            logger.info("calibration %s is from selfspec %s (now %s); measuring again", path,
                        data.get("selfspec_version"), _selfspec_version())  # fmt: skip
            continue
        busy = _measured_busy(data)
        if check_machine and not shipped and busy is not None and load_per_core() < QUIET_LOAD:
            logger.info("calibration %s was measured on a busy machine (load %.1f per core); the machine is quiet "
                        "now, measuring again", path, busy)  # fmt: skip
            continue
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


#: A calibration whose costs were measured at this load average per core or more (other work on
#: every core) is measured again on a later load that finds the machine below :data:`QUIET_LOAD`.
BUSY_LOAD = 1.0
#: See :data:`BUSY_LOAD`.
QUIET_LOAD = 0.5


def load_per_core() -> float:
    """The machine's one-minute load average per core (0.0 where the platform has none)."""
    try:
        return round(os.getloadavg()[0] / (os.cpu_count() or 1), 2)
    except (AttributeError, OSError):
        return 0.0


def _measured_busy(data: dict[str, Any]) -> float | None:
    """The load per core the costs were measured at, when it was :data:`BUSY_LOAD` or more, else ``None``."""
    checks = data.get("cost_checks")
    loads = checks.get("load_per_core") if isinstance(checks, dict) else None
    if not isinstance(loads, list) or not all(isinstance(x, int | float) for x in loads) or not loads:
        return None
    busiest = float(max(loads))
    return busiest if busiest >= BUSY_LOAD else None


def _selfspec_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("selfspec")
    except PackageNotFoundError:  # a source tree
        return "0.0.0"


def save_calibration(
    name_or_path: str | os.PathLike[str], data: dict[str, Any], *, path: str | os.PathLike[str] | None = None
) -> Path:
    """Write a calibration atomically and return its path (logged).

    The file is stamped with :data:`CALIBRATION_VERSION`, the selfspec version and this machine, and
    goes to :func:`calibration_path` for the device and dtype recorded in ``data`` unless ``path``
    names another file (the only way a calibration lands inside a model folder). It is written
    beside the target and renamed over it, so a reader sees the old file or the new one, whole.

    Raises:
        ArtifactWriteError: the file cannot be written (read-only cache, full disk); it names the
            file, and the previous calibration there is unchanged.
        UnsafeCachePathError: a symbolic link inside the cache leads out of it.
    """
    target = _target(name_or_path, data, path)
    stamped = _stamped(data)
    atomic_write_text(target, json.dumps(stamped, indent=2, sort_keys=True) + "\n")
    _KEPT.pop(target, None)
    logger.info("saved the calibration of %s to %s", name_or_path, target)
    return target


#: Calibrations this process measured but could not save, by :func:`calibration_path`.
_KEPT: dict[Path, dict[str, Any]] = {}
#: The files this process could not save a calibration to, with the reason (warned once each).
_UNSAVED: dict[Path, str] = {}


def save_or_keep_calibration(
    name_or_path: str | os.PathLike[str], data: dict[str, Any], *, path: str | os.PathLike[str] | None = None
) -> Path | None:
    """:func:`save_calibration`, or, when the cache cannot be written, keep the calibration in memory.

    A kept calibration is what :func:`load_calibration` returns for the model in this process
    (so the measurement is not repeated by the next load); one warning per file says where it
    could not be saved and why. The next process measures again.

    Returns:
        The file written, or ``None`` when it was kept in memory (:func:`unsaved_reason` says why).
    """
    target = _target(name_or_path, data, path)
    try:
        return save_calibration(name_or_path, data, path=target)
    except OSError as error:
        _KEPT[target] = _stamped(data)
        reason = str(error)
        if target not in _UNSAVED:
            logger.warning(
                "%s; the calibration of %s is kept in memory for this process only (the next one measures "
                "again). Point SELFSPEC_CACHE at a writable folder with free space to keep it.",
                reason, name_or_path,
            )  # fmt: skip
        _UNSAVED[target] = reason
        return None


def unsaved_reason(path: str | os.PathLike[str] | None) -> str | None:
    """Why this process could not save a calibration to ``path`` (``None``: it did not fail)."""
    return None if path is None else _UNSAVED.get(Path(path))


def _target(name_or_path: str | os.PathLike[str], data: dict[str, Any], path: str | os.PathLike[str] | None) -> Path:
    """The file a calibration is saved to: ``path``, else :func:`calibration_path` for its device and dtype."""
    device, dtype = data.get("device", "cpu"), data.get("dtype", "float32")
    target = Path(path) if path is not None else calibration_path(name_or_path, device, dtype)
    if target is None:
        raise ValueError("cannot save a calibration for a model without a name or path")
    return target


def _stamped(data: dict[str, Any]) -> dict[str, Any]:
    """The calibration as saved: its device type and dtype, the format and selfspec versions, the machine."""
    return {
        **data,
        "device": _kind(data.get("device", "cpu")),
        "dtype": _dtype(data.get("dtype", "float32")),
        "version": CALIBRATION_VERSION,
        "selfspec_version": _selfspec_version(),
        "machine": data.get("machine") or machine_fingerprint(),
    }


#: How long a first load waits for another process measuring the same model (twice the default
#: time budget), before it measures too.
CALIBRATION_WAIT = 600.0


@contextlib.contextmanager
def calibration_lock(
    name_or_path: str | os.PathLike[str] | None,
    device: Any = "cpu",
    dtype: Any = "float32",
    *,
    wait: float | None = None,
) -> Iterator[ArtifactLock]:
    """Measure a model's calibration in one process at a time (a lock file beside it in the cache).

    A process that finds another one measuring says so once (``already being measured by pid N,
    waiting``) and waits up to ``wait`` seconds (default :data:`CALIBRATION_WAIT`); then the block
    runs, and ``waited`` tells it to look for the calibration the other process saved. Without a
    name, on a platform without ``fcntl`` or in a cache that cannot be written, nothing is locked.
    """
    where = calibration_path(name_or_path, device, dtype)
    if where is None:
        yield ArtifactLock(held=False)
        return
    limit = CALIBRATION_WAIT if wait is None else wait

    def say_waiting(pid: int | None) -> None:
        logger.warning(
            "the calibration of %s on %s %s is already being measured by %s, waiting (up to %.0f s) to use its plan",
            name_or_path, _kind(device), _dtype(dtype), f"pid {pid}" if pid else "another process", limit,
        )  # fmt: skip

    with artifact_lock(where.with_name(where.name + ".lock"), wait=limit, on_wait=say_waiting) as lock:
        if lock.timed_out:
            holder = f"pid {lock.holder_pid}" if lock.holder_pid else "another process"
            logger.warning("%s still measures %s after %.0f s; measuring here too", holder, name_or_path, limit)
        yield lock


# ------------------------------------------------------------------------------- validation
def _is_int(value: Any, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)


def _is_number(value: Any, low: float, *, positive: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value > low if positive else value >= low


def _curve_problem(name: str, curve: Any, *, positive: bool) -> str | None:
    """A ``{"k": cost}`` curve: keys are draft lengths, values finite costs (``> 0`` with ``positive``)."""
    from ..core.validation import MAX_DRAFT_TOKENS

    if not isinstance(curve, dict):
        return f"{name} is not an object"
    for key, value in curve.items():
        if not (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= MAX_DRAFT_TOKENS):
            return f"{name} has the draft length {key!r}"
        if not _is_number(value, 0.0, positive=positive):
            return f"{name}[{key!r}] is {value!r}, not a finite {'positive ' if positive else ''}cost"
    return None


def calibration_problem(data: dict[str, Any]) -> str | None:
    """The first field of a calibration that is not what the engine reads, or ``None``.

    Every field a reader uses is checked, so that a corrupt or hand-edited file is ignored
    (and measured again) instead of breaking the engine: zero or negative costs (every call
    would divide by them), non-integer layers, a ``tree_nodes`` or draft length beyond the
    engine's own bounds, booleans where numbers belong (``num_draft_tokens: true``).
    """
    from ..core.validation import MAX_DRAFT_TOKENS, MAX_TREE_NODES

    ints = {"exit_layer": (1, None), "num_draft_tokens": (1, MAX_DRAFT_TOKENS),
            "layer_skip_num_draft_tokens": (1, MAX_DRAFT_TOKENS)}  # fmt: skip
    for name, (low, high) in ints.items():
        if name in data and not _is_int(data[name], low, high):
            return f"{name} is {data[name]!r}, not an int in [{low}, {high or 'inf'}]"
    if "tree_nodes" in data and data["tree_nodes"] is not None and not _is_int(data["tree_nodes"], 1, MAX_TREE_NODES):
        return f"tree_nodes is {data['tree_nodes']!r}, not null or an int in [1, {MAX_TREE_NODES}]"
    if "layer_skip_layers" in data:
        layers = data["layer_skip_layers"]
        if not isinstance(layers, list) or not all(_is_int(i, 0) for i in layers):
            return f"layer_skip_layers is {layers!r:.80}, not a list of layer indices"
    if "step_seconds" in data and not _is_number(data["step_seconds"], 0.0, positive=True):
        return f"step_seconds is {data['step_seconds']!r}, not a positive number"
    if "costs" in data:
        costs = data["costs"]
        if not isinstance(costs, dict) or not _is_number(costs.get("draft", 0.0), 0.0):
            return f"costs is {costs!r:.80}, not {{'draft': cost >= 0, 'verify': {{...}}}}"
        for curve in ("verify", "verify_sampled"):
            problem = _curve_problem(f"costs.{curve}", costs.get(curve) or {}, positive=True)
            if problem is not None:
                return problem
    for name, positive in (("verify_cost", True), ("sampled_verify_cost", True), ("draft_cost", False)):
        if name in data:
            problem = _curve_problem(name, data[name], positive=positive)
            if problem is not None:
                return problem
    if "eagle" in data:
        eagle = data["eagle"]
        if not isinstance(eagle, dict) or not _is_number(eagle.get("draft_cost", 0.0), 0.0):
            return f"eagle is {eagle!r:.80}, not {{'draft_cost': cost >= 0, ...}}"
    if "agreement" in data:
        agreement = data["agreement"]
        if not isinstance(agreement, dict) or not all(
            isinstance(k, str) and k.isdigit() and _is_number(v, 0.0) and v <= 1 for k, v in agreement.items()
        ):
            return f"agreement is {agreement!r:.80}, not {{'layer': rate in [0, 1]}}"
    if "plan" in data:
        return _plan_problem(data["plan"])
    return None


def _plan_problem(plan: Any) -> str | None:
    from ..core.validation import MAX_DRAFT_TOKENS
    from ..drafting.auto import plan_methods

    methods = plan_methods()
    if not isinstance(plan, dict) or plan.get("method") not in methods:
        return f"plan is {plan!r:.80}, not a plan with a method in {methods}"
    speedup = plan.get("predicted_speedup")
    if speedup is not None and not _is_number(speedup, 0.0, positive=True):
        return f"plan.predicted_speedup is {speedup!r}"
    if "settings" in plan:  # method + settings; the older flat form keeps them beside the method
        if not isinstance(plan["settings"], dict):
            return f"plan.settings is {plan['settings']!r:.80}, not a dict"
        plan = plan["settings"]
    if plan.get("exit_layer") is not None and not _is_int(plan["exit_layer"], 1):
        return f"plan.exit_layer is {plan['exit_layer']!r}"
    if "num_draft_tokens" in plan and not _is_int(plan["num_draft_tokens"], 1, MAX_DRAFT_TOKENS):
        return f"plan.num_draft_tokens is {plan['num_draft_tokens']!r}"
    if "min_ngram" in plan and not _is_int(plan["min_ngram"], 1, 64):
        return f"plan.min_ngram is {plan['min_ngram']!r}"
    layers = plan.get("layers", [])
    if not isinstance(layers, list) or not all(_is_int(i, 0) for i in layers):
        return f"plan.layers is {layers!r:.80}, not a list of layer indices"
    if "exit_adapter" in plan and not isinstance(plan["exit_adapter"], bool):
        return f"plan.exit_adapter is {plan['exit_adapter']!r}"
    if plan.get("eagle_head") is not None and not isinstance(plan["eagle_head"], str):
        return f"plan.eagle_head is {plan['eagle_head']!r}"
    own = plan.get("drafter_settings", {})  # the drafter's own options it was measured with (a head's path)
    if not isinstance(own, dict) or not all(isinstance(v, (str, int, float, bool, type(None))) for v in own.values()):
        return f"plan.drafter_settings is {own!r:.80}, not a dict of plain values"
    return None
