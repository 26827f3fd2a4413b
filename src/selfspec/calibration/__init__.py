"""Calibration: measure the candidates on this model and hardware, choose a plan, save it.

- :mod:`.store`: where ``selfspec.json`` lives, its version and the machine it was measured on;
- :mod:`.measure`: :func:`calibrate`, which measures every candidate method and picks the plan;
- :mod:`.bench`: ``selfspec bench``, methods side by side.

The plan itself (:class:`~selfspec.drafting.auto.Plan`) and the ``drafter="auto"`` that runs it
live in :mod:`selfspec.drafting.auto`; the online guard in :mod:`selfspec.decoding.controller`;
the speed model in :mod:`selfspec.core.speed`. Their main names are re-exported here.
"""

from .store import (  # isort: skip
    CALIBRATION_FILE,
    CALIBRATION_VERSION,
    calibration_path,
    load_calibration,
    machine_fingerprint,
    save_calibration,
)
from ..artifacts import cache_dir  # isort: skip
from ..core.speed import CostModel  # isort: skip
from ..decoding.controller import DraftController  # isort: skip
from ..drafting.auto import PLAIN_MARGIN, Plan, plan_methods, plan_of  # isort: skip  (registers drafter="auto")
from .measure import (  # isort: skip
    DEFAULT_CALIBRATION_PROMPTS,
    TREE_CANDIDATES,
    CalibrationResult,
    calibrate,
    calibrate_on_first_load,
    choose,
    choose_plan,
    choose_tree_nodes,
    expected_speedup,
    measure_agreement,
    measure_costs,
    replay,
)


__all__ = [
    "CALIBRATION_FILE",
    "CALIBRATION_VERSION",
    "DEFAULT_CALIBRATION_PROMPTS",
    "PLAIN_MARGIN",
    "TREE_CANDIDATES",
    "CalibrationResult",
    "CostModel",
    "DraftController",
    "Plan",
    "cache_dir",
    "calibrate",
    "calibrate_on_first_load",
    "calibration_path",
    "choose",
    "choose_plan",
    "choose_tree_nodes",
    "expected_speedup",
    "load_calibration",
    "machine_fingerprint",
    "measure_agreement",
    "measure_costs",
    "plan_methods",
    "plan_of",
    "replay",
    "save_calibration",
]
