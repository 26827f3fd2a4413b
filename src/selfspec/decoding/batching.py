"""The batching scheduler: admission, rows and a thread; the rounds themselves are :mod:`selfspec.decoding.loop`'s.

With ``SpeculativeEngine(..., batching=True)`` every generation that can be batched is handed
to a :class:`BatchScheduler`: one background thread that runs rounds over all active
requests at once (``docs/batching.md``). Each round is :func:`selfspec.decoding.loop.run_round` over the
active rows: each row picks its own draft budget (its own controller), the drafter drafts all
rows (:meth:`~selfspec.drafting.Drafter.propose_batch`: the early exit runs layers ``[0, E)``
for every row in one call per draft step), the target scores every row's draft in one forward
(shorter drafts padded), and each row accepts and commits on its own.

Requests join between rounds (their prefill runs alone, into their row of the batched
cache) and leave when finished, cancelled or failed. A row's KV slot ``j`` always holds
position ``j``, so ragged lengths need no bookkeeping beyond one length per row: the mask of
row ``b`` lets the query at position ``p`` see slots ``<= p`` (and, in sliding-window layers,
``> p - window``). Slots beyond a row's length hold padding or rejected drafts; no query of
that row reads them before they are written again.

A generation runs alone (a batch of one, through the same loop) when its drafter cannot
batch (``Drafter.can_batch`` is false: token trees, layer skip, a draft model, Medusa, a
user's drafter that runs the model), when it has a grammar constraint, or when the model's
rotary embedding depends on the batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..drafting.base import Drafter
from ..modeling.cache import BatchedKVCache
from ..modeling.runner import ModelRunner
from .config import EngineConfig
from .controller import DraftController
from .generation import Generation
from .loop import Row, run_round, start_row
from .outputs import FinishReason

#: Rows decoded together at most; further requests wait until a row frees up.
DEFAULT_MAX_BATCH_SIZE = 32
#: Rotary scalings whose frequencies depend on the largest position in the forward (the whole
#: batch), so that one long row would change every row's text: such models run unbatched.
BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_depends_on_batch(config: Any) -> bool:
    """Whether the model's rotary embedding reads the batch's largest position (see above)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)] if isinstance(params, dict) else []
    kinds = {p.get("rope_type", p.get("type")) for p in [params, *nested] if isinstance(p, dict)}
    return bool(kinds & set(BATCH_DEPENDENT_ROPE))


class EngineParts(Protocol):
    """What the scheduler reads of its engine (a :class:`~selfspec.SpeculativeEngine`)."""

    runner: ModelRunner
    drafter: Drafter
    controller: DraftController
    eos_token_ids: frozenset[int]
    config: EngineConfig
    _lock: threading.RLock


@dataclass
class _Finished:
    reason: FinishReason


@dataclass
class _Submission:
    """One generation handed to the scheduler, and the queue its results come back on."""

    run: Generation
    results: queue.Queue[list[int] | _Finished | BaseException] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    row: Row | None = None  # set once admitted


class BatchScheduler:
    """Runs concurrent generations of one engine as a batch, round by round.

    Each call's generator (:meth:`rounds`) submits its generation and reads back the tokens
    of each round; a background thread admits new requests between rounds, runs one batched
    round over all active rows at a time (holding the engine's lock), and drops rows that
    finished, were cancelled (their stream closed) or failed. An error in one row is raised
    in that row's caller only; the others and the scheduler go on.

    Args:
        engine: the engine whose runner, drafter and lock are used.
        max_batch_size: the most rows decoded together.
    """

    def __init__(self, engine: EngineParts, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.max_batch_size = max_batch_size
        self.cache = BatchedKVCache(self.runner.num_layers)
        self.model_batches = not rope_depends_on_batch(self.runner.config)
        self.active: list[_Submission] = []
        self.rounds_run = 0  # batched rounds so far
        self.max_rows_seen = 0  # the largest batch a round has run
        self._pending: list[_Submission] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def rows(self) -> list[Row]:
        """The rows being decoded, in cache-row order."""
        return [s.row for s in self.active if s.row is not None]

    def __repr__(self) -> str:
        return (
            f"BatchScheduler(active={len(self.active)}, pending={len(self._pending)}, "
            f"max_batch_size={self.max_batch_size}, rounds_run={self.rounds_run})"
        )

    def accepts(self, run: Generation) -> bool:
        """Whether a generation runs batched (see the module docstring for when it runs alone)."""
        return self.model_batches and run.constraint is None and bool(self.engine.drafter.can_batch)

    # ------------------------------------------------------------- the caller's side
    def rounds(self, run: Generation) -> Generator[list[int], None, FinishReason]:
        """Submit ``run`` and yield the tokens of each of its rounds; return its finish reason.

        Closing the generator (a closed stream, a stop string) cancels the row: the scheduler
        drops it before its next round.
        """
        submission = _Submission(run)
        self._submit(submission)
        try:
            while True:
                item = submission.results.get()
                if isinstance(item, _Finished):
                    return item.reason
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            submission.cancelled.set()

    def _submit(self, submission: _Submission) -> None:
        with self._cond:
            self._pending.append(submission)
            if self._thread is None:
                # not a daemon: it lives only while there is work, and exits cleanly when idle
                self._thread = threading.Thread(target=self._loop, name="selfspec-batching")
                self._thread.start()

    # ------------------------------------------------------------- the scheduler thread
    def _loop(self) -> None:
        """Admit, run a round, drop finished rows; exit when there is nothing to do."""
        while True:
            with self._cond:
                if not self._pending and not self.active:
                    self._thread = None  # the next submission starts a new thread
                    self.cache = BatchedKVCache(self.runner.num_layers)  # free the buffers while idle
                    return
                free = self.max_batch_size - len(self.active)
                joining, self._pending = self._pending[:free], self._pending[free:]
            try:
                with torch.inference_mode():  # the cache buffers are inference tensors
                    for submission in joining:
                        self._admit(submission)
                    self._remove([s for s in self.active if s.cancelled.is_set()])
                    if self.active:
                        self._round()
            except Exception as error:  # noqa: BLE001 - a failed batched forward fails this round's rows only
                for submission in self.active:
                    submission.results.put(error)
                self.active.clear()

    def _admit(self, submission: _Submission) -> None:
        """Prefill a joining request alone (in its own cache row) and hand out its first token."""
        if submission.cancelled.is_set():
            return
        engine, run = self.engine, submission.run
        try:
            with engine._lock, torch.inference_mode():
                row = start_row(self.runner, engine.drafter, run, self.cache, engine.eos_token_ids, len(self.active))
        except Exception as error:  # noqa: BLE001 - this request fails; the batch goes on
            submission.results.put(error)
            return
        first = row.state.last_token
        submission.results.put([first])
        if first in engine.eos_token_ids:
            submission.results.put(_Finished("stop"))
        elif run.max_new_tokens <= 1:
            submission.results.put(_Finished("length"))
        else:
            # a fresh untimed controller per row: draft lengths follow acceptance, and a seed
            # gives the text it gives alone (timing is not reproducible)
            run.controller = engine.controller.for_sampling()
            submission.row = row
            self.active.append(submission)
            self.max_rows_seen = max(self.max_rows_seen, len(self.active))

    def _remove(self, leaving: list[_Submission]) -> None:
        """Drop rows; the last rows move into the freed slots so active rows stay contiguous."""
        for submission in leaving:
            index = next((i for i, s in enumerate(self.active) if s is submission), None)
            if index is None:
                continue
            last = len(self.active) - 1
            if index != last:
                self.cache.move_row(last, index)
                self.active[index] = self.active[last]
                moved = self.active[index].row
                assert moved is not None
                moved.state.row = index
            self.active.pop()

    def _round(self) -> None:
        """One round of :func:`selfspec.decoding.loop.run_round` for every active row; hand out the results."""
        engine = self.engine
        rows = self.rows
        # a round lasts as long as its longest draft, and padding costs compute in a batch:
        # greedy rows (whose text never depends on the draft length) draft at most the
        # calibrated length; sampled rows keep their solo lengths, so that a seed gives the solo text
        cap = engine.config.num_draft_tokens if len(rows) > 1 else None
        with engine._lock, torch.inference_mode():
            results = run_round(engine.drafter, rows, cap)
        self.rounds_run += 1
        finished = []
        for submission, result in zip(list(self.active), results, strict=True):
            submission.results.put(result)
            row = submission.row
            assert row is not None
            if isinstance(result, Exception):
                finished.append(submission)
            elif result[-1] in engine.eos_token_ids:
                submission.results.put(_Finished("stop"))
                finished.append(submission)
            elif row.emitted >= submission.run.max_new_tokens:
                submission.results.put(_Finished("length"))
                finished.append(submission)
        self._remove(finished)
