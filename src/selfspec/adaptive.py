"""The online guard (moved to :mod:`selfspec.calibration.guard`; these names stay importable from here)."""

from .calibration.guard import (
    FALLBACK_ROUNDS,
    MARGIN,
    MAX_FALLBACK_ROUNDS,
    PROBE_EVERY,
    SMOOTHING,
    WINDOW,
    CostModel,
    DraftController,
)

__all__ = [
    "FALLBACK_ROUNDS",
    "MARGIN",
    "MAX_FALLBACK_ROUNDS",
    "PROBE_EVERY",
    "SMOOTHING",
    "WINDOW",
    "CostModel",
    "DraftController",
]
