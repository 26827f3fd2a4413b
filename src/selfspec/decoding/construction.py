"""How an engine is put together: the target and its drafter files loaded, the parts built once per plan.

:func:`load_target` is :meth:`~selfspec.SpeculativeEngine.from_pretrained`'s loading step (the
model, its tokenizer and the files a drafter loads like the target); :func:`build_parts` builds
what an engine decodes with (drafter, controller, batching scheduler, static round) from its
resolved settings. While :func:`parts_built_later` is in force (:meth:`from_pretrained
<selfspec.SpeculativeEngine.from_pretrained>` loading), the engine resolves its settings and leaves
the parts for first use, so that they are built once, for the plan first-load calibration chooses.
:class:`Held` declares the engine's attributes that read through to its settings or its parts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, overload

from ..drafting import Drafter, drafter_spec
from ..drafting.auto import sampled_drafts_pay
from ..drafting.registry import drafters_declaring
from ..errors import ConfigurationError
from .batching import BatchScheduler, EngineParts
from .controller import DraftController
from .options import EngineOptions, engine_settings
from .static_round import StaticRounds, static_rounds


@dataclass
class BuiltParts:
    """What an engine builds from its resolved settings, once per plan (:meth:`SpeculativeEngine.configure`).

    Attributes:
        drafter: the configured drafter.
        controller: the draft length and the online guard (:class:`~selfspec.decoding.controller.DraftController`).
        batcher: the batching scheduler (``batching=True``), else ``None``.
        static: the static round single calls run in (``compile=``), else ``None``.
    """

    drafter: Drafter
    controller: DraftController
    batcher: BatchScheduler | None
    static: StaticRounds | None


T = TypeVar("T")


class Held(Generic[T]):
    """An engine attribute its settings or parts hold: ``engine.exit_layer`` is ``engine.config.exit_layer``.

    Declared once in :class:`~selfspec.SpeculativeEngine`'s body (``exit_layer: Held[int] =
    Held("config")``), so that each attribute is found where it is defined.

    Args:
        holder: the engine attribute holding it: ``"config"`` (the resolved settings) or ``"parts"``
            (:class:`BuiltParts`: ``engine.drafter`` is ``engine.parts.drafter``).
        field: its name there (default: the attribute's own).
        settable: whether assigning the attribute replaces it there (else it is read-only).
    """

    def __init__(self, holder: str, field: str | None = None, *, settable: bool = False) -> None:
        self.holder, self.field, self.settable = holder, field, settable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.field = self.field or name

    @overload
    def __get__(self, engine: None, owner: type | None = None) -> Held[T]: ...
    @overload
    def __get__(self, engine: object, owner: type | None = None) -> T: ...
    def __get__(self, engine: object, owner: type | None = None) -> Held[T] | T:
        if engine is None:
            return self
        value: T = getattr(getattr(engine, self.holder), str(self.field))
        return value

    def __set__(self, engine: object, value: T) -> None:
        if not self.settable:
            raise AttributeError(f"property {self.name!r} of {type(engine).__name__!r} object has no setter")
        setattr(getattr(engine, self.holder), str(self.field), value)


class BuildingEngine(EngineParts, Protocol):
    """What :func:`build_parts` reads and sets of its engine (a :class:`~selfspec.SpeculativeEngine`)."""

    options: EngineOptions
    parts_built: int
    _parts: BuiltParts | None


@dataclass
class LoadedTarget:
    """What :func:`load_target` loaded.

    Attributes:
        model: the target model, its ``config._name_or_path`` set to where it was loaded from.
        tokenizer: its tokenizer.
        settings: the engine's own options (the constructor's keywords), a drafter's file loaded.
    """

    model: Any
    tokenizer: Any
    settings: dict[str, Any]


_LATER = threading.local()  # set while from_pretrained loads: its parts are built once, after calibration


@contextmanager
def parts_built_later() -> Iterator[None]:
    """Within: :meth:`SpeculativeEngine.configure` resolves the settings and leaves the parts for first use."""
    before = getattr(_LATER, "on", False)
    _LATER.on = True
    try:
        yield
    finally:
        _LATER.on = before


def parts_deferred() -> bool:
    """Whether :func:`parts_built_later` is in force on this thread."""
    return bool(getattr(_LATER, "on", False))


def build_parts(engine: BuildingEngine) -> BuiltParts:
    """The drafter, controller, scheduler and static round of the engine's current settings."""
    engine.parts_built += 1
    config = engine.config
    controller = DraftController(
        config.num_draft_tokens,
        adaptive=config.adaptive,
        costs=config.calibration.get("costs"),
        sampling_drafts=config.drafter_name != "auto" or sampled_drafts_pay(config.calibration),
    )
    parts = BuiltParts(make_drafter(engine), controller, None, static_rounds(engine.runner, engine.options.compile))
    engine._parts = parts  # the scheduler reads the drafter and controller through the engine
    parts.batcher = BatchScheduler(engine) if config.batching else None
    return parts


def make_drafter(engine: BuildingEngine) -> Drafter:
    """The configured drafter: a user's instance, or the registered factory's product."""
    chosen = engine.config.drafter
    if isinstance(chosen, Drafter):
        return chosen
    drafter = drafter_spec(chosen).factory(engine, **engine.config.drafter_options)
    if not isinstance(drafter, Drafter):
        raise ConfigurationError(f"the factory of drafter {chosen!r} returned {drafter!r}, not a Drafter")
    return drafter


def load_target(name_or_path: str | os.PathLike[str], options: EngineOptions) -> LoadedTarget:
    """Load the target and its tokenizer with ``options``' loading options, and the files its drafter loads too."""
    from ..modeling.loading import load_model_and_tokenizer

    loading: dict[str, Any] = {
        "quantization": options.quantization,
        "dtype": options.dtype,
        "device": options.device,
        "trust_remote_code": options.trust_remote_code,
        "allow_pickle": options.allow_pickle,
    }
    model, tokenizer, path = load_model_and_tokenizer(name_or_path, gguf_file=options.gguf_file, **loading)
    model.config._name_or_path = path
    settings = engine_settings(options)
    for name, option in EngineOptions.drafter_options().items():  # a file option its drafter loads now
        value = getattr(options, name)
        load = option.loader()
        if load is not None and option.given(value) and options.drafter in drafters_declaring(name):
            settings.update(load(value, loading))
    return LoadedTarget(model, tokenizer, settings)
