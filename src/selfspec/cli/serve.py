"""The ``selfspec serve`` subcommand (argument parsing only: no FastAPI import here).

Every flag is checked while parsing, so a bad one is a one-line error (exit status 2) before
the model loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

#: The environment variable read when ``--api-key`` is not given (keeps the key out of ``ps``).
API_KEY_ENV = "SELFSPEC_API_KEY"


def port(value: str) -> int:
    """A TCP port in ``[0, 65535]`` (0: any free port)."""
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"expected a port number in [0, 65535], got {value!r}") from None
    if not 0 <= parsed <= 65535:
        raise ValueError(f"a TCP port is in [0, 65535] (0: any free port), got {parsed}")
    return parsed


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``selfspec`` command's subparsers.

    Args:
        subparsers: the object returned by ``parser.add_subparsers()``.

    Returns:
        The ``serve`` parser (its ``func`` default is :func:`cmd_serve`).
    """
    from ..serving.server.settings import limit_flags
    from .args import add_engine_arguments, checked_type

    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_arguments(parser, "serve")
    parser.add_argument("--model-id", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=checked_type(port), default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every route; better set ${API_KEY_ENV}, read when this "
        "flag is absent: a key on the command line shows in ps (default: no key)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    limits = parser.add_argument_group("limits (see docs/limits.md)")
    for name, default, spec in limit_flags():  # declared once, on ServerLimits
        text = spec.help.format(default=f"{default:g}" if isinstance(default, float) else default)
        if spec.parse is None:  # a repeatable name
            limits.add_argument(spec.flag, dest=name, action="append", default=[], metavar=spec.metavar, help=text)
        else:
            metavar = spec.metavar or spec.flag.lstrip("-").upper().replace("-", "_")
            limits.add_argument(spec.flag, dest=name, type=checked_type(spec.parse), default=default, help=text,
                                metavar=metavar)  # fmt: skip
    parser.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    from .args import engine_kwargs

    try:
        from ..serving.server.app import serve
        from ..serving.server.settings import ServerLimits
    except ImportError as error:
        raise SystemExit(
            f"selfspec serve needs FastAPI and uvicorn: pip install 'selfspec[serve]' ({error})"
        ) from error
    serve(
        args.model,
        host=args.host,
        port=args.port,
        api_key=api_key(args),
        model_id=args.model_id,
        log_level=args.log_level,
        limits=server_limits(args, ServerLimits),
        **engine_kwargs(args),
    )
    return 0


def api_key(args: argparse.Namespace) -> str | None:
    """The key from ``--api-key`` (with a warning: other users see it in ``ps``), else ``$SELFSPEC_API_KEY``."""
    if args.api_key is not None:
        print(
            f"selfspec: warning: --api-key is visible to every user of this machine (ps, /proc/PID/cmdline); "
            f"set ${API_KEY_ENV} instead",
            file=sys.stderr,
        )
        return args.api_key or None
    return os.environ.get(API_KEY_ENV) or None


def server_limits(args: argparse.Namespace, limits_class: Any) -> Any:
    """The :class:`~selfspec.serving.server.settings.ServerLimits` the command line asks for."""
    from ..serving.server.settings import limit_flags

    return limits_class(**{name: tuple(getattr(args, name)) if spec.parse is None else getattr(args, name)
                           for name, _, spec in limit_flags()})  # fmt: skip
