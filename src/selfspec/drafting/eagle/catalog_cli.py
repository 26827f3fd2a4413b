"""``selfspec eagle-heads``: the table of published EAGLE heads, which are here, and how to fetch the rest.

Reads the table (:func:`~selfspec.drafting.eagle.catalog.catalog_entries`) and the local copies
(:func:`~selfspec.drafting.eagle.catalog.local_copy`); loads no model and never asks the hub, so
it works offline. Kept apart from :mod:`selfspec.drafting.eagle.catalog`'s callers so that building
the ``selfspec`` parser imports no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..commands import add_command

#: ``selfspec --help``'s line for the command.
SUMMARY = "list the published EAGLE heads eagle_head='auto' knows, which are here, and how to fetch the others"
#: ``selfspec eagle-heads --help``'s description.
DESCRIPTION = (
    "The table of published EAGLE-3 heads (SELFSPEC_HEAD_CATALOG's entries first): for each target, its heads, "
    "their pinned commit (or 'main, unpinned') and layout, and where the head is on this machine (SELFSPEC_HEAD_HUB, "
    "then huggingface_hub's cache) or the command that fetches it. Loads no model and never asks the hub; a head "
    "that is here is checked against the model when eagle_head='auto' loads it."
)


def add_eagle_heads_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``eagle-heads`` to the ``selfspec`` command's subparsers."""
    parser = add_command(subparsers, "eagle-heads", summary=SUMMARY, description=DESCRIPTION, func=cmd_eagle_heads)
    parser.add_argument("--model", "-m", default=None, help="only the heads for this model (hub id or folder)")
    return parser


def table_lines(model: str | None = None) -> list[str]:
    """The lines ``selfspec eagle-heads`` prints: one per target, then one per head (empty: none for ``model``).

    Raises:
        ConfigurationError: ``SELFSPEC_HEAD_CATALOG`` names an unreadable or malformed table.
    """
    from .catalog import CATALOG_VERSION, catalog_entries, entries_for, held_copy, hub_folder

    entries = entries_for(model) if model else catalog_entries()
    hub = hub_folder()
    lines: list[str] = []
    for target in dict.fromkeys(entry.target for entry in entries):  # table order, each target once
        lines.append(target)
        for entry in (e for e in entries if e.target == target):
            folder = held_copy(entry, hub)
            where = f"here: {folder}" if folder is not None else f"not here; fetch: {entry.fetch_command(hub)}"
            lines.append(f"  {entry.label}, {entry.layout} layout: {where}")
    if lines:
        hub_line = f"local hub {hub} (SELFSPEC_HEAD_HUB)" if hub is not None else "no local hub (SELFSPEC_HEAD_HUB)"
        lines.insert(0, f"published EAGLE heads (table version {CATALOG_VERSION}; {hub_line}):")
    return lines


def cmd_eagle_heads(args: argparse.Namespace) -> int:
    """Print the table; exit 1 when ``--model`` has no head in it."""
    lines = table_lines(args.model)
    if not lines:
        print(f"no published EAGLE head in selfspec's table for {args.model}")  # noqa: T201
        return 1
    print("\n".join(lines))  # noqa: T201
    return 0
