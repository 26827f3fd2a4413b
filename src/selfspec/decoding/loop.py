"""The decoding loop: prefill, then rounds of four numbered steps, for rows of 1 .. n generations.

One round (``../DESIGN.md``), written once for a single call (a batch of one) and for the
batching scheduler (:mod:`selfspec.decoding.batching`), which only admits rows and hands out results:

1. **draft**: each row gets a budget from its :class:`~selfspec.decoding.controller.DraftController`
   and the drafter proposes (:meth:`~selfspec.drafting.Drafter.propose`, or
   :meth:`~selfspec.drafting.Drafter.propose_batch` for a batch); trees are fitted to the
   budget and the cache;
2. **score**: one target forward returns the target's logits at every draft position
   (:mod:`selfspec.decoding.verify`); a grammar constraint masks them and cuts the draft at its first
   forbidden token (:func:`constrain`);
3. **accept**: the pure acceptance maths keeps a prefix (or a tree path) plus one recovered or
   bonus token (:mod:`selfspec.core.acceptance`, :mod:`selfspec.core.tree`);
4. **commit**: the cache is cropped to exactly the accepted text, the tokens are emitted (cut
   at the budget and at end-of-sequence), and the statistics and the controller are updated; a call
   that asked for ``logprobs`` gets the emitted tokens' log-probabilities from the rows of the same
   target forward (:func:`token_logprobs`: no extra forward).

Plain decoding is the same loop with an empty draft (``drafter="none"``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import torch

from ..core.acceptance import Acceptance, accept_greedy, accept_sampled
from ..core.constraints import apply_mask, draft_masks
from ..core.sampling import logits_to_probs
from ..core.speed import CostModel
from ..core.tree import TreeAcceptance, accept_tree_greedy, accept_tree_sampled, tree_depths
from ..drafting.base import DecodeState, Draft, Drafter, choose_token
from ..drafting.fitting import fit_tree, truncate_chain
from ..modeling.cache import BatchedKVCache, StaticKVCache
from ..modeling.runner import ModelRunner
from ..modeling.static_step import DeviceKVCache
from ..modeling.transfer import device_ids
from .generation import Generation
from .outputs import FinishReason, TokenLogprob
from .verify import prefill, prefill_row, score_chain, score_rows, score_tree


@dataclass
class Row:
    """One generation inside the loop: its decode state, its request and its progress.

    Attributes:
        state: what the drafter and the verifier read (cache, position, tokens, ...).
        run: the generation (limits, sampling, statistics, controller, results).
        emitted: new tokens emitted so far.
    """

    state: DecodeState
    run: Generation
    emitted: int = 1


@dataclass
class RoundTimes:
    """When a round started, finished drafting and finished its target forward."""

    started: float
    drafted: float
    scored: float


# ----------------------------------------------------------------------------- prefill
def start_row(
    runner: ModelRunner,
    drafter: Drafter,
    run: Generation,
    cache: StaticKVCache | BatchedKVCache,
    eos_token_ids: frozenset[int],
    row: int = 0,
) -> Row:
    """Prefill the prompt (one target forward) and choose the first token: a new row.

    With a batched cache the prompt goes into cache row ``row``.
    """
    started = time.perf_counter()
    if cache.batched:
        hidden, logits = prefill_row(runner, cache, row, run.prompt_ids)
    else:
        keep_all = drafter.needs_committed_hidden
        hidden, logits = prefill(
            runner, cache, run.prompt_ids, keep_all=keep_all, feature_layers=drafter.feature_layers
        )
    return first_row(runner, drafter, run, cache, eos_token_ids, Prefilled(hidden, logits, started), row)


@dataclass
class Prefilled:
    """What a prefill hands :func:`first_row`: the states it keeps, the last position's logits, when it began."""

    hidden: torch.Tensor
    logits: torch.Tensor
    started: float


def first_row(
    runner: ModelRunner,
    drafter: Drafter,
    run: Generation,
    cache: StaticKVCache | BatchedKVCache | DeviceKVCache,
    eos_token_ids: frozenset[int],
    prefilled: Prefilled,
    row: int = 0,
) -> Row:
    """After the prompt's prefill: choose the first token, count the forward, start the row's state."""
    hidden, logits = prefilled.hidden, prefilled.logits
    first, _ = choose_token(logits, run.params, run.generator, run.constraint)
    if run.top_logprobs is not None:
        run.computed_logprobs.extend(token_logprobs(logits[None], [first], run.top_logprobs))
    run.stats.target_forwards += 1
    run.stats.verify_seconds += time.perf_counter() - prefilled.started
    if run.constraint is not None:
        run.constraint.advance(first)
    state = DecodeState(
        runner=runner,
        cache=cache,
        position=len(run.prompt_ids),
        last_token=first,
        token_ids=[*run.prompt_ids, first],
        params=run.params,
        generator=run.generator,
        constraint=run.constraint,
        eos_token_ids=eos_token_ids,
        last_hidden=hidden[:, -1:] if drafter.needs_hidden else None,
        pending_hidden=hidden if drafter.needs_committed_hidden else None,
        row=row,
        feature_layers=drafter.feature_layers,  # EAGLE-3 taps (issue 30): the verifier keeps these layers' inputs
        argmax_only=run.params.greedy and run.constraint is None and run.top_logprobs is None,
    )
    return Row(state, run)


# ----------------------------------------------------------------------------- one round
def draft(drafter: Drafter, rows: Sequence[Row], batch_cap: int | None = None) -> list[Draft]:
    """Step 1: every row's draft, fitted to its budget (and, for trees, to the cache).

    Args:
        drafter: the engine's drafter.
        rows: the rows of this round (one for a single call).
        batch_cap: in a batch, greedy rows draft at most this many tokens (a round lasts as
            long as its longest draft; greedy text never depends on the draft length).
    """
    budgets = []
    for row in rows:
        remaining = row.run.max_new_tokens - row.emitted
        budget = min(row.run.controller.budget(), remaining - 1)
        if batch_cap is not None and row.run.params.greedy:
            budget = min(budget, batch_cap)
        budgets.append(budget)
    states = [row.state for row in rows]
    if states[0].cache.batched:
        drafts = drafter.propose_batch(states, budgets)
    else:
        drafts = [drafter.propose(s, n) if n > 0 else Draft() for s, n in zip(states, budgets, strict=True)]
    for i, (state, budget) in enumerate(zip(states, budgets, strict=True)):
        if drafts[i].parents is not None:  # a token tree (selfspec.core.tree)
            drafts[i] = fit_tree(state, drafts[i], budget)
        drafts[i] = truncate_chain(drafts[i], max(budget, 0))
    return drafts


def score(drafter: Drafter, rows: Sequence[Row], drafts: list[Draft]) -> list[torch.Tensor]:
    """Step 2: the target's logits for every row's draft, in one target forward.

    Returns:
        Per row, the target's raw ``[k + 1, vocab]`` logits (``[n + 1, vocab]`` for a tree).
    """
    states = [row.state for row in rows]
    if states[0].cache.batched:
        target = score_rows(states, drafts)  # [m, K + 1, vocab]
        logits = [target[b, : len(d) + 1] for b, d in enumerate(drafts)]
    else:
        logits = [
            score_tree(row.state, d, drafter.needs_hidden, verify_width(row, d))
            if d.parents is not None
            else score_chain(row.state, d, drafter.needs_hidden, verify_width(row, d))
            for row, d in zip(rows, drafts, strict=True)
        ]
    return logits


def verify_width(row: Row, draft: Draft) -> int:
    """How many drafts the row's verify runs as: the draft's own length, or a cheaper wider one.

    Where the calibrated verify curve says a wider forward costs less
    (:meth:`~selfspec.core.speed.CostModel.padded`), and the cache has the room, the draft is
    verified padded to that width. Without a calibrated curve (fixed settings), never padded.
    """
    costs = row.run.controller.costs
    if not draft.tokens or not isinstance(costs, CostModel):
        return len(draft)
    width = costs.padded(len(draft))
    room = row.state.cache.max_length - row.state.position - 1
    return width if width <= room else len(draft)


def constrain(
    rows: Sequence[Row], target_logits: list[torch.Tensor], drafts: list[Draft]
) -> tuple[list[torch.Tensor], list[Draft]]:
    """Step 2, for rows with a grammar: mask the target's logits and cut each draft at its first forbidden token.

    Returns:
        Per row, the logits acceptance reads (masked by the row's constraint; the raw ones are
        left untouched) and the drafts (cut where the constraint forbids a token).
    """
    logits, drafts = list(target_logits), list(drafts)
    for i, row in enumerate(rows):
        constraint = row.state.constraint
        masks = draft_masks(constraint, drafts[i].tokens) if drafts[i].parents is None else None
        if masks is not None:
            drafts[i] = truncate_chain(drafts[i], len(masks) - 1)
            logits[i] = apply_mask(logits[i][: len(masks)], torch.stack(masks))
    return logits, drafts


def token_logprobs(target_logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The target's log-probabilities of ``tokens``, row ``i`` scoring ``tokens[i]``, and each row's ``top`` best.

    Args:
        target_logits: ``[n, vocab]`` raw logits (before temperature, top-k, top-p and masks).
        tokens: ``n`` tokens, one per row.
        top: how many most likely alternatives to report per row.

    Returns:
        One :class:`~selfspec.decoding.outputs.TokenLogprob` per token (``log_softmax`` in float32,
        or float64 for a float64 model).
    """
    logits = target_logits if target_logits.dtype == torch.float64 else target_logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1) if top else None
    best_ids = best.indices.tolist() if best is not None else [[] for _ in tokens]
    best_values = best.values.tolist() if best is not None else [[] for _ in tokens]
    return [
        TokenLogprob(int(token), float(value), list(top_ids), list(top_values))
        for token, value, top_ids, top_values in zip(tokens, chosen, best_ids, best_values, strict=True)
    ]


def emitted_rows(acceptance: Acceptance | TreeAcceptance) -> list[int]:
    """The rows of the target's logits that chose each emitted token (a chain's ``0 .. n``; a tree's path)."""
    if isinstance(acceptance, TreeAcceptance):
        return [0, *(i + 1 for i in acceptance.path)]
    return list(range(acceptance.num_accepted + 1))


def accept_draft(state: DecodeState, draft: Draft, target_logits: torch.Tensor) -> Acceptance | TreeAcceptance:
    """Step 3: how much of the draft the target keeps (greedy match, or rejection sampling)."""
    if draft.parents is not None:
        if state.params.greedy:
            return accept_tree_greedy(draft.tokens, draft.parents, target_logits)
        target_probs = logits_to_probs(target_logits, state.params)
        return accept_tree_sampled(draft.tokens, draft.parents, draft.draft_probs, target_probs, state.generator)
    draft_tokens = device_ids(draft.tokens, target_logits.device)
    if state.params.greedy:
        return accept_greedy(draft_tokens, target_logits)
    target_probs = logits_to_probs(target_logits, state.params)
    return accept_sampled(draft_tokens, draft.draft_probs, target_probs, state.generator)


def commit(
    drafter: Drafter, row: Row, draft: Draft, acceptance: Acceptance | TreeAcceptance, times: RoundTimes
) -> list[int]:
    """Step 4: crop the cache to the accepted text, update the books, emit the tokens.

    Returns:
        The tokens this round adds (cut at the row's budget and after an end-of-sequence token).
    """
    state, run, stats = row.state, row.run, row.run.stats
    num_accepted = acceptance.num_accepted
    if isinstance(acceptance, TreeAcceptance):
        keep_accepted_path(state, acceptance.path)
        kept = acceptance.path[-1] + 1 if acceptance.path else 0  # the last accepted node's row
        depth = max(tree_depths(draft.parents or []), default=0)  # what the controller budgets
    else:
        kept, depth = num_accepted, len(draft)
    if state.last_hidden is not None and state.last_hidden.shape[1] > 1:  # the verifier kept every row
        if drafter.needs_committed_hidden:  # hand every committed position's state to the drafter
            rows = [0, *(i + 1 for i in acceptance.path)] if isinstance(acceptance, TreeAcceptance) else None
            committed = state.last_hidden[:, rows] if rows is not None else state.last_hidden[:, : kept + 1]
            pending = state.pending_hidden
            state.pending_hidden = committed if pending is None else torch.cat([pending, committed], dim=1)
        state.last_hidden = state.last_hidden[:, kept : kept + 1]
    elif drafter.needs_committed_hidden and state.last_hidden is not None:  # an empty draft: one position
        pending = state.pending_hidden
        state.pending_hidden = state.last_hidden if pending is None else torch.cat([pending, state.last_hidden], dim=1)
    # roll every layer back to the accepted text: last_token + accepted drafts
    state.cache.crop_to(state.position + num_accepted + 1)
    state.position += num_accepted + 1

    drafter.observe(len(draft), num_accepted)
    run.controller.record(depth, num_accepted, num_accepted + 1, time.perf_counter() - times.started)
    stats.draft_seconds += times.drafted - times.started
    stats.verify_seconds += times.scored - times.drafted
    stats.target_forwards += 1
    stats.num_drafted += len(draft)
    stats.num_accepted += num_accepted
    histogram = stats.accepted_length_histogram
    histogram.extend([0] * (num_accepted + 1 - len(histogram)))
    histogram[num_accepted] += 1

    tokens = acceptance.emitted(draft.tokens)[: run.max_new_tokens - row.emitted]
    for i, token in enumerate(tokens):
        if token in state.eos_token_ids:
            tokens = tokens[: i + 1]
            break
    state.last_token = tokens[-1]
    state.token_ids.extend(tokens)
    row.emitted += len(tokens)
    if state.constraint is not None:
        for token in tokens:
            state.constraint.advance(token)
    return tokens


def keep_accepted_path(state: DecodeState, path: Sequence[int]) -> None:
    """Compact every layer of the cache to the root and the accepted tree nodes (now contiguous)."""
    start = state.position
    assert not state.cache.batched  # a tree round is one generation's
    state.cache.keep(start, [start, *(start + 1 + i for i in path)])


def run_round(drafter: Drafter, rows: Sequence[Row], batch_cap: int | None = None) -> list[list[int] | Exception]:
    """One round for every row: 1. draft, 2. score, 3. accept, 4. commit.

    Returns:
        Per row, the tokens it emitted, or the exception that failed it (the other rows go on).
    """
    started = time.perf_counter()
    drafts = draft(drafter, rows, batch_cap)  # 1.
    drafted = time.perf_counter()
    raw_logits = score(drafter, rows, drafts)  # 2.
    target_logits, drafts = constrain(rows, raw_logits, drafts)
    times = RoundTimes(started, drafted, time.perf_counter())
    results: list[list[int] | Exception] = []
    for row, row_draft, row_logits, row_raw in zip(rows, drafts, target_logits, raw_logits, strict=True):
        try:
            if row_draft.failure is not None:
                raise row_draft.failure
            acceptance = accept_draft(row.state, row_draft, row_logits)  # 3.
            tokens = commit(drafter, row, row_draft, acceptance, times)  # 4.
            if row.run.top_logprobs is not None:
                used = emitted_rows(acceptance)[: len(tokens)]
                row.run.computed_logprobs.extend(token_logprobs(row_raw[used], tokens, row.run.top_logprobs))
            results.append(tokens)
        except Exception as error:  # noqa: BLE001 - this row fails; the others go on
            results.append(error)
    return results


# ----------------------------------------------------------------------------- a single call
def decode(
    runner: ModelRunner,
    drafter: Drafter,
    run: Generation,
    cache: StaticKVCache,
    lock: threading.RLock,
    eos_token_ids: frozenset[int],
) -> Generator[list[int], None, FinishReason]:
    """Decode one generation alone (a batch of one), yielding each round's tokens; return the finish reason.

    The lock is held for each round's computation, never across a ``yield``, so an abandoned
    stream cannot block other callers.
    """
    with lock, torch.inference_mode():
        row = start_row(runner, drafter, run, cache, eos_token_ids)
    yield [row.state.last_token]
    if row.state.last_token in eos_token_ids:
        return "stop"
    while row.emitted < run.max_new_tokens:
        with lock, torch.inference_mode():
            (result,) = run_round(drafter, [row])
        if isinstance(result, Exception):
            raise result
        yield result
        if result[-1] in eos_token_ids:
            return "stop"
    return "length"
