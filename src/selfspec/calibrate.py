"""Calibration (moved to :mod:`selfspec.calibration`; these names stay importable from here)."""

from .calibration.measure import (
    DEFAULT_CALIBRATION_PROMPTS,
    TREE_CANDIDATES,
    TREE_MARGIN,
    CalibrationResult,
    calibrate,
    choose,
    choose_plan,
    choose_tree_nodes,
    default_prompts,
    expected_speedup,
    measure_agreement,
    measure_costs,
    measure_tree_speed,
    replay,
    search_skip_layers,
)

__all__ = [
    "DEFAULT_CALIBRATION_PROMPTS",
    "TREE_CANDIDATES",
    "TREE_MARGIN",
    "CalibrationResult",
    "calibrate",
    "choose",
    "choose_plan",
    "choose_tree_nodes",
    "default_prompts",
    "expected_speedup",
    "measure_agreement",
    "measure_costs",
    "measure_tree_speed",
    "replay",
    "search_skip_layers",
]
