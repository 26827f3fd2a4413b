"""Which path a generation's rounds take: the batching scheduler, the static round, or the eager loop.

A call joins the batching scheduler when it can batch (``batching=True``); else it runs in the
static round when the engine has one and the call fits it (``compile=``); else in the eager loop
(:func:`~selfspec.decoding.loop.decode`) on the engine's pooled KV cache, sized for the call.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Protocol

from ..core.speed import CostModel
from ..drafting import Drafter
from ..modeling.cache import CachePool
from ..modeling.runner import ModelRunner
from .batching import BatchScheduler
from .generation import Generation
from .loop import decode
from .outputs import FinishReason
from .static_round import StaticRounds


class RoundsEngine(Protocol):
    """What :func:`run_rounds` reads of its engine (a :class:`~selfspec.SpeculativeEngine`)."""

    runner: ModelRunner
    eos_token_ids: frozenset[int]
    _lock: threading.RLock
    _caches: CachePool

    drafter: Drafter

    @property
    def tree_nodes(self) -> int | None:
        """The token-tree node budget, or ``None`` for chains."""

    @property
    def _batcher(self) -> BatchScheduler | None: ...
    @property
    def _static(self) -> StaticRounds | None: ...


def run_rounds(engine: RoundsEngine, run: Generation) -> Generator[list[int], None, FinishReason]:
    """Decode ``run`` (alone, or in the batching scheduler when it can batch), yielding each round's tokens.

    All state lives in ``run``: calls from several threads each get the text they would get alone.
    """
    if engine._batcher is not None and engine._batcher.accepts(run):
        return (yield from engine._batcher.rounds(run))
    static = (
        engine._static.try_decode(engine.drafter, run, engine._lock, engine.eos_token_ids) if engine._static else None
    )
    if static is not None:  # the static round (compile=...): fixed shapes, one host read per round
        return (yield from static)
    # a tree drafter's nodes need slots beyond the text (a drafter may say how many)
    tree_slots = engine.tree_nodes or getattr(engine.drafter, "tree_nodes", None) or 0
    # a padded verify (CostModel.padded) needs at most the calibrated curve's longest length
    pad_slots = run.controller.costs.longest if isinstance(run.controller.costs, CostModel) else 0
    cache, pooled = engine._caches.take(len(run.prompt_ids) + run.max_new_tokens + max(tree_slots, pad_slots))
    failed = True
    try:
        finish = yield from decode(engine.runner, engine.drafter, run, cache, engine._lock, engine.eos_token_ids)
        failed = False
        return finish
    except GeneratorExit:  # an abandoned stream: its cache is sound
        failed = False
        raise
    finally:
        if pooled:
            engine._caches.give_back(keep=not failed)
