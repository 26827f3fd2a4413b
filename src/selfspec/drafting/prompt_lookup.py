"""Prompt lookup: draft by copying the text's last n-gram's earlier continuation.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): free drafts
that are often right when the answer copies its context (RAG, summaries, edits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ..core.speed import CostModel
from .base import DecodeState, Draft, Drafter, StaticDraft, StaticDrafting
from .planning import (
    BenchContext,
    BenchRow,
    CalibrationContext,
    Candidate,
    DrafterBench,
    DrafterCalibration,
    DrafterFactory,
)
from .registry import register_drafter

if TYPE_CHECKING:
    from ..modeling.static_step import StaticStep


class NgramIndex:
    """The most recent continuation of every n-gram of a growing token list.

    Updated incrementally (only new tokens are indexed), so a lookup costs O(1) per round
    however long the prompt is.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.continuation: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are indexed

    def update(self, token_ids: list[int]) -> None:
        """Index the n-grams that end before the last token (their continuation exists)."""
        for end in range(self.indexed, len(token_ids) - 1):
            for n in range(1, self.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.continuation[tuple(token_ids[end - n + 1 : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(token_ids) - 1)

    def lookup(self, token_ids: list[int], min_ngram: int, max_tokens: int) -> list[int]:
        """Tokens that followed the longest earlier match of the text's last n-gram."""
        for n in range(min(self.max_ngram, len(token_ids)), min_ngram - 1, -1):
            start = self.continuation.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + max_tokens]
        return []


class PromptLookupDrafter(Drafter):
    """Drafts by copying: finds the text's last n-gram earlier in the prompt or output.

    Deterministic, so verification is by exact match (greedy) or one-hot rejection sampling.
    Reads only the token history, so its rows batch (drafted one by one, verified together).

    Args:
        max_ngram: longest n-gram to match.
        min_ngram: shortest n-gram that counts as a match.
    """

    name = "prompt_lookup"
    chain_only = True
    can_batch = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def __repr__(self) -> str:
        return f"PromptLookupDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def lookup(self, state: DecodeState, max_tokens: int) -> list[int]:
        """The copied continuation, or ``[]`` when the last n-gram occurs nowhere earlier."""
        index = state.memory(self, lambda: NgramIndex(self.max_ngram))
        index.update(state.token_ids)
        return index.lookup(state.token_ids, self.min_ngram, max_tokens)

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Copy up to ``max_tokens`` tokens after the latest match."""
        return Draft(tokens=self.lookup(state, max_tokens)) if max_tokens > 0 else Draft()

    @property
    def static_drafting(self) -> StaticDrafting:
        """Copies are host chains: the static round sends each to the device in one copy."""
        return StaticDrafting.HOST

    def draft_static(self, state: DecodeState, budget: int, step: StaticStep, bucket: int) -> StaticDraft:
        """The copied continuation (at most ``budget`` tokens), drafted on the host from the token history."""
        return StaticDraft(host=self.propose(state, budget))


def make_prompt_lookup(engine: Any, **options: Any) -> PromptLookupDrafter:
    """A prompt-lookup drafter (``options``: ``max_ngram``, ``min_ngram``)."""
    return PromptLookupDrafter(**options)


class LookupCalibration(DrafterCalibration):
    """Copies cost nothing to draft: the shortest n-gram and draft length that replay fastest.

    It is also ``drafter="auto"``'s plan before anything was measured (``fallback_settings``).
    """

    fallback_settings: ClassVar[dict[str, Any] | None] = {"num_draft_tokens": 4, "min_ngram": 2}

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best ``min_ngram`` (1 or 2) and starting draft length (copies grow where they land)."""
        best = (2, 4, 0.0)
        for min_ngram in (1, 2):
            for k in context.lengths:
                speed = context.replay(CostModel(0.0, context.verify_cost), k, lookup=(min_ngram, 3)).speedup
                if speed > best[2]:
                    best = (min_ngram, k, speed)
        min_ngram, k, speed = best
        settings = {"num_draft_tokens": k, "min_ngram": min_ngram}
        return [Candidate(name, settings, speed, f"{name}(min_ngram={min_ngram})", 0.0)]

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """The shortest n-gram copied after."""
        return f"prompt lookup (min_ngram={settings.get('min_ngram', 2)}), plain steps where nothing repeats"

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """A lookup drafter with the plan's ``min_ngram`` (and the engine's drafter options)."""
        return PromptLookupDrafter(min_ngram=int(settings.get("min_ngram", 2)), **options)


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    engine = context.engine(drafter=name, num_draft_tokens="auto")
    return [BenchRow(f"selfspec_{name}", engine, "prompt lookup alone; adaptive length", name)]


register_drafter(
    "prompt_lookup",
    make_prompt_lookup,
    description="copy n-grams from the prompt and output",
    calibration=LookupCalibration(),
    bench=DrafterBench(_rows, {"prompt_lookup": "selfspec_prompt_lookup: n-gram lookup in the prompt and output"}),
)
