"""Drafters: propose tokens for the target to verify; a drafter never decides.

:mod:`.base` holds the contract (:class:`Drafter`, :class:`Draft`, :class:`DecodeState`),
:mod:`.registry` the names ``drafter=`` accepts, and each other module one drafter, which
registers itself. Importing this package registers the built-in drafters.
"""

from typing import Any

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
from .planning import PLAIN, BenchContext, BenchRow, DrafterBench, DrafterCalibration, DrafterFactory, sampled
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


class _PlainCalibration(DrafterCalibration):
    """Plain decoding, the plan when no candidate beats it (calibration adds it at 1.0 itself)."""

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        return "plain decoding"

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        return NoDrafter()


def _plain_rows(name: str, context: BenchContext) -> list[BenchRow]:
    row = BenchRow("selfspec_plain", context.engine(drafter=name), "selfspec loop without drafts", "plain")
    return [row, *sampled(row, context.temperatures)]


register_drafter(
    PLAIN,
    _make_none,
    description="plain decoding (the baseline)",
    calibration=_PlainCalibration(),
    bench=DrafterBench(
        _plain_rows, {"plain": "selfspec_plain (+ _tT): selfspec's loop without drafts, greedy and at each temperature"}
    ),
)

from . import auto  # noqa: E402, F401  (registers "auto" last, whatever was imported first)

__all__ = [
    "DecodeState",
    "DeviceDraft",
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
    "unregister_drafter",
]
