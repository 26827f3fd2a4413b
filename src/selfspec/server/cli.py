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
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument("--model", "-m", required=True, help="hub id, local folder, or 'selfspec-demo'")
    parser.add_argument("--model-id", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else no key)",
    )
    parser.add_argument("--quantization", choices=["4bit", "8bit"], default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--exit-layer", default="auto", help="draft exit layer, or 'auto'")
    parser.add_argument("--num-draft-tokens", default="auto", help="draft length, or 'auto'")
    parser.add_argument(
        "--drafter", default="early_exit", choices=["early_exit", "prompt_lookup", "hybrid", "draft_model", "none"]
    )
    parser.add_argument("--draft-model", default=None, help="with --drafter draft_model: the draft model")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=cmd_serve)
    return parser


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until interrupted."""
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
        quantization=args.quantization,
        dtype=args.dtype,
        device=args.device,
        exit_layer=_int_or_auto(args.exit_layer),
        num_draft_tokens=_int_or_auto(args.num_draft_tokens),
        drafter=args.drafter,
        trust_remote_code=args.trust_remote_code,
        draft_model=args.draft_model,
    )
    return 0
