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

#: a longer verify must be predicted this much cheaper (relative) before :meth:`CostModel.padded` pads to it.
PAD_MARGIN = 0.05


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
        verify: cost of verifying ``k`` drafts (``k + 1`` tokens) by ``k``; a length between two
            measured ones is interpolated linearly, one past the longest extrapolated from it.
    """

    draft: float
    verify: dict[int, float] = field(default_factory=dict)

    def round_cost(self, num_drafted: int) -> float:
        """Predicted cost of a round that drafted ``num_drafted`` tokens."""
        if num_drafted <= 0:
            return 1.0
        return self.draft * num_drafted + self.verify_cost(num_drafted)

    def verify_cost(self, num_drafted: int) -> float:
        """Predicted cost of verifying ``num_drafted`` drafts (1.0 for none), padded as :meth:`padded` says."""
        return self._curve(self.padded(num_drafted))

    def padded(self, num_drafted: int) -> int:
        """How many drafts a verify of ``num_drafted`` runs as: the cheapest measured length at or above it.

        A wider verify can cost less than a narrower one: on the AMD EPYC measured here, fp32
        matmul kernels run 4 rows faster than 2 or 3 (SmolLM2: 3 drafts cost 1.51 plain steps, 1
        draft 1.64, 2 drafts 2.05). The loop then verifies the draft padded with filler rows it
        never reads. ``num_drafted`` itself unless a longer measured length is cheaper by
        :data:`PAD_MARGIN` (so that noise in the curve does not pad).
        """
        if num_drafted <= 0 or not self.verify:
            return num_drafted
        own = self._curve(num_drafted)
        wider = [k for k in sorted(self.verify) if k > num_drafted]
        best = min(wider, key=lambda k: self.verify[k], default=None)
        if best is not None and self.verify[best] < own * (1 - PAD_MARGIN):
            return best
        return num_drafted

    def _curve(self, num_drafted: int) -> float:
        """The measured cost of verifying ``num_drafted`` drafts, interpolated between measured lengths."""
        verify = self.verify
        if num_drafted <= 0 or not verify:
            return 1.0
        if num_drafted in verify:
            return verify[num_drafted]
        below = max((k for k in verify if k < num_drafted), default=0)
        above = min((k for k in verify if k > num_drafted), default=None)
        low = verify[below] if below else 1.0
        if above is None:  # past the longest measured length: its slope from a one-token step
            slope = (low - 1.0) / below
            return low + slope * (num_drafted - below)
        return low + (verify[above] - low) * (num_drafted - below) / (above - below)

    @property
    def longest(self) -> int:
        """The longest measured draft length (0 without a curve)."""
        return max(self.verify, default=0)

    @classmethod
    def from_json(cls, data: Any, sampled: bool = False) -> CostModel | None:
        """Read ``{"draft": c, "verify": {"k": v}}`` (as saved in ``selfspec.json``); ``None`` if malformed.

        ``sampled``: the curve of rounds that read every logit, ``"verify_sampled"``, where the
        file has one (greedy rounds then cost less: :mod:`selfspec.modeling.argmax_head`).
        """
        if not isinstance(data, dict):
            return None
        try:
            curve = data.get("verify_sampled") if sampled and data.get("verify_sampled") else data.get("verify")
            verify = {int(k): float(v) for k, v in dict(curve or {}).items()}
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


@dataclass
class AcceptanceEstimate:
    """A running estimate of the per-token acceptance rate, from whole rounds.

    Each drafted token up to the first rejection is a Bernoulli trial: a round that accepted
    ``n`` of ``k`` drafts gives ``n`` successes, and one failure when ``n < k``. The rate is
    successes over trials, both decayed by ``decay`` per round so that it follows the text (a
    copied passage, then free prose). ``None`` until a round was drafted.
    """

    decay: float = 0.8
    successes: float = 0.0
    failures: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a round that drafted ``drafted`` tokens and had ``accepted`` accepted."""
        if drafted <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float | None:
        """The estimated per-token acceptance, ``None`` before any drafted round."""
        trials = self.successes + self.failures
        return self.successes / trials if trials > 0 else None


def _rate(length: int, costs: CostModel, acceptance: float | None) -> float:
    """Expected tokens per unit of cost of a ``length``-token draft (every draft accepted without ``acceptance``)."""
    tokens = length + 1 if acceptance is None else expected_tokens(acceptance, length)
    return tokens / costs.round_cost(length)


def next_draft_length(
    current: int,
    drafted: int,
    accepted: int,
    longest: int,
    costs: CostModel | None = None,
    acceptance: float | None = None,
) -> int:
    """The draft length after a round that drafted ``drafted`` tokens and had ``accepted`` accepted.

    A fully accepted draft doubles the length (up to ``longest``), so long copies reach the
    lengths where a flat verify curve pays within a few rounds, but only where the longer draft
    is expected to emit more per unit of cost on the measured curve (``costs``; always without
    one): with the running per-token ``acceptance`` (:class:`AcceptanceEstimate`) when given, else
    as if fully accepted. A draft mostly rejected drops to what was accepted plus one (at most
    half the length, at least 1): the copy or the chain diverged there. The calibration replay and
    the online controller both follow this rule.
    """
    if drafted <= 0:
        return current
    if accepted == drafted:
        longer = min(max(2 * current, current + 1), longest)
        if costs is None or not costs.verify:
            return max(longer, current)
        while longer > current:
            if _rate(longer, costs, acceptance) > _rate(current, costs, acceptance):
                return longer
            longer = current + (longer - current) // 2
        return current
    if accepted < drafted // 2:
        return max(1, min(current // 2, accepted + 1))
    return current
