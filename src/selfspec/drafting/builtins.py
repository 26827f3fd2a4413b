"""The built-in drafters, each registering itself in this order (:func:`~selfspec.drafting.registry.load_builtins`).

Imported (with torch) the first time the registry is read, not when :mod:`selfspec.drafting` is:
the command line and the adapters read drafter names and options without torch.
"""

from typing import Any

from .base import Drafter, NoDrafter
from .planning import PLAIN, BenchContext, BenchRow, DrafterBench, DrafterCalibration, DrafterFactory, sampled
from .registry import register_drafter

from .early_exit import EarlyExitDrafter  # noqa: F401  # isort: skip
from .prompt_lookup import PromptLookupDrafter  # noqa: F401  # isort: skip
from .hybrid import HybridDrafter  # noqa: F401  # isort: skip
from .layer_skip import LayerSkipDrafter  # noqa: F401  # isort: skip
from .draft_model import DraftModelDrafter  # noqa: F401  # isort: skip
from .medusa.drafter import MedusaDrafter  # noqa: F401  # isort: skip
from .eagle.drafter import EagleDrafter  # noqa: F401  # isort: skip


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
