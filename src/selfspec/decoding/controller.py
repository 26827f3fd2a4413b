"""The online guard: the draft length follows acceptance; speculation that does not pay pauses.

Used when ``num_draft_tokens="auto"``. It changes only how many tokens are drafted, never
which tokens are emitted, so greedy text is the same as with any fixed draft length and
sampled text follows the model's distribution exactly.

- The draft length doubles while drafts are fully accepted (up to the longest length whose verify
  cost was measured, and only where the calibrated verify curve and the running acceptance say
  the longer draft pays) and drops to what was accepted plus one when most are rejected
  (:func:`~selfspec.core.speed.next_draft_length`); each call starts from the calibrated length.
- **Timed** (greedy calls, sharing the engine's controller): plain decoding is measured now and
  then; when a window of speculative rounds is slower per token than plain decoding, the
  controller decodes plainly for :data:`FALLBACK_ROUNDS` rounds, then probes speculation again.
  Each failed probe doubles the pause (up to :data:`MAX_FALLBACK_ROUNDS`); a probe that pays
  resets it. A window in which not one draft token was accepted pauses for
  :data:`MAX_FALLBACK_ROUNDS` at once: drafts that never land (a stock model's early exit, sampled
  drafts far from the target) stop after one short probe. That pause carries over from one call
  to the next (the controller is the engine's); a pause for drafts that landed but did not pay
  ends with its call, since the next call's text may copy (a chat answer's pause must not keep a
  following RAG answer from its copies), while the longer next pause (the doubling) carries over.
- **Untimed** (sampling: a fresh controller per call, so a seed always gives the same text): the
  same rule on *predicted* time, from the measured acceptance of this call and the calibrated
  costs (``costs``: draft cost per token and verify cost per draft length, relative to one plain
  step). Acceptance depends only on the seed, so the decisions, and the text, are reproducible.
- **Sampled plan** (``drafter="auto"``): calibration also replays the plan on the model's own
  sampled continuations (rejection sampling at :data:`~selfspec.calibration.measure.SAMPLED_TEMPERATURE`);
  where sampled drafts do not pay, the sampling controller (:meth:`DraftController.for_sampling`)
  drafts nothing at all (``sampling_drafts=False``): plain decoding, the same distribution.

Why the guard did not rescue SmolLM2 before (issue 16): it judged a window of 16 speculative
rounds, paused 32 rounds, then cleared its window and needed 16 slow rounds again: about a third
of all rounds ran at speculative pace (0.5x) whatever it learned, so it lost 23%; and sampling
calls used an untimed controller that never paused at all.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..core.speed import AcceptanceEstimate, CostModel, next_draft_length

#: How often (in rounds) plain decoding is re-measured while speculating.
PROBE_EVERY = 64
#: Rounds of plain decoding after speculation was first found slower, before trying it again.
FALLBACK_ROUNDS = 32
#: The longest pause: each failed probe doubles the pause up to this many rounds.
MAX_FALLBACK_ROUNDS = 1024
#: Speculative rounds whose total time (or predicted cost) and tokens judge speculation (a
#: window, not one round: single rounds swing between all-accepted and all-rejected).
WINDOW = 8
#: Weight of the newest plain-step measurement in its running mean.
SMOOTHING = 0.15
#: Speculation must be this much slower per token than plain decoding before it is paused.
MARGIN = 1.05


@dataclass
class DraftController:
    """Chooses each round's draft length, and pauses speculation while it does not pay.

    Args:
        num_draft_tokens: the starting (calibrated) draft length.
        adaptive: ``False`` fixes the length: no adaptation and no fallback.
        max_draft_tokens: the longest draft an adaptive controller tries (raised to the longest
            length of the calibrated verify curve, up to 32).
        timed: whether measured step times judge speculation. A sampling run uses an untimed
            controller of its own (see the module docstring), judged on predicted costs.
        costs: the calibrated :class:`CostModel` (or its JSON form); without it an untimed
            controller adapts the length only.
        sampling_drafts: ``False`` when calibration found that sampled drafts do not pay (the
            plan's sampled replay): the sampling controllers decode plainly.
        sampled_costs: the costs of rounds that read every logit, for the sampling controllers
            (``None``: ``costs``); greedy rounds may cost less (:mod:`selfspec.modeling.argmax_head`).
    """

    num_draft_tokens: int
    adaptive: bool = False
    max_draft_tokens: int = 8
    timed: bool = True
    costs: CostModel | dict[str, Any] | None = None
    sampling_drafts: bool = True
    sampled_costs: CostModel | None = None

    def __post_init__(self) -> None:
        if isinstance(self.costs, dict):
            self.sampled_costs = self.sampled_costs or CostModel.from_json(self.costs, sampled=True)
            self.costs = CostModel.from_json(self.costs)
        self.current = self.num_draft_tokens
        longest = self.costs.longest if isinstance(self.costs, CostModel) else 0
        self.max_draft_tokens = max(self.max_draft_tokens, self.num_draft_tokens, longest)
        self.spec_window: deque[tuple[float, int]] = deque(maxlen=WINDOW)  # (seconds or cost, tokens)
        self.plain_seconds_per_token: float | None = None
        self.rounds = 0
        self.fallback_left = 0
        self.fallbacks = 0
        self.pause = FALLBACK_ROUNDS
        self.landed_none = False  # the current pause is for drafts that never landed
        self.acceptance = AcceptanceEstimate()

    @property
    def guarded(self) -> bool:
        """Whether this controller can pause speculation (timed, or untimed with costs)."""
        return self.adaptive and (self.timed or self.costs is not None)

    def budget(self) -> int:
        """Draft tokens to propose this round (0 means a plain decoding step)."""
        if not self.adaptive:
            return self.num_draft_tokens
        if self.fallback_left > 0:
            return 0
        if not self.timed:
            return self.current
        if self.plain_seconds_per_token is None or self.rounds % PROBE_EVERY == PROBE_EVERY - 1:
            return 0  # measure a plain step now and then
        return self.current

    def record(self, num_drafted: int, num_accepted: int, emitted: int, seconds: float) -> None:
        """Learn from a finished round: adapt the length, and pause if speculation does not pay."""
        if not self.adaptive or emitted <= 0:
            return
        self.rounds += 1
        if num_drafted == 0:
            if self.timed:
                self.plain_seconds_per_token = _mean(self.plain_seconds_per_token, seconds / emitted)
            if self.fallback_left > 0:
                self.fallback_left -= 1
            return
        costs = self.costs if isinstance(self.costs, CostModel) else None
        self.acceptance.update(num_drafted, num_accepted)
        self.current = next_draft_length(
            self.current, num_drafted, num_accepted, self.max_draft_tokens, costs, self.acceptance.rate
        )
        if self.timed:
            self.spec_window.append((seconds, emitted))
            plain = self.plain_seconds_per_token
        elif isinstance(self.costs, CostModel):
            self.spec_window.append((self.costs.round_cost(num_drafted), emitted))
            plain = 1.0  # costs are relative to one plain step
        else:
            return
        if plain is None or len(self.spec_window) < WINDOW:
            return
        spec = sum(s for s, _ in self.spec_window) / sum(n for _, n in self.spec_window)
        if spec > plain * MARGIN:
            self.landed_none = not any(n > 1 for _, n in self.spec_window)
            if self.landed_none:  # not one draft landed: a long pause at once
                self.pause = MAX_FALLBACK_ROUNDS
            self.fallback_left = self.pause
            self.fallbacks += 1
            self.pause = min(2 * self.pause, MAX_FALLBACK_ROUNDS)  # the next failed probe waits longer
            self.spec_window.clear()  # judge speculation afresh after the pause
            self.current = self.num_draft_tokens
        elif spec * MARGIN < plain:
            self.pause = FALLBACK_ROUNDS  # speculation pays again

    def start_call(self) -> None:
        """A new generation starts from the calibrated length and a fresh acceptance estimate.

        The plain-step timing carries over (it describes the machine), and so does a pause for
        drafts that never landed (they describe the drafter) and the length of the next pause; the
        draft length, the acceptance and a pause for drafts that landed but did not pay describe
        the last call's text (a long copy in a RAG answer must not make the next call's first draft
        32 tokens long; a chat answer's pause must not keep the next answer from its copies).
        """
        self.current = self.num_draft_tokens
        self.acceptance = AcceptanceEstimate()
        if self.fallback_left > 0 and not self.landed_none:  # that text did not pay; this one may
            self.fallback_left = 0
            self.spec_window.clear()

    @property
    def spec_seconds_per_token(self) -> float | None:
        """Mean seconds (untimed: predicted cost) per emitted token over the recent speculative rounds."""
        tokens = sum(n for _, n in self.spec_window)
        return sum(s for s, _ in self.spec_window) / tokens if tokens else None

    def for_sampling(self) -> DraftController:
        """A fresh, untimed controller for one sampled generation (reproducible per seed).

        When calibration found that sampled drafts do not pay (``sampling_drafts=False``), it
        drafts nothing: a fixed draft length of 0.
        """
        if not self.sampling_drafts:
            return DraftController(0, adaptive=False, timed=False)
        costs = self.sampled_costs if self.sampled_costs is not None else self.costs
        return DraftController(self.num_draft_tokens, self.adaptive, self.max_draft_tokens, timed=False, costs=costs)

    def __repr__(self) -> str:
        return (
            f"DraftController(num_draft_tokens={self.num_draft_tokens}, adaptive={self.adaptive}, "
            f"current={self.current}, fallbacks={self.fallbacks})"
        )


def _mean(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
