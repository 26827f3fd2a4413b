"""Batched speculation: concurrent generations draft and verify in the same forwards.

With ``SpeculativeEngine(..., batching=True)`` every generation that can be batched is handed
to a :class:`BatchScheduler`: one background thread that runs rounds over all active
requests at once. Each round (``docs/batching.md``):

1. every row picks its own draft budget (its own :class:`~selfspec.adaptive.DraftController`)
   and, with prompt lookup, its own copied draft;
2. early-exit drafting runs layers ``[0, E)`` for all rows in one call per draft step; each
   row samples (or argmaxes) its own next draft token with its own generator, and stops on
   its own (budget, end-of-sequence, low confidence). The step after a row's last draft runs
   that last draft through layers ``[0, E)``, as the single-row verifier does;
3. the deep layers ``[E, L)`` verify all rows' ``k_b + 1`` exit states in one forward (rows
   with shorter drafts are padded and their padded outputs ignored);
4. each row accepts its own number of tokens with :func:`~selfspec.verify.accept_greedy` or
   :func:`~selfspec.verify.accept_sampled` and moves its own cache length.

Requests join between rounds (their prefill runs alone, into their row of the batched
cache) and leave when finished, cancelled or failed. A row's KV slot ``j`` always holds
position ``j``, so ragged lengths need no bookkeeping beyond one length per row: the mask of
row ``b`` lets the query at position ``p`` see slots ``<= p`` (and, in sliding-window layers,
``> p - window``). Slots beyond a row's length hold padding or rejected drafts; no query of
that row reads them before they are written again.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .adapter import SLIDING_ATTENTION, ModelAdapter
from .adaptive import DraftController
from .drafters import (
    EarlyExitDrafter,
    HybridDrafter,
    NgramIndex,
    NoDrafter,
    PromptLookupDrafter,
    choose_token,
)
from .fastpath import layer_forward
from .outputs import FinishReason
from .sampling import logits_to_probs
from .verify import Acceptance, accept_greedy, accept_sampled

if TYPE_CHECKING:
    from .engine import SpeculativeEngine, _Generation

#: Drafters whose rounds run batched; generations with any other drafter run unbatched.
BATCHED_DRAFTERS = (EarlyExitDrafter, HybridDrafter, PromptLookupDrafter, NoDrafter)
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


# --------------------------------------------------------------------------- the batched cache
class BatchedKVCache:
    """Per-layer ``[rows, kv_heads, length, head_dim]`` key/value buffers, one row per request.

    Slot ``j`` of a row holds position ``j``: a forward writes its new states at their
    positions (per row), so rows of different lengths share one buffer and rolling a row back
    is setting its length, which the scheduler keeps. Buffers grow on demand.

    Before each forward, :meth:`select` names the rows (a contiguous range) and the positions
    being written; :meth:`update` then has the contract transformers' attention modules
    expect (``cache.update(key, value, layer_idx, ...)`` returns the keys and values to attend
    over: here every slot up to the largest written position, for the selected rows).

    Args:
        num_layers: number of decoder layers.
    """

    is_compileable = False

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.row_capacity = 0
        self.length_capacity = 0
        self._row_start = 0
        self._row_index: torch.Tensor | None = None  # [m, q] row of each new state
        self._positions: torch.Tensor | None = None  # [m, q] slot of each new state
        self._kv_length = 0

    def __repr__(self) -> str:
        return f"BatchedKVCache(num_layers={self.num_layers}, rows={self.row_capacity}, length={self.length_capacity})"

    def reserve(self, rows: int, length: int) -> None:
        """Make room for at least ``rows`` rows of ``length`` slots (allocated buffers grow)."""
        if rows <= self.row_capacity and length <= self.length_capacity:
            return
        self.row_capacity = max(self.row_capacity, _grown(rows, 4))
        self.length_capacity = max(self.length_capacity, _grown(length, 64))
        for i in range(self.num_layers):
            self.keys[i] = self._regrown(self.keys[i])
            self.values[i] = self._regrown(self.values[i])

    def _regrown(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        if buffer is None or (buffer.shape[0], buffer.shape[2]) == (self.row_capacity, self.length_capacity):
            return buffer
        grown = buffer.new_zeros((self.row_capacity, buffer.shape[1], self.length_capacity, buffer.shape[3]))
        grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
        return grown

    def select(self, row_start: int, positions: torch.Tensor, kv_length: int) -> None:
        """Set the next forward's rows ``row_start .. row_start + m`` and ``[m, q]`` positions.

        Each row's positions are consecutive (a chain of new tokens); ``kv_length`` is the
        largest position + 1.
        """
        self.reserve(row_start + positions.shape[0], kv_length)
        self._row_start = row_start
        rows = torch.arange(positions.shape[0], device=positions.device)
        self._row_index = rows[:, None].expand_as(positions)
        self._positions = positions
        self._kv_length = kv_length

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[m, kv_heads, q, head_dim]`` states at their positions; return the rows' views."""
        assert self._positions is not None and self._row_index is not None, "select() before a forward"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            kshape = (self.row_capacity, key_states.shape[1], self.length_capacity, key_states.shape[3])
            vshape = (self.row_capacity, value_states.shape[1], self.length_capacity, value_states.shape[3])
            keys = self.keys[layer_idx] = key_states.new_zeros(kshape)
            values = self.values[layer_idx] = value_states.new_zeros(vshape)
        end = self._row_start + key_states.shape[0]
        row_keys, row_values = keys[self._row_start : end], values[self._row_start : end]
        if key_states.shape[0] == 1:  # one row: its positions are consecutive, up to kv_length
            start = self._kv_length - key_states.shape[2]
            row_keys[:, :, start : self._kv_length] = key_states
            row_values[:, :, start : self._kv_length] = value_states
        else:
            # advanced indices on dims 0 and 2 put them first: [m, q, kv_heads, head_dim]
            row_keys[self._row_index, :, self._positions] = key_states.transpose(1, 2)
            row_values[self._row_index, :, self._positions] = value_states.transpose(1, 2)
        return row_keys[:, :, : self._kv_length], row_values[:, :, : self._kv_length]

    def move_row(self, source: int, target: int) -> None:
        """Copy row ``source`` into row ``target`` in every layer (a leaving row's slot is reused)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                if buffer is not None:
                    buffer[target] = buffer[source]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots visible to the current forward (the largest written position + 1)."""
        return self._kv_length


def _grown(needed: int, minimum: int) -> int:
    size = minimum
    while size < needed:
        size *= 2
    return size


# --------------------------------------------------------------------------- batched layer runs
def batched_masks(
    adapter: ModelAdapter, positions: torch.Tensor, kv_length: int, dtype: torch.dtype
) -> dict[str, torch.Tensor | None]:
    """One ``[m, 1, q, kv]`` mask per layer type: query ``(b, i)`` sees slots ``<= positions[b, i]``.

    Slot ``j`` holds position ``j``, so this is the causal rule per row, whatever the rows'
    lengths; sliding-window layers also hide slots ``<= position - window``. A single row's
    single query over every slot needs no mask (``None``).
    """
    slots = torch.arange(kv_length, device=positions.device)  # [kv]
    query = positions[:, :, None]  # [m, q, 1]
    causal = slots[None, None, :] <= query  # [m, q, kv]
    masks: dict[str, torch.Tensor | None] = {}
    for layer_type in set(adapter.layer_types):
        allowed = causal
        windowed = layer_type == SLIDING_ATTENTION and adapter.sliding_window is not None
        if positions.shape == (1, 1) and not (windowed and kv_length > (adapter.sliding_window or 0)):
            masks[layer_type] = None  # one row's one query sees every slot
            continue
        if windowed:
            assert adapter.sliding_window is not None
            allowed = allowed & (slots[None, None, :] > query - adapter.sliding_window)
        allowed = allowed[:, None]  # [m, 1, q, kv]
        if adapter.attn_implementation == "sdpa":
            masks[layer_type] = allowed
        else:
            additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            masks[layer_type] = additive.masked_fill(~allowed, torch.finfo(dtype).min)
    return masks


def run_layers_batched(
    adapter: ModelAdapter,
    hidden: torch.Tensor,
    start: int,
    end: int,
    positions: torch.Tensor,
    cache: BatchedKVCache,
    row_start: int = 0,
) -> torch.Tensor:
    """Run layers ``[start, end)`` for rows ``row_start .. row_start + m`` at per-row positions.

    Args:
        adapter: the model adapter (its layers, rotary embedding and fast path are used).
        hidden: ``[m, q, hidden]`` input states.
        start: first layer to run.
        end: one past the last layer to run.
        positions: ``[m, q]`` absolute positions (each row's own).
        cache: the batched cache; the new states are written at their positions.
        row_start: the cache row of the first input row.

    Returns:
        ``[m, q, hidden]`` output states of layer ``end - 1``.
    """
    if start >= end:
        return hidden
    kv_length = int(positions.max()) + 1
    cache.select(row_start, positions, kv_length)
    masks = batched_masks(adapter, positions, kv_length, hidden.dtype)
    types = {adapter.layer_types[i] for i in range(start, end)}
    rotary = adapter._rotary(hidden, positions, types)
    if adapter.fast_layers is not None:
        fast = adapter.fast_layers
        # [m, q, head_dim] -> [m, 1, q, head_dim], broadcast over heads
        cos_sin = {t: (cos.unsqueeze(1), sin.unsqueeze(1)) for t, (cos, sin) in rotary.items()}
        for i in range(start, end):
            cos, sin = cos_sin[adapter.layer_types[i]]
            hidden = layer_forward(fast[i], hidden, cos, sin, masks[adapter.layer_types[i]], cache, i)
        return hidden
    for i in range(start, end):
        layer_type = adapter.layer_types[i]
        hidden = adapter.layers[i](
            hidden,
            attention_mask=masks[layer_type],
            position_ids=positions,
            cache=cache,
            use_cache=True,
            position_embeddings=rotary[layer_type],
        )
    return hidden


def batched_logits(adapter: ModelAdapter, hidden: torch.Tensor) -> torch.Tensor:
    """``[m, q, hidden]`` -> ``[m, q, vocab]`` float32 logits (final norm, LM head, softcap)."""
    logits = adapter.lm_head(adapter.norm(hidden))
    if adapter.final_logit_softcapping is not None:
        cap = adapter.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


# --------------------------------------------------------------------------- requests and rows
@dataclass
class _Finished:
    reason: FinishReason


@dataclass
class _Request:
    """One generation handed to the scheduler, and the queue its results come back on."""

    run: _Generation
    results: queue.Queue[list[int] | _Finished | BaseException] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Row:
    """A request being decoded: its cache length and what its next round needs."""

    request: _Request
    position: int  # the row's cache holds positions < position in every layer
    last_token: int  # the last emitted token, not yet in the cache
    token_ids: list[int]  # prompt + emitted tokens
    emitted: int
    controller: DraftController
    adapter: ModelAdapter | None = None
    ngram: NgramIndex | None = None
    scratch: dict[str, Any] = field(default_factory=dict)  # per-generation drafter state (the hybrid's)
    # filled during a round
    kind: str = "early_exit"  # the hybrid's choice this round
    draft: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)
    forced: bool = True  # the draft is known before the round (lookup or empty)
    drafting: bool = False  # still choosing draft tokens this round
    budget: int = 0
    error: Exception | None = None  # raised in this row's caller after the round

    @property
    def run(self) -> _Generation:
        return self.request.run


# --------------------------------------------------------------------------- the scheduler
class BatchScheduler:
    """Runs concurrent generations of one engine as a batch, round by round.

    Each call's generator (:meth:`rounds`) submits its generation and reads back the tokens
    of each round; a background thread admits new requests between rounds, runs one batched
    round over all active rows at a time (holding the engine's lock), and drops rows that
    finished, were cancelled (their stream closed) or failed. An error in one row is raised
    in that row's caller only; the others and the scheduler go on.

    Args:
        engine: the engine whose model, drafter and lock are used.
        max_batch_size: the most rows decoded together.
    """

    def __init__(self, engine: SpeculativeEngine, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
        self.engine = engine
        self.adapter = engine.adapter
        self.max_batch_size = max_batch_size
        self.cache = BatchedKVCache(engine.adapter.num_layers)
        self.model_batches = not rope_depends_on_batch(engine.adapter.config)
        self.rows: list[_Row] = []
        self.rounds_run = 0  # batched rounds so far
        self.max_rows_seen = 0  # the largest batch a round has run
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return (
            f"BatchScheduler(active={len(self.rows)}, pending={len(self._pending)}, "
            f"max_batch_size={self.max_batch_size}, rounds_run={self.rounds_run})"
        )

    def accepts(self, run: _Generation) -> bool:
        """Whether a generation runs batched.

        It does unless it has a constraint, the drafter has no batched path or drafts token
        trees, or the model's rotary embedding depends on the batch (``dynamic`` or ``longrope`` scaling).
        """
        drafter = self.engine.drafter
        early = drafter.early_exit if isinstance(drafter, HybridDrafter) else drafter
        if isinstance(early, EarlyExitDrafter) and early.tree_nodes:
            return False  # token trees run unbatched
        return self.model_batches and run.constraint is None and isinstance(drafter, BATCHED_DRAFTERS)

    # ------------------------------------------------------------- the caller's side
    def rounds(self, run: _Generation) -> Generator[list[int], None, FinishReason]:
        """Submit ``run`` and yield the tokens of each of its rounds; return its finish reason.

        Closing the generator (a closed stream, a stop string) cancels the row: the scheduler
        drops it before its next round.
        """
        request = _Request(run)
        self._submit(request)
        try:
            while True:
                item = request.results.get()
                if isinstance(item, _Finished):
                    return item.reason
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.cancelled.set()

    def _submit(self, request: _Request) -> None:
        with self._cond:
            self._pending.append(request)
            if self._thread is None:
                # not a daemon: it lives only while there is work, and exits cleanly when idle
                self._thread = threading.Thread(target=self._loop, name="selfspec-batching")
                self._thread.start()

    # ------------------------------------------------------------- the scheduler thread
    def _loop(self) -> None:
        """Admit, run a round, drop finished rows; exit when there is nothing to do."""
        while True:
            with self._cond:
                if not self._pending and not self.rows:
                    self._thread = None  # the next submission starts a new thread
                    self.cache = BatchedKVCache(self.adapter.num_layers)  # free the buffers while idle
                    return
                free = self.max_batch_size - len(self.rows)
                joining, self._pending = self._pending[:free], self._pending[free:]
            try:
                with torch.inference_mode():  # the cache buffers are inference tensors
                    for request in joining:
                        self._admit(request)
                    self._drop_cancelled()
                    if self.rows:
                        self._round()
            except Exception as error:  # noqa: BLE001 - a failed batched forward fails this round's rows only
                for row in self.rows:
                    row.request.results.put(error)
                self.rows.clear()

    def _admit(self, request: _Request) -> None:
        """Prefill a joining request alone (in its own cache row) and choose its first token."""
        if request.cancelled.is_set():
            return
        engine, adapter, run = self.engine, self.adapter, request.run
        slot = len(self.rows)
        prompt_len = len(run.prompt_ids)
        try:
            with engine._lock, torch.inference_mode():
                started = time.perf_counter()
                ids = torch.tensor([run.prompt_ids], device=adapter.device)
                positions = torch.arange(prompt_len, device=adapter.device)[None]  # [1, n]
                hidden = run_layers_batched(
                    adapter, adapter.embed(ids), 0, adapter.num_layers, positions, self.cache, slot
                )
                logits = batched_logits(adapter, hidden[:, -1:])[0, 0]
                first, _ = choose_token(logits, run.params, run.generator)
                run.stats.target_forwards += 1
                run.stats.verify_seconds += time.perf_counter() - started
        except Exception as error:  # noqa: BLE001 - this request fails; the batch goes on
            request.results.put(error)
            return
        request.results.put([first])
        if first in engine.eos_token_ids:
            request.results.put(_Finished("stop"))
        elif run.max_new_tokens <= 1:
            request.results.put(_Finished("length"))
        else:
            drafter = engine.drafter
            ngram = None
            if isinstance(drafter, (PromptLookupDrafter, HybridDrafter)):
                lookup = drafter if isinstance(drafter, PromptLookupDrafter) else drafter.lookup_drafter
                ngram = NgramIndex(lookup.max_ngram)
            self.rows.append(
                _Row(
                    request=request,
                    position=prompt_len,
                    last_token=first,
                    token_ids=[*run.prompt_ids, first],
                    emitted=1,
                    # a fresh untimed controller per row: draft lengths follow acceptance, and a
                    # seed gives the text it gives alone (timing is not reproducible)
                    controller=engine.controller.for_sampling(),
                    adapter=adapter,
                    ngram=ngram,
                )
            )
            self.max_rows_seen = max(self.max_rows_seen, len(self.rows))

    def _drop_cancelled(self) -> None:
        self._remove([row for row in self.rows if row.request.cancelled.is_set()])

    def _remove(self, leaving: list[_Row]) -> None:
        """Drop rows; the last rows move into the freed slots so active rows stay contiguous."""
        for row in leaving:
            index = next((i for i, r in enumerate(self.rows) if r is row), None)
            if index is None:
                continue
            last = len(self.rows) - 1
            if index != last:
                self.cache.move_row(last, index)
                self.rows[index] = self.rows[last]
            self.rows.pop()

    # ------------------------------------------------------------- one batched round
    def _round(self) -> None:
        """Draft, verify and accept for every active row (see the module docstring)."""
        engine = self.engine
        rows = self.rows
        with engine._lock, torch.inference_mode():
            started = time.perf_counter()
            self._plan(rows)
            exit_layer, states = self._draft(rows)
            drafted_at = time.perf_counter()
            target_logits = self._verify(rows, exit_layer, states)  # [m, K + 1, vocab]
            verified_at = time.perf_counter()
        self.rounds_run += 1
        finished: list[_Row] = []
        for b, row in enumerate(rows):
            try:
                if row.error is not None:
                    raise row.error
                done = self._accept(row, target_logits[b, : len(row.draft) + 1], started, drafted_at, verified_at)
            except Exception as error:  # noqa: BLE001 - this row fails; the others go on
                row.request.results.put(error)
                done = True
            if done:
                finished.append(row)
        self._remove(finished)

    def _plan(self, rows: list[_Row]) -> None:
        """Each row's draft budget, and its copied draft when it has one."""
        drafter = self.engine.drafter
        for row in rows:
            remaining = row.run.max_new_tokens - row.emitted
            budget = 0 if isinstance(drafter, NoDrafter) else min(row.controller.budget(), remaining - 1)
            if row.run.params.greedy and len(rows) > 1:
                # a round lasts as long as its longest draft, and padding costs compute in a
                # batch: greedy rows (whose text never depends on the draft length) draft at
                # most the calibrated length; sampled rows keep their solo lengths, so that a
                # seed gives the solo text
                budget = min(budget, self.engine.num_draft_tokens)
            row.budget, row.draft, row.draft_probs, row.error = budget, [], [], None
            row.forced, row.drafting = True, False
            if budget <= 0 or isinstance(drafter, NoDrafter):
                continue
            if isinstance(drafter, (PromptLookupDrafter, HybridDrafter)):
                lookup = drafter if isinstance(drafter, PromptLookupDrafter) else drafter.lookup_drafter
                assert row.ngram is not None
                row.ngram.update(row.token_ids)
                copied = row.ngram.lookup(row.token_ids, lookup.min_ngram, budget)
                if isinstance(drafter, PromptLookupDrafter):
                    row.draft = copied
                    continue
                # the hybrid's own per-generation choice, as in a solo generation
                drafter.settle(row)
                row.kind = drafter.choose(row, copied, budget) if copied else "early_exit"
                if row.kind == "lookup":
                    row.draft = copied
                    continue
            row.forced, row.drafting = False, True  # early exit drafts this row

    def _exit_layer(self) -> int:
        drafter = self.engine.drafter
        if isinstance(drafter, (EarlyExitDrafter, HybridDrafter)):
            return drafter.exit_layer
        return 0

    def _draft(self, rows: list[_Row]) -> tuple[int, torch.Tensor | None]:
        """Early-exit drafting for all rows at once; returns the exit layer and ``[m, K + 1, hidden]``.

        Step ``j`` runs layers ``[0, E)`` on each row's ``j``-th token of the round (its last
        emitted token, then its drafts) at its own position ``P_b + j``. A row that is still
        drafting chooses its next draft token from the step's logits; a row whose draft is
        complete runs its last draft token once more (the verifier's first step) and then
        rides along as padding. Returns ``(0, None)`` when no row drafts with the model: the
        verifier then runs every layer on the known drafts.
        """
        if all(row.forced for row in rows):
            return 0, None
        adapter, device = self.adapter, self.adapter.device
        drafter = self.engine.drafter
        exit_layer = self._exit_layer()
        early = drafter.early_exit if isinstance(drafter, HybridDrafter) else drafter
        confidence = early.confidence if isinstance(early, EarlyExitDrafter) else 0.0
        exit_adapter = early.exit_adapter if isinstance(early, EarlyExitDrafter) else None
        eos = self.engine.eos_token_ids
        base = torch.tensor([row.position for row in rows], device=device)  # [m]
        states: list[torch.Tensor] = []
        step = 0
        while True:
            # the token each row runs at this step; rows past their last step repeat it
            tokens = [([row.last_token, *row.draft])[min(step, len(row.draft))] for row in rows]
            ids = torch.tensor(tokens, device=device)[:, None]  # [m, 1]
            positions = (base + step)[:, None]  # [m, 1]
            hidden = run_layers_batched(adapter, adapter.embed(ids), 0, exit_layer, positions, self.cache)
            states.append(hidden)
            drafting = [b for b, row in enumerate(rows) if row.drafting]
            if drafting:
                index = torch.tensor(drafting, device=device)
                drafted = hidden[index] if exit_adapter is None else exit_adapter(hidden[index])
                logits = batched_logits(adapter, drafted)[:, 0]  # [d, vocab]
                for i, b in enumerate(drafting):
                    try:
                        self._draft_one(rows[b], logits[i], confidence, eos)
                    except Exception as error:  # noqa: BLE001 - this row fails after the round; the others go on
                        rows[b].error, rows[b].drafting = error, False
            step += 1
            if not any(row.drafting for row in rows) and step > max(len(row.draft) for row in rows):
                break
        return exit_layer, torch.cat(states, dim=1)  # [m, K + 1, hidden]

    @staticmethod
    def _draft_one(row: _Row, logits: torch.Tensor, confidence: float, eos: set[int]) -> None:
        """Choose one draft token for a row, as :func:`~selfspec.drafters.draft_autoregressively` does."""
        token, probs = choose_token(logits, row.run.params, row.run.generator)
        row.draft.append(token)
        if probs is not None:
            row.draft_probs.append(probs)
        count = len(row.draft)
        if token in eos or count >= row.budget:
            row.drafting = False
        elif confidence > 0:
            top = (probs if probs is not None else torch.softmax(logits, dim=-1)).max()
            if bool(top < confidence):
                row.drafting = False

    def _verify(self, rows: list[_Row], exit_layer: int, states: torch.Tensor | None) -> torch.Tensor:
        """Target logits ``[m, K + 1, vocab]``; row ``b``'s first ``k_b + 1`` entries are its own."""
        adapter, device = self.adapter, self.adapter.device
        width = max(len(row.draft) for row in rows) + 1
        base = torch.tensor([row.position for row in rows], device=device)
        positions = base[:, None] + torch.arange(width, device=device)[None]  # [m, K + 1]
        if states is None:
            # pad each row's [last_token, *draft] with its last token (outputs ignored)
            padded = [[row.last_token, *row.draft] for row in rows]
            ids = torch.tensor([seq + [seq[-1]] * (width - len(seq)) for seq in padded], device=device)
            hidden = run_layers_batched(adapter, adapter.embed(ids), 0, adapter.num_layers, positions, self.cache)
        else:
            states = states[:, :width]
            hidden = run_layers_batched(adapter, states, exit_layer, adapter.num_layers, positions, self.cache)
        return batched_logits(adapter, hidden)

    def _accept(
        self, row: _Row, target_logits: torch.Tensor, started: float, drafted_at: float, verified_at: float
    ) -> bool:
        """Accept a row's draft, move its length, hand its tokens over; ``True`` when it finished."""
        run, stats, engine = row.run, row.run.stats, self.engine
        device = target_logits.device
        draft_tokens = torch.tensor(row.draft, dtype=torch.long, device=device)
        acceptance: Acceptance
        if run.params.greedy:
            acceptance = accept_greedy(draft_tokens, target_logits)
        else:
            draft_probs = torch.stack(row.draft_probs) if row.draft_probs else None
            target_probs = logits_to_probs(target_logits, run.params)
            acceptance = accept_sampled(draft_tokens, draft_probs, target_probs, run.generator)
        num_drafted, num_accepted = len(row.draft), acceptance.num_accepted
        engine.drafter.observe(num_drafted, num_accepted)
        if isinstance(engine.drafter, HybridDrafter):
            engine.drafter.note(row, row.kind, row.draft)
        row.controller.record(num_drafted, num_accepted, num_accepted + 1, time.perf_counter() - started)
        stats.draft_seconds += drafted_at - started
        stats.verify_seconds += verified_at - drafted_at
        stats.target_forwards += 1
        stats.num_drafted += num_drafted
        stats.num_accepted += num_accepted
        histogram = stats.accepted_length_histogram
        histogram.extend([0] * (num_accepted + 1 - len(histogram)))
        histogram[num_accepted] += 1

        remaining = run.max_new_tokens - row.emitted
        tokens = acceptance.emitted(row.draft)[:remaining]
        row.position += num_accepted + 1  # the cache now holds last_token and the accepted drafts
        for i, token in enumerate(tokens):
            if token in engine.eos_token_ids:
                tokens = tokens[: i + 1]
                break
        row.last_token = tokens[-1]
        row.token_ids.extend(tokens)
        row.emitted += len(tokens)
        row.request.results.put(tokens)
        if tokens[-1] in engine.eos_token_ids:
            row.request.results.put(_Finished("stop"))
            return True
        if row.emitted >= run.max_new_tokens:
            row.request.results.put(_Finished("length"))
            return True
        return False
