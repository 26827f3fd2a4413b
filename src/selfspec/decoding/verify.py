"""The verifier: every forward of the target model (prefill, chain, tree, a batch of rows).

Scoring a draft is one target forward over the last emitted token and the draft, returning
the target's logits at every position (row ``i`` judges draft token ``i``; the last row gives
the bonus token). When the draft came from the target's own first ``E`` layers
(``Draft.exit_states``), the forward starts at layer ``E`` from those states: the first layers
never run twice on the same token. Otherwise it runs every layer from the token embeddings.

The acceptance maths that reads these logits is pure and lives in :mod:`selfspec.core.acceptance`
(chains) and :mod:`selfspec.core.tree` (trees).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..core.tree import TreeMask, tree_attention, tree_depths
from ..drafting.base import DecodeState, Draft
from ..modeling.cache import BatchedKVCache, StaticKVCache
from ..modeling.runner import ModelRunner
from ..modeling.transfer import device_ids


def prefill(
    runner: ModelRunner,
    cache: StaticKVCache,
    prompt_ids: list[int],
    keep_all: bool = False,
    feature_layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompt through every layer into ``cache``.

    Returns:
        The last position's ``[1, 1, hidden]`` output state (every position's with ``keep_all``)
        and the last position's ``[vocab]`` logits. With ``feature_layers`` (EAGLE-3), the states
        handed back are the inputs of those layers, concatenated (:func:`drafter_states`).
    """
    ids = device_ids([prompt_ids], runner.device)
    positions = torch.arange(len(prompt_ids), device=runner.device)
    capture = feature_capture(feature_layers)
    hidden = runner.run_layers(runner.embed(ids), 0, runner.num_layers, positions, cache, capture=capture)
    last = hidden[:, -1:]
    states = drafter_states(hidden, feature_layers, capture)
    return (states if keep_all else states[:, -1:]), runner.logits(last)[0]


# --- EAGLE-3 feature taps (selfspec issue 30): the verifier hands the drafter the states entering
# --- the layers it names, captured during the forward that runs anyway (nothing recomputed).
def feature_capture(feature_layers: tuple[int, ...] | None) -> dict[int, torch.Tensor | None] | None:
    """An empty capture dict for :meth:`ModelRunner.run_layers` (``None`` without feature layers)."""
    return dict.fromkeys(feature_layers) if feature_layers else None


def drafter_states(
    hidden: torch.Tensor, feature_layers: tuple[int, ...] | None, capture: dict[int, torch.Tensor | None] | None
) -> torch.Tensor:
    """The states a drafter reads: the last layer's output, or the captured layers' inputs concatenated.

    Returns:
        ``[1, q, hidden]``, or ``[1, q, len(feature_layers) * hidden]`` in the order of ``feature_layers``.
    """
    if not feature_layers or capture is None:
        return hidden
    taps = [capture[i] for i in feature_layers]
    if any(t is None for t in taps):
        raise RuntimeError(f"feature layers {feature_layers} were not all captured by this forward")
    return torch.cat(taps, dim=-1)  # type: ignore[arg-type]


def prefill_row(
    runner: ModelRunner, cache: BatchedKVCache, row: int, prompt_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`prefill` into row ``row`` of a batched cache."""
    ids = device_ids([prompt_ids], runner.device)
    positions = torch.arange(len(prompt_ids), device=runner.device)[None]  # [1, n]
    hidden = runner.run_rows(runner.embed(ids), 0, runner.num_layers, positions, cache, row)[:, -1:]
    return hidden, runner.logits(hidden)[0]


def score_chain(state: DecodeState, draft: Draft, keep_hidden: bool = False, pad_to: int = 0) -> torch.Tensor:
    """Target logits ``[k + 1, vocab]`` for ``last_token`` and every draft token of a chain.

    With ``keep_hidden``, ``state.last_hidden`` becomes the ``[1, k + 1, hidden]`` output states
    (the loop keeps the accepted position's). With ``pad_to > k`` the forward runs ``pad_to + 1``
    rows, the draft followed by filler rows whose outputs are dropped (a wider forward can cost
    less: :meth:`~selfspec.core.speed.CostModel.padded`); their cache slots lie past the draft and
    the commit crops them.
    """
    runner, cache, device = state.runner, state.cache, state.runner.device
    assert not cache.batched  # one generation's cache (a batch's rows: score_rows)
    num_draft = len(draft)
    pad = max(pad_to - num_draft, 0) if num_draft > 0 else 0
    positions = torch.arange(state.position, state.position + num_draft + 1 + pad, device=device)
    capture = None
    if draft.exit_states is not None and num_draft > 0:
        # the drafter ran layers [0, E) on last_token and drafts 1..k-1; finish the last one
        exit_layer = draft.exit_layer
        cache.crop_to(state.position + num_draft, range(exit_layer))  # drop shallow KV beyond a truncation
        last = torch.full((1, 1), draft.tokens[-1], device=device)
        last_state = runner.run_layers(runner.embed(last), 0, exit_layer, positions[num_draft : num_draft + 1], cache)
        fill_states = [last_state.expand(-1, pad, -1)] if pad else []
        exit_states = torch.cat([draft.exit_states[:, :num_draft], last_state, *fill_states], dim=1)
        hidden = runner.run_layers(exit_states, exit_layer, runner.num_layers, positions, cache)
    else:
        ids = device_ids([[state.last_token, *draft.tokens, *(draft.tokens[-1:] * pad)]], device)
        capture = feature_capture(state.feature_layers if keep_hidden else None)
        hidden = runner.run_layers(runner.embed(ids), 0, runner.num_layers, positions, cache, capture=capture)
    return _scored(state, hidden, keep_hidden, capture, rows=num_draft + 1)


def score_tree(state: DecodeState, draft: Draft, keep_hidden: bool = False, pad_to: int = 0) -> torch.Tensor:
    """Target logits ``[n + 1, vocab]`` for the root and every node of a tree, in one target forward.

    With early-exit states, only the nodes the drafter did not expand run layers ``[0, E)``
    here; every node then runs ``[E, L)``. The cache afterwards holds the root at slot ``P``
    and node ``i`` at slot ``P + 1 + i`` in every layer. With ``pad_to > n``, filler children of
    the root follow the nodes (as :func:`score_chain` pads a chain); their rows are dropped.
    """
    assert draft.parents is not None
    rows = len(draft.tokens) + 1
    if pad_to > len(draft.tokens) > 0:
        pad = pad_to - len(draft.tokens)
        draft = replace(draft, tokens=[*draft.tokens, *[state.last_token] * pad], parents=[*draft.parents, *[-1] * pad])
    assert draft.parents is not None
    runner, cache, device = state.runner, state.cache, state.runner.device
    assert not cache.batched  # one generation's cache (a batch's rows: score_rows)
    start = state.position
    depths = tree_depths(draft.parents)
    positions = torch.tensor([start, *(start + d for d in depths)], device=device)  # [n + 1]
    allowed = tree_attention(draft.parents, device)  # [n + 1, n + 1]
    full = TreeMask(allowed, positions)
    if draft.exit_states is not None:
        exit_layer = draft.exit_layer
        expanded = draft.exit_states.shape[1] - 1  # nodes whose shallow KV is cached
        cache.crop_to(start + 1 + expanded, range(exit_layer))
        exit_states = draft.exit_states
        if expanded < len(draft.tokens):
            rest = torch.tensor([draft.tokens[expanded:]], device=device)
            rest_mask = TreeMask(allowed[1 + expanded :], positions)
            rest_states = runner.run_layers(
                runner.embed(rest), 0, exit_layer, positions[1 + expanded :], cache, tree=rest_mask
            )
            exit_states = torch.cat([exit_states, rest_states], dim=1)
        hidden = runner.run_layers(exit_states, exit_layer, runner.num_layers, positions, cache, tree=full)
    else:
        ids = device_ids([[state.last_token, *draft.tokens]], device)
        capture = feature_capture(state.feature_layers if keep_hidden else None)
        hidden = runner.run_layers(
            runner.embed(ids), 0, runner.num_layers, positions, cache, tree=full, capture=capture
        )
        return _scored(state, hidden, keep_hidden, capture, rows=rows)
    return _scored(state, hidden, keep_hidden, rows=rows)


def _scored(
    state: DecodeState,
    hidden: torch.Tensor,
    keep_hidden: bool,
    capture: dict[int, torch.Tensor | None] | None = None,
    rows: int | None = None,
) -> torch.Tensor:
    """The logits of a verify forward's output ``hidden`` (its first ``rows`` rows; the rest were filler).

    With ``keep_hidden`` its states are kept for the drafter: the captured feature layers' for
    EAGLE-3 (``capture``), else the output states. The LM head runs over every row, filler
    included (its kernel is part of what made the wider forward cheaper); where only an argmax
    reads the logits (``state.argmax_only``), the runner's exact-argmax head may answer.
    """
    kept = slice(None, rows)
    if capture is not None:
        state.last_hidden = drafter_states(hidden, state.feature_layers, capture)[:, kept]
    elif keep_hidden:
        state.last_hidden = hidden[:, kept]
    return state.runner.logits(hidden, state.argmax_only)[kept]


def score_rows(states: list[DecodeState], drafts: list[Draft]) -> torch.Tensor:
    """Target logits ``[m, K + 1, vocab]`` for a batch of chains; row ``b``'s first ``k_b + 1`` are its own.

    When every draft carries its ``k_b + 1`` exit states of one exit layer ``E`` (a batched
    early-exit round), only layers ``[E, L)`` run; otherwise every layer runs on each row's
    ``[last_token, *draft]``. Shorter rows are padded (their padded outputs are never read,
    and the slots they write lie beyond the row's text, to be overwritten).
    """
    runner, device = states[0].runner, states[0].runner.device
    cache = states[0].cache
    assert cache.batched  # a batch's rows
    width = max(len(draft) for draft in drafts) + 1
    base = torch.tensor([state.position for state in states], device=device)
    positions = base[:, None] + torch.arange(width, device=device)[None]  # [m, K + 1]
    exit_layers = {
        d.exit_layer if d.exit_states is not None and d.exit_states.shape[1] == len(d) + 1 else -1 for d in drafts
    }
    if len(exit_layers) == 1 and min(exit_layers) > 0:
        exit_layer = exit_layers.pop()
        rows = []
        for draft in drafts:
            assert draft.exit_states is not None
            states_b = draft.exit_states  # [1, k_b + 1, hidden]
            pad = width - states_b.shape[1]
            rows.append(torch.cat([states_b, states_b[:, -1:].expand(-1, pad, -1)], dim=1) if pad else states_b)
        hidden = runner.run_rows(torch.cat(rows), exit_layer, runner.num_layers, positions, cache)
    else:
        # pad each row's [last_token, *draft] with its last token (outputs ignored)
        padded = [[state.last_token, *draft.tokens] for state, draft in zip(states, drafts, strict=True)]
        ids = torch.tensor([seq + [seq[-1]] * (width - len(seq)) for seq in padded], device=device)
        hidden = runner.run_rows(runner.embed(ids), 0, runner.num_layers, positions, cache)
    return runner.row_logits(hidden)
