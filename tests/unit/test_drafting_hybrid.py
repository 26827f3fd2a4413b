"""The hybrid's cost model comes from the calibration: the early exit's draft cost at its layer and the verify curve."""

from __future__ import annotations

from selfspec.core.speed import CostModel
from selfspec.drafting.hybrid import hybrid_costs


def test_hybrid_costs_read_the_layer_draft_cost_and_the_verify_curve() -> None:
    calibration = {"draft_cost": {"2": 0.26, "3": 0.29}, "verify_cost": {"1": 1.43, "3": 1.32}}
    assert hybrid_costs(calibration, 3) == CostModel(0.29, {1: 1.43, 3: 1.32})


def test_hybrid_costs_are_none_without_a_usable_calibration() -> None:
    assert hybrid_costs(None, 2) is None
    assert hybrid_costs({"verify_cost": {"1": 1.4}}, 2) is None  # no draft cost measured
    assert hybrid_costs({"draft_cost": {"2": 0.26}, "verify_cost": {}}, 2) is None  # no curve
    assert hybrid_costs({"draft_cost": {"3": 0.29}, "verify_cost": {"1": 1.4}}, 2) is None  # another layer
