"""One shared engine per distinct set of engine arguments, for the whole process.

Framework adapters construct their model objects often (LangChain's standard tests build
dozens); :func:`get_engine` makes construction cheap by loading each model once, on first
use, and handing the same engine to every caller with the same arguments.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

from ..decoding.engine import SpeculativeEngine
from ..decoding.options import EngineOptions

_ENGINES: dict[tuple[tuple[str, Any], ...], SpeculativeEngine] = {}
_LOCK = threading.Lock()


def _key(model: str, engine_args: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The engine's identity: every ``from_pretrained`` argument with defaults filled in.

    Two callers that spell the same engine differently (an argument left out, or passed at
    its default) share it.
    """
    bound = inspect.signature(SpeculativeEngine.from_pretrained).bind(model, **engine_args)
    bound.apply_defaults()
    simple = (str, int, float, bool, type(None))
    return tuple(sorted((k, v if isinstance(v, simple) else repr(v)) for k, v in bound.arguments.items()))


def engine_args(source: Any) -> dict[str, Any]:
    """The ``from_pretrained`` arguments (all but the model name) read from ``source``'s attributes.

    Adapters keep one field per engine option (:class:`~selfspec.decoding.options.EngineOptions`,
    pinned by tests; a drafter's options are fields made from its declaration), and options of
    drafters registered after the adapter's class was made in ``drafter_settings``; this collects
    them under the engine's own names.
    """
    given = {name: getattr(source, name) for name in EngineOptions.names() if hasattr(source, name)}
    return {**given, **(getattr(source, "drafter_settings", None) or {})}


def get_engine(model: str, **engine_args: Any) -> SpeculativeEngine:
    """Return the process-wide engine for these arguments, loading it on first use.

    Args:
        model: a hub id, a local folder, or ``"selfspec-demo"``.
        **engine_args: any other argument of :meth:`SpeculativeEngine.from_pretrained`.

    Returns:
        The shared engine (engines serialise concurrent calls, so sharing is safe).
    """
    key = _key(model, engine_args)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = SpeculativeEngine.from_pretrained(model, **engine_args)
            _ENGINES[key] = engine
        return engine


def clear_engines() -> None:
    """Forget every shared engine (their memory is freed once no caller holds them)."""
    with _LOCK:
        _ENGINES.clear()
