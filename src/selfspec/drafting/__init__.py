"""Drafters: propose tokens for the target to verify; a drafter never decides.

:mod:`.base` holds the contract (:class:`Drafter`, :class:`Draft`, :class:`DecodeState`),
:mod:`.registry` the names ``drafter=`` accepts, :mod:`.declaring` how a drafter declares its own
options, and each other module one drafter, which registers itself. Importing this package imports
no torch: the drafter classes are imported on first use, and the built-in drafters register
(:mod:`.builtins`) the first time the registry is read.
"""

from typing import TYPE_CHECKING, Any

from .declaring import DrafterOption, OptionSpec
from .planning import PLAIN, BenchContext, BenchRow, DrafterBench, DrafterCalibration, DrafterFactory, sampled
from .registry import DrafterSpec, drafter_spec, list_drafters, register_drafter, unregister_drafter

if TYPE_CHECKING:
    from .base import (
        DecodeState,
        DeviceDraft,
        Draft,
        Drafter,
        NoDrafter,
        StaticDraft,
        StaticDrafting,
        choose_token,
        draft_autoregressively,
        draft_chain_on_device,
    )
    from .draft_model import DraftModelDrafter
    from .eagle.drafter import EagleDrafter
    from .early_exit import EarlyExitDrafter
    from .hybrid import HybridDrafter, graft
    from .layer_skip import LayerSkipDrafter, contiguous_runs, default_skip_layers
    from .medusa.drafter import MedusaDrafter, MedusaHeads
    from .prompt_lookup import NgramIndex, PromptLookupDrafter

#: The names imported on first use (PEP 562; they import torch), by module.
_LAZY = {
    **dict.fromkeys(
        "DecodeState DeviceDraft Draft Drafter NoDrafter StaticDraft StaticDrafting choose_token "
        "draft_autoregressively draft_chain_on_device".split(),
        ".base",
    ),
    "DraftModelDrafter": ".draft_model",
    "EagleDrafter": ".eagle.drafter",
    "EarlyExitDrafter": ".early_exit",
    **dict.fromkeys(["HybridDrafter", "graft"], ".hybrid"),
    **dict.fromkeys(["LayerSkipDrafter", "contiguous_runs", "default_skip_layers"], ".layer_skip"),
    **dict.fromkeys(["MedusaDrafter", "MedusaHeads"], ".medusa.drafter"),
    **dict.fromkeys(["NgramIndex", "PromptLookupDrafter"], ".prompt_lookup"),
}


def __getattr__(name: str) -> Any:
    """A drafter class or helper, imported on first use with the built-in drafters (torch)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from .registry import load_builtins

    load_builtins()
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "PLAIN",
    "BenchContext",
    "BenchRow",
    "DecodeState",
    "DeviceDraft",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "DrafterBench",
    "DrafterCalibration",
    "DrafterFactory",
    "DrafterOption",
    "DrafterSpec",
    "EagleDrafter",
    "EarlyExitDrafter",
    "HybridDrafter",
    "LayerSkipDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "NgramIndex",
    "NoDrafter",
    "OptionSpec",
    "PromptLookupDrafter",
    "StaticDraft",
    "StaticDrafting",
    "choose_token",
    "contiguous_runs",
    "default_skip_layers",
    "draft_autoregressively",
    "draft_chain_on_device",
    "drafter_spec",
    "graft",
    "list_drafters",
    "register_drafter",
    "sampled",
    "unregister_drafter",
]
