"""Drafters: propose tokens for the target to verify; a drafter never decides.

:mod:`.base` holds the contract (:class:`Drafter`, :class:`Draft`, :class:`DecodeState`),
:mod:`.registry` the names ``drafter=`` accepts, and each other module one drafter, which
registers itself. Importing this package registers the built-in drafters.
"""

from .base import DecodeState, Draft, Drafter, NoDrafter, choose_token, draft_autoregressively
from .registry import DrafterSpec, drafter_spec, list_drafters, register_drafter, unregister_drafter

# built-in drafters, each registering itself (this order is the order of list_drafters())
from .early_exit import EarlyExitDrafter  # isort: skip
from .prompt_lookup import NgramIndex, PromptLookupDrafter  # isort: skip
from .hybrid import HybridDrafter, graft  # isort: skip
from .layer_skip import LayerSkipDrafter, contiguous_runs, default_skip_layers  # isort: skip
from .draft_model import DraftModelDrafter  # isort: skip
from .medusa.drafter import MedusaDrafter, MedusaHeads  # isort: skip
from .eagle.drafter import EagleDrafter  # isort: skip


def _make_none(engine: object, **options: object) -> NoDrafter:
    """Plain decoding: no draft."""
    return NoDrafter()


register_drafter("none", _make_none, description="plain decoding (the baseline)")

__all__ = [
    "DecodeState",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DrafterSpec",
    "EagleDrafter",
    "EarlyExitDrafter",
    "HybridDrafter",
    "LayerSkipDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "NgramIndex",
    "NoDrafter",
    "PromptLookupDrafter",
    "choose_token",
    "contiguous_runs",
    "default_skip_layers",
    "draft_autoregressively",
    "drafter_spec",
    "graft",
    "list_drafters",
    "register_drafter",
    "unregister_drafter",
]
