"""Early-exit token trees: draft a tree from the target's own exit layer.

The drafter grows the tree depth by depth. Each depth is one forward of layers ``[0, E)``
over every node it expands (the tree attention mask lets each node see the cached text and
its own ancestors), which writes those nodes' shallow-layer KV into the cache and keeps their
exit states; the verifier then runs only the nodes that were never expanded through layers
``[0, E)`` and every node through ``[E, L)``, so no layer runs twice on the same token.

Two shapes:

* **dynamic** (EAGLE-2, Li et al. 2024): at each depth the ``width`` nodes with the highest
  cumulative draft probability are expanded, each proposes ``width`` children, and at the end
  all candidates are reranked by cumulative probability down to the node budget. When
  sampling, a sampled child scores as its parent, so the tree always contains the chain a
  chain draft would have proposed (up to the budget) and can only accept more.
* **static**: a fixed shape from :func:`selfspec.core.tree.static_tree` (a child of rank ``r`` is
  the ``r``-th most probable token), the same every round.

Children and losslessness: greedy children are the top tokens of the exit layer's
distribution. When sampling, a node's first child is *sampled* from the processed draft
distribution (its ``draft_probs`` row is that distribution) and is always kept; the other
children are the most probable remaining tokens, chosen deterministically (one-hot rows).
Each child is then drawn from its row given everything drafted before it, and whether the
sampled child exists never depends on its value, so recursive rejection sampling
(:func:`selfspec.core.tree.accept_tree_sampled`) stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.sampling import logits_to_probs, sample
from ..core.tree import TreeMask, default_tree_width, static_tree
from ..errors import ConfigurationError
from .base import DecodeState, Draft
from .fitting import select_nodes

TREE_SHAPES = ("dynamic", "static")


@dataclass
class _Node:
    token: int
    parent: int  # index into the drafting list of nodes, -1 for the root
    depth: int
    log_prob: float  # cumulative draft log probability of the path to this node
    row: torch.Tensor | None  # draft_probs row (None when greedy)
    plan: int = -1  # index in the static shape
    kv: int = -1  # index among the nodes with shallow-layer KV (0 is the root), -1 if none
    first_child: int = -1  # the sampled first child, which is kept whenever this node is


def plan_shape_is_dynamic(shape: str) -> bool:
    """Whether ``shape`` names the dynamic tree (and raise on an unknown shape)."""
    if shape not in TREE_SHAPES:
        raise ConfigurationError(f"tree_shape must be one of {', '.join(TREE_SHAPES)}, got {shape!r}")
    return shape == "dynamic"


def rerank(nodes: Sequence[_Node], root: _Node, tree_nodes: int) -> list[int]:
    """EAGLE-2's rerank: the ``tree_nodes`` nodes of highest cumulative draft probability.

    A path's probability never grows along it, so the choice is closed under parents (ties go
    to the shallower node). A kept node's sampled first child is kept with it, whatever its
    value, so that sampled children stay unbiased draws. Returns increasing indices.
    """
    kept: set[int] = set()
    if root.first_child >= 0:
        kept.add(root.first_child)
    for i in sorted(range(len(nodes)), key=lambda i: (-nodes[i].log_prob, nodes[i].depth, i)):
        if len(kept) >= tree_nodes:
            break
        node = nodes[i]
        if i in kept or (node.parent >= 0 and node.parent not in kept):
            continue
        extra = [node.first_child] if node.first_child >= 0 and node.first_child not in kept else []
        if len(kept) + 1 + len(extra) > tree_nodes:
            continue
        kept.update([i, *extra])
    return sorted(kept)


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
    runner, params, cache = state.runner, state.params, state.cache
    device, start = runner.device, state.position
    width = min(width or default_tree_width(tree_nodes), tree_nodes)
    if plan_shape_is_dynamic(shape):
        max_depth = min(max_depth, tree_nodes)
    plan = static_tree(tree_nodes, max_depth, width) if shape == "static" else None
    plan_children: list[list[int]] = [[] for _ in range((len(plan) if plan else 0) + 1)]
    for index, (parent, _rank) in enumerate(plan or []):
        plan_children[parent + 1].append(index)

    nodes: list[_Node] = []
    root = _Node(token=state.last_token, parent=-1, depth=0, log_prob=0.0, row=None)
    kv_ancestors: list[list[int]] = [[0]]  # per KV entry: the KV entries it may attend to
    kv_positions: list[int] = [start]
    states: list[torch.Tensor] = []
    frontier = [-1]  # nodes expanded at this depth (-1: the root)
    for depth in range(1, max_depth + 1):
        # 1. one forward of layers [0, E) over the nodes to expand (as many as the cache holds)
        frontier = frontier[: max(0, cache.max_length - start - len(kv_positions))]
        if not frontier:
            break
        ids = [state.last_token if i < 0 else nodes[i].token for i in frontier]
        tree = None
        if depth > 1:
            for i in frontier:
                node = nodes[i]
                node.kv = len(kv_positions)
                kv_ancestors.append([*kv_ancestors[nodes[node.parent].kv if node.parent >= 0 else 0], node.kv])
                kv_positions.append(start + node.depth)
            rows = [kv_ancestors[nodes[i].kv] for i in frontier]
            allowed = torch.zeros(len(frontier), len(kv_positions), dtype=torch.bool)
            for row, entries in enumerate(rows):
                allowed[row, entries] = True
            tree = TreeMask(allowed.to(device), torch.tensor(kv_positions, device=device))
        positions = torch.full((len(frontier),), start + depth - 1, device=device)
        hidden = runner.run_layers(
            runner.embed(torch.tensor([ids], device=device)), 0, exit_layer, positions, cache, tree=tree
        )
        states.append(hidden)
        logits = runner.logits(hidden if exit_adapter is None else exit_adapter(hidden))  # [q, vocab]
        probs = torch.softmax(logits, dim=-1) if params.greedy else logits_to_probs(logits, params)

        # 2. candidate children of every expanded node
        candidates: list[tuple[_Node, bool]] = []  # (child, always kept)
        for row, parent in enumerate(frontier):
            parent_log_prob = 0.0 if parent < 0 else nodes[parent].log_prob
            if plan is not None:
                planned = plan_children[(nodes[parent].plan if parent >= 0 else -1) + 1]
                count = len(planned)
            else:
                planned, count = [], width
            if count == 0:
                continue
            row_probs = probs[row]  # [vocab]
            picked: list[int] = []
            first_row: torch.Tensor | None = None
            if not params.greedy:  # the first child is sampled; its row is the distribution
                picked.append(int(sample(row_probs.unsqueeze(0), state.generator)[0]))
                first_row = row_probs
                rest = row_probs.clone()
                rest[picked[0]] = 0.0
            else:
                rest = row_probs
            top = torch.topk(rest, min(count - len(picked), rest.shape[-1]))
            picked += [t for t, p in zip(top.indices.tolist(), top.values.tolist(), strict=True) if p > 0]
            picked_probs = row_probs[picked].tolist()
            for rank, (token, prob) in enumerate(zip(picked, picked_probs, strict=True)):
                if rank == 0 and first_row is not None:
                    draft_row: torch.Tensor | None = first_row
                elif params.greedy:
                    draft_row = None
                else:
                    draft_row = torch.zeros_like(row_probs)
                    draft_row[token] = 1.0
                if rank == 0 and first_row is not None:
                    # a sampled child scores as its parent: the sampled chain (what a chain draft
                    # would propose) is kept whole, and the rest of the budget goes to extras
                    prob = 1.0
                child = _Node(
                    token=token,
                    parent=parent,
                    depth=depth,
                    log_prob=parent_log_prob + math.log(max(prob, 1e-30)),
                    row=draft_row,
                    plan=planned[rank] if plan is not None else -1,
                )
                candidates.append((child, first_row is not None and rank == 0))

        # 3. the static shape keeps its planned children; the dynamic tree keeps every
        # candidate for now and reranks them all to the node budget at the end
        first_new = len(nodes)
        for child, protected in candidates:
            if protected:
                (nodes[child.parent] if child.parent >= 0 else root).first_child = len(nodes)
            nodes.append(child)
        if plan is not None and len(nodes) > tree_nodes:
            del nodes[tree_nodes:]

        # 4. the next depth expands the most probable new nodes (never an end-of-sequence one)
        if depth == max_depth or (plan is not None and len(nodes) >= tree_nodes):
            break
        new = [i for i in range(first_new, len(nodes)) if nodes[i].token not in state.eos_token_ids]
        if plan is None:
            frontier = sorted(sorted(new, key=lambda i: -nodes[i].log_prob)[:width])
        else:
            frontier = [i for i in new if plan_children[nodes[i].plan + 1]]
        if not frontier:
            break

    # expanded nodes (with shallow KV, in cache order) first, then the others: still topological
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i].kv < 0, nodes[i].kv, i))
    new_index = {old: new for new, old in enumerate(order)}
    tokens = [nodes[i].token for i in order]
    parents = [new_index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order]
    draft_probs = None
    if not params.greedy and nodes:
        draft_probs = torch.stack([nodes[i].row for i in order])  # type: ignore[misc]
    exit_states = torch.cat(states, dim=1)  # [1, 1 + m, hidden]: the root, then expanded nodes
    draft = Draft(
        tokens=tokens, draft_probs=draft_probs, exit_states=exit_states, exit_layer=exit_layer, parents=parents
    )
    if plan is not None or len(nodes) <= tree_nodes:
        return draft
    keep = sorted(new_index[i] for i in rerank(nodes, root, tree_nodes))
    return select_nodes(state, draft, keep)
