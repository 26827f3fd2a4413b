"""``selfspec serve``: an OpenAI-compatible HTTP server for one model.

Needs the ``serve`` extra (``pip install 'selfspec[serve]'``: FastAPI and uvicorn). The
command line is :mod:`selfspec.cli.serve`;
:func:`create_app` and :func:`serve` load FastAPI on first use.

Example:
    >>> from selfspec.serving.server import serve
    >>> serve("selfspec-demo", port=8000)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .settings import ServerLimits

if TYPE_CHECKING:
    from .app import create_app, serve, serve_in_background

__all__ = ["ServerLimits", "create_app", "serve", "serve_in_background"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "serve", "serve_in_background"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
