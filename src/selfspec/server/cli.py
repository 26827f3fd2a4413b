"""The ``selfspec serve`` subcommand (argument parsing only: no FastAPI import here)."""

from __future__ import annotations

import argparse
import os
from typing import Any

#: The environment variable read when ``--api-key`` is not given (keeps the key out of ``ps``).
API_KEY_ENV = "SELFSPEC_API_KEY"


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``selfspec`` command's subparsers.

    Args:
        subparsers: the object returned by ``parser.add_subparsers()``.

    Returns:
        The ``serve`` parser (its ``func`` default is :func:`cmd_serve`).
    """
    from ..cli import add_engine_arguments

    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_arguments(parser)
    parser.add_argument("--model-id", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)",
    )
    parser.add_argument(
        "--batching",
        action="store_true",
        help="decode concurrent requests together in batched rounds (same text per request)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
    from ..cli import engine_kwargs

    try:
        from .app import serve
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
        **engine_kwargs(args),
    )
    return 0
