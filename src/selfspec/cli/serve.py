"""The ``selfspec serve`` subcommand (argument parsing only: no FastAPI import here).

Every flag is checked while parsing, so a bad one is a one-line error (exit status 2) before
the model loads.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any

#: The environment variable read when ``--api-key`` is not given (keeps the key out of ``ps``).
API_KEY_ENV = "SELFSPEC_API_KEY"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20, "g": 10**9}
_UNITS.update({"gb": 10**9, "gib": 2**30})


def byte_size(value: str) -> int:
    """A size in bytes: ``2097152``, ``2MiB``, ``500kB``, ``1.5MB`` (at least 1 byte)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 2097152, 2MiB or 500kB, got {value!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {value!r}")
    return size


def port(value: str) -> int:
    """A TCP port in ``[0, 65535]`` (0: any free port)."""
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"expected a port number in [0, 65535], got {value!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"a TCP port is in [0, 65535] (0: any free port), got {number}")
    return number


def seconds(value: str) -> float:
    """A finite number of seconds > 0."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not 0 < number < math.inf:
        raise ValueError(f"must be a finite number of seconds > 0, got {value!r}")
    return number


def count(value: str) -> int:
    """An int >= 0."""
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"expected an int >= 0, got {value!r}") from None
    if number < 0:
        raise ValueError(f"must be an int >= 0, got {number}")
    return number


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``selfspec`` command's subparsers.

    Args:
        subparsers: the object returned by ``parser.add_subparsers()``.

    Returns:
        The ``serve`` parser (its ``func`` default is :func:`cmd_serve`).
    """
    from ..serving.server.settings import ServerLimits
    from .args import add_engine_arguments, checked_type, positive_int

    defaults = ServerLimits()
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_arguments(parser)
    parser.add_argument("--model-id", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=checked_type(port), default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route (default: ${API_KEY_ENV}, else no key)",
    )
    parser.add_argument(
        "--escape-special-tokens",
        action="store_true",
        help="encode special-token strings written in messages, tools and history as plain text, so that "
        "only the chat template's markup becomes control tokens (default: off, as transformers and vLLM)",
    )
    parser.add_argument(
        "--batching",
        action="store_true",
        help="decode concurrent requests together in batched rounds (same text per request)",
    )
    parser.add_argument("--threads", type=checked_type(positive_int), default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    limits = parser.add_argument_group("limits (see docs/limits.md)")
    limits.add_argument(
        "--max-body-size",
        type=checked_type(byte_size),
        default=defaults.max_body_bytes,
        help=f"largest request body, e.g. 2MiB; larger ones get 413 (default: {defaults.max_body_bytes} bytes)",
    )
    limits.add_argument(
        "--max-concurrent",
        type=checked_type(positive_int),
        default=defaults.max_concurrent,
        help=f"generation requests served at once (default: {defaults.max_concurrent})",
    )
    limits.add_argument(
        "--max-queue",
        type=checked_type(count),
        default=defaults.max_queue,
        help=f"requests waiting for a slot; more get 429 with Retry-After (default: {defaults.max_queue})",
    )
    limits.add_argument(
        "--header-timeout",
        type=checked_type(seconds),
        default=defaults.header_timeout,
        help=f"seconds to send a request's headers before the connection is closed (default: "
        f"{defaults.header_timeout:g})",
    )
    limits.add_argument(
        "--body-timeout",
        type=checked_type(seconds),
        default=defaults.body_timeout,
        help=f"seconds to send a request body; 408 otherwise (default: {defaults.body_timeout:g})",
    )
    limits.add_argument(
        "--keep-alive-timeout",
        type=checked_type(seconds),
        default=defaults.keep_alive_timeout,
        help=f"seconds an idle keep-alive connection stays open (default: {defaults.keep_alive_timeout:g})",
    )
    limits.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="accept this Host header besides localhost, 127.0.0.1, [::1] and --host (repeatable; '*': any)",
    )
    limits.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from this origin call the API, e.g. http://localhost:3000 (repeatable; "
        "default: none, no CORS headers)",
    )
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
        api_key=args.api_key or None,
        model_id=args.model_id,
        log_level=args.log_level,
        batching=args.batching,
        escape_special_tokens=args.escape_special_tokens,
        limits=server_limits(args, ServerLimits),
        **engine_kwargs(args),
    )
    return 0


def server_limits(args: argparse.Namespace, limits_class: Any) -> Any:
    """The :class:`~selfspec.serving.server.limits.ServerLimits` the command line asks for."""
    return limits_class(
        max_body_bytes=args.max_body_size,
        max_concurrent=args.max_concurrent,
        max_queue=args.max_queue,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        allowed_hosts=tuple(args.allowed_host),
        cors_origins=tuple(args.cors_origin),
    )
