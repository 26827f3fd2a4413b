"""A small trained module between the exit layer and the shared head, for the drafter only.

A model trained without early-exit losses drafts badly from its early layers: the final norm
and LM head were only ever trained on the last layer's states. An :class:`ExitAdapter` maps the
exit layer's state ``h_E`` to something the shared head reads well::

    draft logits = head(norm(adapter(h_E))),   adapter(h) = h + W_up silu(W_gate n(h)) * (W_in n(h))

(a residual SwiGLU block of small rank ``r`` with its own RMS norm ``n``; ``W_up`` starts at
zero, so an untrained adapter is the plain early exit). It is self-distilled from the model's
own last layer (:mod:`selfspec.drafting.exit_adapter.train`), in the spirit of the draft heads of
Medusa (Cai et al. 2024) and EAGLE (Li et al. 2024), but position-wise and tiny.

The adapter touches only the drafter's logits. The exit states handed to verification stay the
raw ``h_E``: the target continues its own layers ``[E, L)`` from them, so its text never changes.

Saved as a folder holding ``adapter_config.json`` and ``adapter.safetensors``, by default in the
user cache like a calibration (``<cache>/exit_adapters/<model key>/``, :mod:`selfspec.artifacts`);
``exit_adapter="auto"`` also reads one shipped or published in ``<model folder>/exit_adapter``.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...artifacts import EXIT_ADAPTERS, atomic_path, atomic_write_text, find_artifact, make_folder, model_cache
from ...errors import ConfigurationError
from ..registry import drafters_with, names_in_words

#: The folder name of an adapter saved beside its model.
EXIT_ADAPTER_DIR = "exit_adapter"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter.safetensors"
FORMAT = "selfspec-exit-adapter"


@dataclass
class ExitAdapterConfig:
    """What an adapter was built for.

    Attributes:
        exit_layer: the layer whose output state the adapter reads (the drafter's ``E``).
        hidden_size: the model's hidden size.
        rank: the width of the adapter's gated projection.
        num_layers: the model's number of decoder layers (checked on load).
        vocab_size: the model's vocabulary size (checked on load).
        model_type: the model's transformers ``model_type``.
        rms_norm_eps: epsilon of the adapter's own RMS norm.
        training: how it was trained (steps, losses, agreement before and after).
    """

    exit_layer: int
    hidden_size: int
    rank: int = 64
    num_layers: int = 0
    vocab_size: int = 0
    model_type: str = ""
    rms_norm_eps: float = 1e-6
    training: dict[str, Any] = field(default_factory=dict)


class ExitAdapter(nn.Module):
    """A residual low-rank SwiGLU block applied to the exit layer's state before norm and head.

    Args:
        config: the adapter's shape and the model it belongs to.
    """

    def __init__(self, config: ExitAdapterConfig) -> None:
        super().__init__()
        if config.exit_layer < 1 or config.hidden_size < 1 or config.rank < 1:
            raise ConfigurationError(f"invalid exit adapter config {config!r}")
        self.config = config
        hidden, rank = config.hidden_size, config.rank
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, rank, bias=False)
        self.up_in = nn.Linear(hidden, rank, bias=False)
        self.down = nn.Linear(rank, hidden, bias=False)
        nn.init.zeros_(self.down.weight)  # untrained: the identity, i.e. the plain early exit

    @property
    def exit_layer(self) -> int:
        """The layer the adapter was trained for."""
        return self.config.exit_layer

    def __repr__(self) -> str:
        c = self.config
        return f"ExitAdapter(exit_layer={c.exit_layer}, hidden_size={c.hidden_size}, rank={c.rank})"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` exit states -> ``[..., hidden]`` states for the shared norm and head."""
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        x = (x * self.norm_weight.float()).to(hidden.dtype)
        return hidden + self.down(nn.functional.silu(self.gate(x)) * self.up_in(x))

    def check_model(self, adapter: Any) -> None:
        """Raise :class:`ConfigurationError` unless the adapter fits this model.

        Args:
            adapter: the target's :class:`~selfspec.modeling.ModelRunner`.
        """
        c = self.config
        hidden = int(getattr(adapter.config, "hidden_size", 0))
        problems = []
        if c.hidden_size != hidden:
            problems.append(f"hidden size {c.hidden_size} != the model's {hidden}")
        if c.num_layers and c.num_layers != adapter.num_layers:
            problems.append(f"{c.num_layers} layers != the model's {adapter.num_layers}")
        if c.vocab_size and c.vocab_size != adapter.vocab_size:
            problems.append(f"vocabulary {c.vocab_size} != the model's {adapter.vocab_size}")
        if not 1 <= c.exit_layer < adapter.num_layers:
            problems.append(f"exit layer {c.exit_layer} is outside [1, {adapter.num_layers - 1}]")
        if problems:
            raise ConfigurationError(
                "this exit adapter was trained for another model: " + "; ".join(problems) + ". "
                "Train one for this model with `selfspec train-adapter --model ...`."
            )

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``adapter_config.json`` and ``adapter.safetensors`` (float32) to ``folder``."""
        from safetensors.torch import save_file

        out = Path(folder)
        make_folder(out)
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        with atomic_path(out / WEIGHTS_FILE) as partial:  # each file written aside and renamed into place
            save_file(tensors, str(partial), metadata={"format": FORMAT})
        data = {"format": FORMAT, "version": 1, **asdict(self.config)}
        atomic_write_text(out / CONFIG_FILE, json.dumps(data, indent=2) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            (out / name).chmod(0o644)  # safetensors writes owner-only files
        return out


def exit_adapter_path(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """Where ``selfspec train-adapter`` saves a model's adapter: ``<cache>/exit_adapters/<model key>/``.

    ``None`` when the model has no name. See :func:`find_exit_adapter` for where one is looked for.
    """
    if not name_or_path:
        return None
    return model_cache(name_or_path, EXIT_ADAPTERS)


def find_exit_adapter(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The adapter ``exit_adapter="auto"`` loads, or ``None``.

    Looks in :func:`exit_adapter_path` (the user cache), then, read only, in a local model folder's
    ``exit_adapter/`` (shipped beside the bundled demo draft model, or published) and where earlier
    versions saved adapters (:func:`~selfspec.artifacts.find_artifact`).
    """
    return find_artifact(
        name_or_path, EXIT_ADAPTERS, lambda folder: (folder / CONFIG_FILE).is_file(), beside=(EXIT_ADAPTER_DIR,)
    )


def load_exit_adapter(folder: str | os.PathLike[str]) -> ExitAdapter:
    """Load an adapter saved by :meth:`ExitAdapter.save` (float32, on the CPU).

    Raises:
        ConfigurationError: the folder, its files or their contents are missing or malformed.
    """
    path = Path(folder).expanduser()
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ConfigurationError(
            f"no exit adapter at {str(path)!r}: expected a folder with {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(made by `selfspec train-adapter`)"
        )
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"format is not {FORMAT!r}")
        data.pop("version", None)
        config = ExitAdapterConfig(**data)
        from safetensors.torch import load_file

        module = ExitAdapter(config)
        module.load_state_dict(load_file(str(weights_path)))
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise ConfigurationError(f"unreadable exit adapter at {str(path)!r}: {exc}") from exc
    return module.eval().requires_grad_(False)


def resolve_exit_adapter(
    exit_adapter: str | os.PathLike[str] | ExitAdapter | None, name_or_path: str | None
) -> ExitAdapter | None:
    """The engine's ``exit_adapter=`` argument as a module (or ``None``).

    Args:
        exit_adapter: ``None`` (no adapter), ``"auto"`` (the one saved beside the model, if
            any), a folder, or a loaded :class:`ExitAdapter`.
        name_or_path: the model's folder or hub id (for ``"auto"``).
    """
    if exit_adapter is None or isinstance(exit_adapter, ExitAdapter):
        return exit_adapter
    if not isinstance(exit_adapter, (str, os.PathLike)):
        raise ConfigurationError(
            f"exit_adapter must be None, 'auto', a folder or an ExitAdapter, got {type(exit_adapter).__name__}"
        )
    if exit_adapter == "auto":
        saved = find_exit_adapter(name_or_path)
        return load_exit_adapter(saved) if saved is not None else None
    return load_exit_adapter(exit_adapter)


def engine_exit_adapter(
    exit_adapter: str | os.PathLike[str] | ExitAdapter | None,
    model_adapter: Any,
    name_or_path: str | None,
    exit_layer: int | str,
    drafter: Any,
) -> ExitAdapter | None:
    """The adapter an engine drafts with, checked against its model and settings.

    An adapter asked for explicitly (a folder or a module) must fit: the model's shape, an
    early-exit or hybrid drafter, and ``exit_layer`` either ``"auto"`` or the adapter's own;
    anything else raises :class:`ConfigurationError`. A saved adapter found by ``"auto"`` is
    simply left out where the drafter or the explicit ``exit_layer`` does not use it.

    Args:
        exit_adapter: the engine's ``exit_adapter`` argument.
        model_adapter: the target's :class:`~selfspec.modeling.ModelRunner`.
        name_or_path: the target's folder or hub id.
        exit_layer: the engine's ``exit_layer`` argument.
        drafter: the engine's ``drafter`` argument.

    Returns:
        A private copy on the model's device and dtype, without gradients, or ``None``.
    """
    explicit = exit_adapter != "auto"
    module = resolve_exit_adapter(exit_adapter, name_or_path)
    if module is None:
        return None
    users = drafters_with("exit_adapter")  # drafters that read the exit layer through the shared head
    if drafter not in users:
        if explicit:
            raise ConfigurationError(
                f"exit_adapter= is used only by the {names_in_words(users)} drafters, not {drafter!r}"
            )
        return None
    module.check_model(model_adapter)
    if exit_layer != "auto" and exit_layer != module.exit_layer:
        if explicit:
            raise ConfigurationError(
                f"the exit adapter was trained for exit layer {module.exit_layer}, not {exit_layer!r}: pass "
                f"exit_layer='auto' (or {module.exit_layer}), or train an adapter for layer {exit_layer}"
            )
        return None
    module = copy.deepcopy(module).requires_grad_(False).eval()
    return module.to(device=model_adapter.device, dtype=model_adapter.dtype)
