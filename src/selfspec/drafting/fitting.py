"""Fitting a draft to a round: cut chains and trees to the budget, keep chosen tree nodes.

These operate on a :class:`~selfspec.drafting.Draft` and, for early-exit drafts, on the
shallow-layer KV cache the drafter wrote for it, so that the result is again a well-formed
draft (its exit states match what the cache holds).
"""

from __future__ import annotations

import torch

from ..core.tree import check_tree, tree_children, tree_depths
from .base import DecodeState, Draft


def truncate_chain(draft: Draft, length: int) -> Draft:
    """A chain's first ``length`` tokens (a tree, or a short enough chain, is returned as is)."""
    if len(draft) <= length or draft.parents is not None:  # trees: truncate_tree
        return draft
    return Draft(
        tokens=draft.tokens[:length],
        draft_probs=None if draft.draft_probs is None else draft.draft_probs[:length],
        exit_states=draft.exit_states,  # the verifier uses only the first `length` states
        exit_layer=draft.exit_layer,
    )


def fit_tree(state: DecodeState, draft: Draft, max_depth: int) -> Draft:
    """A checked tree draft cut to ``max_depth`` levels and to the slots the cache has left.

    With a grammar constraint the tree becomes its chain of first children.
    """
    assert draft.parents is not None
    check_tree(draft.tokens, draft.parents)
    draft = truncate_tree(state, draft, max_depth)
    room = state.cache.max_length - state.position - 1
    if len(draft) > room:  # a topological prefix is a tree: keep what the cache holds
        draft = select_nodes(state, draft, list(range(room)))
    if state.constraint is not None:
        draft = tree_to_chain(state, draft)
    return draft


def select_nodes(state: DecodeState, draft: Draft, keep: list[int]) -> Draft:
    """The sub-tree of the nodes ``keep`` (increasing, closed under parents).

    Exit states and shallow-layer KV of dropped expanded nodes are removed, so the result is
    again a well-formed early-exit tree draft.
    """
    assert draft.parents is not None
    parents = draft.parents
    new_index = {old: new for new, old in enumerate(keep)}
    exit_states = draft.exit_states
    if exit_states is not None:
        expanded = exit_states.shape[1] - 1
        kept_expanded = [i for i in keep if i < expanded]
        if len(kept_expanded) < expanded:
            start = state.position
            state.cache.keep(start, [start, *(start + 1 + i for i in kept_expanded)], range(draft.exit_layer))
            rows = torch.tensor([0, *(1 + i for i in kept_expanded)], device=exit_states.device)
            exit_states = exit_states.index_select(1, rows)
    return Draft(
        tokens=[draft.tokens[i] for i in keep],
        draft_probs=None if draft.draft_probs is None else draft.draft_probs[keep],
        exit_states=exit_states,
        exit_layer=draft.exit_layer,
        parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
    )


def truncate_tree(state: DecodeState, draft: Draft, max_depth: int) -> Draft:
    """Drop the nodes deeper than ``max_depth``."""
    assert draft.parents is not None
    depths = tree_depths(draft.parents)
    if not depths or max(depths) <= max_depth:
        return draft
    return select_nodes(state, draft, [i for i, d in enumerate(depths) if d <= max_depth])


def tree_to_chain(state: DecodeState, draft: Draft) -> Draft:
    """The chain of first children from the root (for rounds that need a chain).

    Each first child was drawn from its own ``draft_probs`` row, so the chain is a valid
    chain draft. Its exit states are dropped (verification runs every layer) and the
    shallow-layer KV the drafter wrote is rolled back.
    """
    assert draft.parents is not None
    children = tree_children(draft.parents)
    path: list[int] = []
    while children[(path[-1] if path else -1) + 1]:
        path.append(children[(path[-1] if path else -1) + 1][0])
    if draft.exit_states is not None:
        state.cache.crop_to(state.position, range(draft.exit_layer))
    return Draft(
        tokens=[draft.tokens[i] for i in path],
        draft_probs=None if draft.draft_probs is None else draft.draft_probs[path],
    )
