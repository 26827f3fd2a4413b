"""``selfspec export-eagle``: write an EAGLE-3 head as a folder vLLM and SGLang run (the speculators layout).

Kept apart from :mod:`selfspec.drafting.eagle.speculators` so that building the ``selfspec`` parser imports no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..commands import add_command, add_model_arguments, load_model

#: ``selfspec --help``'s line for the command.
SUMMARY = "write an EAGLE-3 head in vLLM's speculators layout (for vllm serve / SGLang)"
#: ``selfspec export-eagle --help``'s description.
DESCRIPTION = (
    "Write an EAGLE-3 head (a SafeAILab/SpecForge or speculators folder) for --model as a speculators folder: "
    "config.json naming the verifier + model.safetensors. `vllm serve DIR` runs it; selfspec reads it back."
)


def add_export_eagle_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``export-eagle`` to the ``selfspec`` command's subparsers."""
    parser = add_command(subparsers, "export-eagle", summary=SUMMARY, description=DESCRIPTION, func=cmd_export_eagle)
    add_model_arguments(
        parser,
        model_help="the target: hub id, local folder or .gguf file",
        dtype="float16",
        dtypes=("float16", "bfloat16", "float32"),
        device="cpu",
    )
    parser.add_argument("--head", required=True, help="the head folder ('auto': the one selfspec finds for the model)")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write")
    parser.add_argument("--verifier", default=None, help="the target's name for vLLM (default: the head's, --model)")
    parser.add_argument("--speculative-tokens", type=int, default=None, help="vLLM's draft length (default 3)")
    return parser


def cmd_export_eagle(args: argparse.Namespace) -> int:
    """Load the model and the head, check them, write the folder, print where and how to serve it."""
    import torch

    from ...errors import ConfigurationError
    from .export import export_eagle
    from .head import find_eagle_head

    if args.speculative_tokens is not None and args.speculative_tokens < 1:
        raise ConfigurationError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    head = args.head
    if head != "auto" and not Path(head).expanduser().is_dir():
        raise ConfigurationError(f"--head {head}: no such folder")
    model, _, path = load_model(args, dtype="float32")  # --dtype is the written head's
    if head == "auto":
        found = find_eagle_head(str(path), model)
        if found is None:
            raise ConfigurationError(f"no EAGLE head found for {args.model}; pass --head FOLDER")
        head = str(found)
    verifier = args.verifier or None
    out = export_eagle(
        model, head, args.out, verifier=verifier, speculative_tokens=args.speculative_tokens,
        dtype=getattr(torch, args.dtype),
    )  # fmt: skip
    print(  # noqa: T201
        f"wrote {out} (speculators eagle3 layout)\n"
        f"  vLLM:   vllm serve {out}\n"
        f"  SGLang: python -m sglang.launch_server --model-path <the verifier> --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out}\n"
        f"  selfspec: eagle_head='{out}'"
    )
    return 0
