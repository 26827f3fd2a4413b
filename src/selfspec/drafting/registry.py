"""The drafter registry: every drafter name the engine, the CLI, the benchmark and the docs know.

A drafter is one module plus one call::

    register_drafter("my_drafter", lambda engine, **options: MyDrafter(**options))

``SpeculativeEngine(..., drafter="my_drafter")`` then builds it by calling the factory with the
engine (its settings are ``engine.config``, its model ``engine.runner``) and the engine's
``drafter_options``. A drafter's own options (a head's file, say) are declared in its
registration (:class:`~selfspec.drafting.declaring.DrafterOption`): the engine's options, the
command line, ``selfspec serve`` and both adapters are composed from them.

The built-in drafters register themselves in their own modules, imported (with torch) the first
time the registry is read; :data:`BUILTIN_DRAFTERS` is their order and
:data:`BUILTIN_OPTION_MODULES` the torch-free modules that declare their options, so the command
line and the adapters know those options before torch is imported (a test pins both lists to the
registrations).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

from ..errors import ConfigurationError
from .declaring import DrafterOption
from .planning import DrafterBench, DrafterCalibration, DrafterFactory

#: The drafters that come with selfspec, in :func:`list_drafters`' order.
BUILTIN_DRAFTERS = (
    "early_exit",
    "prompt_lookup",
    "hybrid",
    "layer_skip",
    "draft_model",
    "medusa",
    "eagle",
    "eagle_hybrid",
    "none",
    "auto",
)
#: The torch-free modules (under :mod:`selfspec.drafting`) that declare the built-in drafters'
#: options, each as ``OPTIONS``: read by :func:`declared_options` before torch is imported.
BUILTIN_OPTION_MODULES = ("exit_adapter.options", "draft_model_options", "medusa.options", "eagle.options")


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
        engine_options: the names of the engine options only this kind of drafter uses (its
            ``options`` and any named here); passing them with another drafter is an error.
        calibration: how calibration measures it and ``drafter="auto"`` replays it
            (:class:`~selfspec.drafting.planning.DrafterCalibration`); ``None``: ``"auto"``
            never considers it.
        bench: the ``selfspec bench`` rows it adds (:class:`~selfspec.drafting.planning.DrafterBench`);
            ``None``: one greedy row ``selfspec_<name>`` when it builds without arguments.
        options: the options it owns (:class:`~selfspec.drafting.declaring.DrafterOption`): each
            becomes an engine option, a flag, an adapter field, and ``engine.config.<name>``.
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
    options: tuple[DrafterOption, ...] = ()


_REGISTRY: dict[str, DrafterSpec] = {}
_LOCK = threading.Lock()
_LOADING = threading.RLock()
_BUILTINS_LOADED = False


def load_builtins() -> None:
    """Import the built-in drafters (torch), which register themselves; once, on the first read of the registry."""
    global _BUILTINS_LOADED
    with _LOADING:
        if _BUILTINS_LOADED:
            return
        _BUILTINS_LOADED = True  # first: the modules imported below register through this registry
        try:
            importlib.import_module(".builtins", __package__)
        except BaseException:
            _BUILTINS_LOADED = False
            raise


def _ordered(specs: dict[str, DrafterSpec]) -> list[DrafterSpec]:
    """Built-ins in :data:`BUILTIN_DRAFTERS`' order, then the others in registration order."""
    rank = {name: index for index, name in enumerate(BUILTIN_DRAFTERS)}
    return sorted(specs.values(), key=lambda spec: rank.get(spec.name, len(rank)))


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
    options: tuple[DrafterOption, ...] = (),
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
        engine_options: names of engine options only this drafter uses (its ``options`` are added).
        calibration: how calibration measures it and ``drafter="auto"`` builds it from a plan
            (:class:`~selfspec.drafting.planning.DrafterCalibration`).
        bench: the ``selfspec bench`` rows it adds (:class:`~selfspec.drafting.planning.DrafterBench`).
        options: the options it owns (:class:`~selfspec.drafting.declaring.DrafterOption`): each
            reaches ``from_pretrained``, the flags of its verbs, ``selfspec serve`` and both adapters,
            and the drafter reads it as ``engine.config.<name>``. Several drafters may declare the
            same option (the same value); register before building a parser or an adapter class
            that should show it (``docs/custom_drafter.md``).
        replace: allow replacing an existing registration (otherwise an error).

    Raises:
        ConfigurationError: a bad name, a factory that is not callable, a name taken, or an
            option declared differently by another drafter.
    """
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigurationError(f"a drafter name must be a non-empty identifier-like string, got {name!r}")
    if not callable(factory):
        raise ConfigurationError(f"the factory for drafter {name!r} must be callable, got {factory!r}")
    options = tuple(options)
    for option in options:
        if not isinstance(option, DrafterOption):
            raise ConfigurationError(f"drafter {name!r}: options must be DrafterOption values, got {option!r}")
        declared = declared_options().get(option.name)
        if declared is not None and declared != option:
            raise ConfigurationError(f"drafter {name!r}: option {option.name!r} is declared differently elsewhere")
    used = tuple(dict.fromkeys([*engine_options, *(option.name for option in options if option.exclusive)]))
    spec = DrafterSpec(name, factory, description, trees, exit_adapter, calibrated, used, calibration, bench, options)
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
    return [spec.name for spec in registered()]


def registered_now() -> list[str]:
    """The names registered so far, without importing the built-ins (torch-free callers)."""
    with _LOCK:
        return [spec.name for spec in _ordered(_REGISTRY)]


def declared_options() -> dict[str, DrafterOption]:
    """Every option a drafter declares, by name: the built-ins' (without importing torch), then those registered."""
    found: dict[str, DrafterOption] = {}
    for module in BUILTIN_OPTION_MODULES:
        for option in importlib.import_module(f".{module}", __package__).OPTIONS:
            found.setdefault(option.name, option)
    with _LOCK:
        for spec in _ordered(_REGISTRY):
            for option in spec.options:
                found.setdefault(option.name, option)
    return found


def drafters_declaring(option: str) -> list[str]:
    """Names of the drafters that declare the option ``option`` in their registration."""
    return [spec.name for spec in registered() if any(declared.name == option for declared in spec.options)]


def drafter_spec(name: str) -> DrafterSpec:
    """The registration of ``name``.

    Raises:
        ConfigurationError: no drafter has that name.
    """
    load_builtins()
    with _LOCK:
        spec = _REGISTRY.get(name)
    if spec is None:
        raise ConfigurationError(f"unknown drafter {name!r}; choose one of {', '.join(list_drafters())}")
    return spec


def registered() -> list[DrafterSpec]:
    """Every registration, in registration order (built-ins first)."""
    load_builtins()
    with _LOCK:
        return _ordered(_REGISTRY)


def drafters_with(flag: str) -> list[str]:
    """Names of the drafters whose registration has ``flag`` set (``"trees"``, ``"exit_adapter"``...)."""
    return [spec.name for spec in registered() if getattr(spec, flag)]


def drafters_using(option: str) -> list[str]:
    """Names of the drafters that take the engine argument ``option``."""
    return [spec.name for spec in registered() if option in spec.engine_options]


def names_in_words(names: list[str]) -> str:
    """``["a", "b", "c"]`` -> ``"a, b and c"``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
