"""Result types shared by the engine, the CLI, the benchmark and the adapters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class GenerationStats:
    """What one generation cost and how well speculation worked.

    Every part of selfspec (CLI, benchmark, adapters) reports these same names.

    Attributes:
        target_forwards: forward passes of the full target model (the prefill included).
        num_drafted: draft tokens proposed.
        num_accepted: draft tokens the target accepted.
        mean_accepted_length: tau, tokens emitted per verify step after the prefill,
            counting the recovered or bonus token (plain decoding: 1.0).
        acceptance_rate: ``num_accepted / num_drafted`` (0.0 when nothing was drafted).
        accepted_length_histogram: entry ``i`` counts the verify steps that accepted ``i``
            draft tokens.
        draft_seconds: wall time spent drafting.
        verify_seconds: wall time spent in target forwards (the prefill included).
        tokens_per_second: new tokens per second of the whole generation.
    """

    target_forwards: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    mean_accepted_length: float = 0.0
    acceptance_rate: float = 0.0
    accepted_length_histogram: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    tokens_per_second: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The stats as a plain dict (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token, and of its most likely alternatives.

    The values are the target model's own distribution at that position,
    ``log_softmax(logits)`` of the verify forward that emitted the token: before temperature,
    top-k, top-p and a grammar's mask (as OpenAI reports them), so they do not change with the
    sampling settings (``docs/serving.md``).

    Attributes:
        token_id: the generated token.
        logprob: its log-probability.
        top_token_ids: the most likely tokens at that position, most likely first (as many as
            the call's ``logprobs`` asked for; the generated token may or may not be among them).
        top_logprobs: their log-probabilities, in the same order.
    """

    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class GenerationOutput:
    """The result of :meth:`SpeculativeEngine.generate`.

    Attributes:
        text: the generated text without the prompt or a matched stop string
            (``None`` when the engine has no tokenizer).
        token_ids: the new token ids only (an end-of-sequence token included when one ended
            the generation, as in transformers' ``generate``).
        finish_reason: ``"stop"`` (end-of-sequence token or stop string), ``"length"``
            (``max_new_tokens`` reached) or ``"cancelled"``.
        stats: speculation statistics.
        prompt_tokens: number of prompt tokens.
        logprobs: with ``logprobs=N``, one :class:`TokenLogprob` per token of ``token_ids``
            (else ``None``).
    """

    text: str | None
    token_ids: list[int]
    finish_reason: FinishReason
    stats: GenerationStats
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
