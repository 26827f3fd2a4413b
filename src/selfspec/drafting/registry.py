"""The drafter registry: every drafter name the engine, the CLI, the benchmark and the docs know.

A drafter is one module plus one call::

    register_drafter("my_drafter", lambda engine, **options: MyDrafter(**options))

``SpeculativeEngine(..., drafter="my_drafter")`` then builds it by calling the factory with the
engine (its settings are ``engine.config``, its model ``engine.runner``) and the engine's
``drafter_options``. The built-in drafters register themselves in their own modules; nothing
else lists drafter names.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import ConfigurationError
from .planning import DrafterBench, DrafterCalibration, DrafterFactory


@dataclass(frozen=True)
class DrafterSpec:
    """A registered drafter.

    Attributes:
        name: the name ``drafter=`` takes.
        factory: ``factory(engine, **options) -> Drafter``.
        description: one line for ``--help`` and the docs.
        trees: whether it drafts token trees with ``tree_nodes=N``.
        exit_adapter: whether it drafts through a trained exit adapter (``exit_adapter=``).
        calibrated: whether its ``"auto"`` settings come from the early-exit calibration
            (``from_pretrained`` measures one on first load when none is saved).
        engine_options: engine arguments only this kind of drafter uses (``"draft_model"``,
            ``"medusa_heads"``); passing them with another drafter is an error.
        calibration: how calibration measures it and ``drafter="auto"`` replays it
            (:class:`~selfspec.drafting.planning.DrafterCalibration`); ``None``: ``"auto"``
            never considers it.
        bench: the ``selfspec bench`` rows it adds (:class:`~selfspec.drafting.planning.DrafterBench`);
            ``None``: one greedy row ``selfspec_<name>`` when it builds without arguments.
    """

    name: str
    factory: DrafterFactory
    description: str = ""
    trees: bool = False
    exit_adapter: bool = False
    calibrated: bool = False
    engine_options: tuple[str, ...] = ()
    calibration: DrafterCalibration | None = None
    bench: DrafterBench | None = None


_REGISTRY: dict[str, DrafterSpec] = {}
_LOCK = threading.Lock()


def register_drafter(
    name: str,
    factory: DrafterFactory,
    *,
    description: str = "",
    trees: bool = False,
    exit_adapter: bool = False,
    calibrated: bool = False,
    engine_options: tuple[str, ...] = (),
    calibration: DrafterCalibration | None = None,
    bench: DrafterBench | None = None,
    replace: bool = False,
) -> None:
    """Make ``drafter=name`` build a drafter with ``factory(engine, **options)``.

    Args:
        name: the drafter's name (an identifier-like string, e.g. ``"my_drafter"``).
        factory: called as ``factory(engine, **engine.drafter_options)``; it returns a
            :class:`~selfspec.drafting.Drafter`. ``engine.config`` holds the resolved settings
            (``exit_layer``, ``num_draft_tokens``, ``tree_nodes``, ...) and ``engine.runner``
            runs the target's layers.
        description: one line shown by ``--help`` and the docs.
        trees: the drafter drafts token trees when the engine has ``tree_nodes`` set.
        exit_adapter: the drafter uses the engine's exit adapter.
        calibrated: its ``"auto"`` settings come from the early-exit calibration.
        engine_options: engine arguments only this drafter uses.
        calibration: how calibration measures it and ``drafter="auto"`` builds it from a plan
            (:class:`~selfspec.drafting.planning.DrafterCalibration`).
        bench: the ``selfspec bench`` rows it adds (:class:`~selfspec.drafting.planning.DrafterBench`).
        replace: allow replacing an existing registration (otherwise an error).

    Raises:
        ConfigurationError: a bad name, a factory that is not callable, or a name taken.
    """
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigurationError(f"a drafter name must be a non-empty identifier-like string, got {name!r}")
    if not callable(factory):
        raise ConfigurationError(f"the factory for drafter {name!r} must be callable, got {factory!r}")
    spec = DrafterSpec(
        name, factory, description, trees, exit_adapter, calibrated, tuple(engine_options), calibration, bench
    )
    with _LOCK:
        if name in _REGISTRY and not replace and _REGISTRY[name].factory is not factory:
            raise ConfigurationError(f"a drafter named {name!r} is already registered (pass replace=True)")
        _REGISTRY[name] = spec


def unregister_drafter(name: str) -> None:
    """Forget a registered drafter (tests; built-in names come back only on re-import)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


def list_drafters() -> list[str]:
    """The registered drafter names, in registration order (built-ins first)."""
    with _LOCK:
        return list(_REGISTRY)


def drafter_spec(name: str) -> DrafterSpec:
    """The registration of ``name``.

    Raises:
        ConfigurationError: no drafter has that name.
    """
    with _LOCK:
        spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigurationError(f"unknown drafter {name!r}; choose one of {', '.join(list_drafters())}")
    return spec


def registered() -> list[DrafterSpec]:
    """Every registration, in registration order."""
    with _LOCK:
        return list(_REGISTRY.values())


def drafters_with(flag: str) -> list[str]:
    """Names of the drafters whose registration has ``flag`` set (``"trees"``, ``"exit_adapter"``...)."""
    with _LOCK:
        return [name for name, spec in _REGISTRY.items() if getattr(spec, flag)]


def drafters_using(option: str) -> list[str]:
    """Names of the drafters that take the engine argument ``option``."""
    with _LOCK:
        return [name for name, spec in _REGISTRY.items() if option in spec.engine_options]


def names_in_words(names: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
