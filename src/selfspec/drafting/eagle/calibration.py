"""How calibration measures an EAGLE head and how ``drafter="auto"`` replays a planned one.

The head's chains are measured by decoding with them (:func:`measure_eagle`): a chain's later
tokens read the head's own predictions, so its acceptance is measured per round, not per
position. One measurement (saved as ``"eagle"`` in ``selfspec.json``) serves both
registrations: the head alone (``eagle``) and with prompt-lookup copies where the text repeats
(``eagle_hybrid``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...errors import ConfigurationError, ModelNotFoundError
from ..base import Drafter
from ..planning import (
    CalibrationContext,
    Candidate,
    DrafterCalibration,
    DrafterFactory,
    best_rounds_length,
    measure_rounds,
)
from .head import find_eagle_head, shipped_head_moved

logger = logging.getLogger(__name__)


def measure_eagle(
    engine: Any,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    step_seconds: float,
    head: Any = None,
    num_draft_tokens: int = 4,
) -> dict[str, Any]:
    """An EAGLE head's acceptance and draft cost on this model and hardware (empty: no head fits).

    Decodes each prompt greedily with the head's fixed-length chains (no confidence stop) and
    records how many tokens each full-length round accepted (for shorter drafts the greedy
    chain is a prefix, so it accepts ``min(n, k)``) and the drafting seconds per drafted token,
    relative to one plain step (``step_seconds``); the per-prompt median is kept.

    Args:
        engine: the calibrated engine (its model is only read).
        prompt_ids: the calibration prompts' ids.
        max_new_tokens: tokens generated per prompt.
        step_seconds: one plain step's seconds (:func:`selfspec.calibration.measure.measure_costs`).
        head: a head folder or loaded :class:`~selfspec.drafting.eagle.head.EagleHead`; ``None`` looks for one
            (:func:`~selfspec.drafting.eagle.head.find_eagle_head`).
        num_draft_tokens: the chains' length.
    """
    if head is None:
        found = find_eagle_head(engine.name_or_path, engine.runner.model) if engine.name_or_path else None
        if found is None:
            return {}
        head = str(found)
    engine_class = type(engine)  # sibling engines of the caller's class: drafting sits below decoding
    try:
        eagle = engine_class(
            engine.model,
            engine.tokenizer,
            drafter="eagle",
            eagle_head=head,
            num_draft_tokens=num_draft_tokens,
            calibration={},
        )
    except (ConfigurationError, ModelNotFoundError) as error:
        logger.warning("calibration skips the EAGLE head %s: %s", head, error)
        return {}
    figures = measure_rounds(eagle, prompt_ids, max_new_tokens, step_seconds)
    if not figures:
        return {}
    return {"head": head if isinstance(head, str) else getattr(head.head_config, "target", "a loaded head"), **figures}


class EagleCalibration(DrafterCalibration):
    """The head's measured chains, replayed at each draft length up to the measured one.

    ``calibrate(eagle_head=...)`` names the head to measure (a folder or a loaded head); ``None``
    measures the one :func:`~selfspec.drafting.eagle.head.find_eagle_head` finds, ``False`` none.

    Args:
        lookup: copy from the text where it repeats, the head elsewhere (``eagle_hybrid``).
    """

    figures_key = "eagle"
    options = ("eagle_head",)

    def __init__(self, lookup: bool = False) -> None:
        self.lookup = lookup

    def measure(self, name: str, context: CalibrationContext) -> dict[str, Any]:
        """:func:`measure_eagle` on the calibration prompts (empty: no head, or it does not fit)."""
        head = context.options.get("eagle_head")
        if head is False:
            return {}
        return measure_eagle(
            context.engine,
            context.prompt_ids,
            context.max_new_tokens,
            context.step_seconds,
            head=head,
            num_draft_tokens=min(4, context.max_draft_tokens),
        )

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best draft length, alone or with copies."""
        if not figures or not figures.get("accepted_per_round"):
            return []
        speed, k = best_rounds_length(context, figures, lookup=self.lookup)
        head = str(figures.get("head")) if figures.get("head") else None
        settings = {"num_draft_tokens": k, "min_ngram": 2, "eagle_head": head}
        return [Candidate(name, settings, speed, f"{name}(k={k})", float(figures["draft_cost"]))]

    def saved(self, figures: Any, candidates: list[Candidate]) -> dict[str, Any]:
        """``"eagle"``: the head, its draft cost, the accepted length of every round, its tau."""
        return {"eagle": figures or {}}

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """The head's draft length, and the copies."""
        what = f"EAGLE head, k={settings.get('num_draft_tokens', 4)}"
        return f"{what}, prompt-lookup copies where the text repeats" if self.lookup else what

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The registered drafter with the planned head (an error when it was removed or no longer fits).

        A shipped head is found where this installation keeps it, whichever folder the plan was saved with.
        """
        head = settings.get("eagle_head")
        moved = shipped_head_moved(head) if isinstance(head, str) else None
        drafter: Drafter = factory(engine, eagle_head=str(moved) if moved is not None else head)
        return drafter
