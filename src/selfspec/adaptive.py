"""Adaptive drafting: the draft length follows acceptance; slow speculation pauses itself.

The draft length grows while drafts are fully accepted and shrinks when most are rejected,
and speculation switches itself off while it is measured to be slower than plain decoding.

Used when ``num_draft_tokens="auto"``. It changes only how many tokens are drafted, never
which tokens are emitted, so the text is the same as with any fixed draft length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: How often (in rounds) plain decoding is re-measured while speculating.
PROBE_EVERY = 64
#: Rounds of plain decoding after speculation was found slower, before trying it again.
FALLBACK_ROUNDS = 32
#: Speculative rounds whose total time and tokens judge speculation (a window, not one round:
#: single rounds swing between all-accepted and all-rejected).
WINDOW = 16
#: Weight of the newest plain-step measurement in its running mean.
SMOOTHING = 0.15
#: Speculation must be this much slower per token than plain decoding before it is paused.
MARGIN = 1.05


@dataclass
class DraftController:
    """Chooses each round's draft length.

    Args:
        num_draft_tokens: the starting (calibrated) draft length.
        adaptive: ``False`` fixes the length: no adaptation and no fallback.
        max_draft_tokens: the longest draft an adaptive controller tries.
        timed: whether measured step times may switch speculation off. A sampling run uses
            an untimed controller of its own, so that a seed always gives the same text
            (timing is not reproducible, and the random stream depends on the draft lengths).
    """

    num_draft_tokens: int
    adaptive: bool = False
    max_draft_tokens: int = 8
    timed: bool = True

    def __post_init__(self) -> None:
        self.current = self.num_draft_tokens
        self.max_draft_tokens = max(self.max_draft_tokens, self.num_draft_tokens)
        self.spec_window: deque[tuple[float, int]] = deque(maxlen=WINDOW)  # (seconds, tokens)
        self.plain_seconds_per_token: float | None = None
        self.rounds = 0
        self.fallback_left = 0
        self.fallbacks = 0

    def budget(self) -> int:
        """Draft tokens to propose this round (0 means a plain decoding step)."""
        if not self.adaptive:
            return self.num_draft_tokens
        if not self.timed:
            return self.current
        if self.fallback_left > 0:
            return 0
        if self.plain_seconds_per_token is None or self.rounds % PROBE_EVERY == PROBE_EVERY - 1:
            return 0  # measure a plain step now and then
        return self.current

    def record(self, num_drafted: int, num_accepted: int, emitted: int, seconds: float) -> None:
        """Learn from a finished round: adapt the length, and fall back if speculation is slower."""
        if not self.adaptive or emitted <= 0:
            return
        self.rounds += 1
        if num_drafted == 0:
            self.plain_seconds_per_token = _mean(self.plain_seconds_per_token, seconds / emitted)
            if self.fallback_left > 0:
                self.fallback_left -= 1
            return
        if num_accepted == num_drafted:
            self.current = min(self.current + 1, self.max_draft_tokens)
        elif num_accepted < num_drafted // 2:
            self.current = max(self.current - 1, 1)
        if not self.timed:
            return
        self.spec_window.append((seconds, emitted))
        plain = self.plain_seconds_per_token
        if plain is None or len(self.spec_window) < WINDOW:
            return
        spec = sum(s for s, _ in self.spec_window) / sum(n for _, n in self.spec_window)
        if spec > plain * MARGIN:
            self.fallback_left = FALLBACK_ROUNDS
            self.fallbacks += 1
            self.spec_window.clear()  # judge speculation afresh after the pause
            self.current = self.num_draft_tokens

    @property
    def spec_seconds_per_token(self) -> float | None:
        """Mean seconds per emitted token over the recent speculative rounds."""
        tokens = sum(n for _, n in self.spec_window)
        return sum(s for s, _ in self.spec_window) / tokens if tokens else None

    def for_sampling(self) -> DraftController:
        """A fresh, untimed controller for one sampled generation (reproducible per seed)."""
        return DraftController(self.num_draft_tokens, self.adaptive, self.max_draft_tokens, timed=False)

    def __repr__(self) -> str:
        return (
            f"DraftController(num_draft_tokens={self.num_draft_tokens}, adaptive={self.adaptive}, "
            f"current={self.current}, fallbacks={self.fallbacks})"
        )


def _mean(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
