"""Early-exit token trees: draft a tree from the target's own exit layer.

The drafter grows the tree depth by depth. Each depth is one forward of layers ``[0, E)``
over every node it expands (the tree attention mask lets each node see the cached text and
its own ancestors), which writes those nodes' shallow-layer KV into the cache and keeps their
exit states; the verifier then runs only the nodes that were never expanded through layers
``[0, E)`` and every node through ``[E, L)``, so no layer runs twice on the same token.

The tree's shapes (dynamic, static) and how children are chosen are the shared grower's
(:mod:`selfspec.drafting.tree_grower`); this module is the forward that scores each depth.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.tree import TreeMask, default_tree_width
from .base import DecodeState, Draft
from .fitting import select_nodes
from .tree_grower import ROOT, TreeGrower, grow_tree, plan_shape_is_dynamic


def draft_early_exit_tree(
    state: DecodeState,
    exit_layer: int,
    tree_nodes: int,
    max_depth: int,
    shape: str = "dynamic",
    width: int | None = None,
    exit_adapter: Any = None,
) -> Draft:
    """Draft a token tree with layers ``[0, exit_layer)`` of the target.

    Args:
        state: the generation's state; the cache holds positions ``< state.position``.
        exit_layer: the exit layer ``E``.
        tree_nodes: the node budget (the most draft nodes, root excluded).
        max_depth: the deepest level (the longest path that can be accepted).
        shape: ``"dynamic"`` or ``"static"``.
        width: children per expanded node and nodes expanded per depth (default
            :func:`~selfspec.core.tree.default_tree_width`).
        exit_adapter: an optional trained exit adapter applied to ``h_E`` for the draft logits
            only (the raw states are what verification continues from).

    Returns:
        A :class:`~selfspec.drafting.Draft` with ``parents`` set, ``exit_states`` of the
        root and the first ``m`` nodes (those the drafter expanded; their shallow-layer KV is
        in the cache right after the root's), and ``draft_probs`` when sampling.
    """
    runner, cache = state.runner, state.cache
    device, start = runner.device, state.position
    width = min(width or default_tree_width(tree_nodes), tree_nodes)
    grower = TreeGrower(state, tree_nodes, width, static=not plan_shape_is_dynamic(shape), max_depth=max_depth)
    nodes = grower.nodes
    kv_ancestors: list[list[int]] = [[0]]  # per KV entry (0: the root): the KV entries it may attend to
    kv_positions: list[int] = [start]
    states: list[torch.Tensor] = []

    def expand(frontier: list[int], depth: int) -> tuple[list[int], torch.Tensor]:
        """One forward of layers [0, E) over the nodes to expand (as many as the cache holds)."""
        frontier = frontier[: max(0, cache.max_length - start - len(kv_positions))]
        if not frontier:
            return frontier, torch.empty(0)
        ids = [state.last_token if i == ROOT else nodes[i].token for i in frontier]
        tree = None
        if depth > 1:
            for i in frontier:
                node = nodes[i]
                node.slot = len(kv_positions)
                kv_ancestors.append([*kv_ancestors[nodes[node.parent].slot if node.parent >= 0 else 0], node.slot])
                kv_positions.append(start + node.depth)
            allowed = torch.zeros(len(frontier), len(kv_positions), dtype=torch.bool)
            for row, i in enumerate(frontier):
                allowed[row, kv_ancestors[nodes[i].slot]] = True
            tree = TreeMask(allowed.to(device), torch.tensor(kv_positions, device=device))
        positions = torch.full((len(frontier),), start + depth - 1, device=device)
        hidden = runner.run_layers(
            runner.embed(torch.tensor([ids], device=device)), 0, exit_layer, positions, cache, tree=tree
        )
        states.append(hidden)
        return frontier, runner.logits(hidden if exit_adapter is None else exit_adapter(hidden))  # [q, vocab]

    grow_tree(grower, expand)
    # expanded nodes (with shallow KV, in cache order) first, then the others: still topological
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].slot < 0, nodes[i].slot, i))
    exit_states = torch.cat(states, dim=1)  # [1, 1 + m, hidden]: the root, then expanded nodes
    draft = grower.draft(order, exit_states=exit_states, exit_layer=exit_layer)
    if grower.plan is not None or not grower.over_budget():
        return draft
    new_index = {old: new for new, old in enumerate(order)}
    keep = sorted(new_index[i] for i in grower.reranked())
    return select_nodes(state, draft, keep)
