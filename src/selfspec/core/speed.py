"""The speed model: what a round costs and what it is expected to give, in plain decoding steps.

One place for the maths every planner uses (Leviathan et al. 2023, Chen et al. 2023): with
per-token acceptance ``a`` a chain of ``k`` drafts yields :func:`expected_tokens`
``(1 - a^(k+1)) / (1 - a)`` tokens (the bonus token included) for :meth:`CostModel.round_cost`
``k c + v_k`` step-costs (``c``: one draft token, ``v_k``: verifying ``k + 1`` tokens, both
relative to one plain step). Calibration chooses plans with it, the online controller judges
rounds with it, and gated drafters decide token by token with :func:`worth_drafting`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def expected_tokens(acceptance: float, num_draft: int) -> float:
    """Expected tokens from a round of ``num_draft`` drafts, each accepted with probability ``acceptance``.

    ``(1 - a^(k+1)) / (1 - a)``: the accepted prefix plus the corrected or bonus token.
    """
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (num_draft + 1)) / (1 - a)


@dataclass(frozen=True)
class CostModel:
    """Calibrated costs, relative to one plain decoding step (one token through every layer).

    Attributes:
        draft: cost of drafting one token (0 for prompt lookup).
        verify: cost of verifying ``k`` drafts (``k + 1`` tokens) by ``k``; missing lengths are
            extrapolated linearly from the longest measured one.
    """

    draft: float
    verify: dict[int, float] = field(default_factory=dict)

    def round_cost(self, num_drafted: int) -> float:
        """Predicted cost of a round that drafted ``num_drafted`` tokens."""
        if num_drafted <= 0:
            return 1.0
        verify = self.verify
        if num_drafted in verify:
            v = verify[num_drafted]
        elif verify:
            top = max(verify)
            slope = (verify[top] - 1.0) / top if top else 0.0
            v = verify[top] + slope * (num_drafted - top)
        else:
            v = 1.0
        return self.draft * num_drafted + v

    @classmethod
    def from_json(cls, data: Any) -> CostModel | None:
        """Read ``{"draft": c, "verify": {"k": v}}`` (as saved in ``selfspec.json``); ``None`` if malformed."""
        if not isinstance(data, dict):
            return None
        try:
            verify = {int(k): float(v) for k, v in dict(data.get("verify") or {}).items()}
            return cls(float(data.get("draft", 0.0)), verify)
        except (TypeError, ValueError):
            return None


def worth_drafting(reach: float, expected: float, drafted: int, round_cost: Callable[[int], float]) -> bool:
    """Whether drafting one more token raises a round's expected tokens per unit of cost.

    The round has drafted ``drafted`` tokens, expects ``expected`` tokens from them (the bonus
    token included) and would reach the next one with probability ``reach``. The token is worth
    drafting when its marginal rate beats the round's average rate so far:
    ``reach / (C(n + 1) - C(n)) >= expected / C(n)`` with ``C = round_cost``.
    """
    before, after = round_cost(drafted), round_cost(drafted + 1)
    return reach * before >= (after - before) * expected


