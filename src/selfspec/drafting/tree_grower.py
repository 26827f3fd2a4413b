"""Growing a draft token tree depth by depth: the one grower of every tree-drafting drafter.

The early-exit tree (:mod:`selfspec.drafting.early_exit_tree`) and the EAGLE tree
(:mod:`selfspec.drafting.eagle.drafter`) differ only in the forward that scores a depth's
frontier (the target's first layers, or the EAGLE head); :func:`grow_tree` runs the rest:

1. **Score** the frontier (the drafter's ``expand``: it may drop nodes it has no room for).
2. **Children** of every frontier node (:meth:`TreeGrower.add_children`).
3. **Next frontier**: the ``width`` most probable new nodes (dynamic), or those the static
   shape expands; never an end-of-sequence node.

Two shapes:

* **dynamic** (EAGLE-2, Li et al. 2024): at each depth the ``width`` nodes with the highest
  cumulative draft probability are expanded, each proposes ``width`` children, and at the end
  all candidates are reranked by cumulative probability down to the node budget
  (:func:`rerank`). When sampling, a sampled child scores as its parent, so the tree always
  contains the chain a chain draft would have proposed (up to the budget) and can only accept
  more.
* **static**: a fixed shape from :func:`selfspec.core.tree.static_tree` (a child of rank ``r`` is
  the ``r``-th most probable token), the same every round.

Children and losslessness: greedy children are the top tokens of the draft distribution.
When sampling, a node's first child is *sampled* from the processed draft distribution (its
``draft_probs`` row is that distribution) and is always kept; the other children are the most
probable remaining tokens, chosen deterministically (one-hot rows). Each child is then drawn
from its row given everything drafted before it, and whether the sampled child exists never
depends on its value, so recursive rejection sampling
(:func:`selfspec.core.tree.accept_tree_sampled`) stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..core.sampling import logits_to_probs, sample
from ..core.tree import static_tree
from ..errors import ConfigurationError
from .base import DecodeState, Draft

TREE_SHAPES = ("dynamic", "static")
#: The root of a tree (``state.last_token``) in a frontier.
ROOT = -1


@dataclass
class TreeNode:
    """One drafted node.

    Attributes:
        token: the drafted token id.
        parent: index into the grower's nodes, :data:`ROOT` for a child of the root.
        depth: ``1`` for a child of the root.
        log_prob: cumulative draft log probability of the path to this node.
        row: the node's ``draft_probs`` row (``None`` when greedy).
        plan: the node's index in the static shape (``-1``: dynamic).
        slot: the drafter's cache entry for this node once expanded (``-1``: none).
        first_child: the sampled first child, which is kept whenever this node is.
    """

    token: int
    parent: int
    depth: int
    log_prob: float
    row: torch.Tensor | None
    plan: int = -1
    slot: int = -1
    first_child: int = -1


def plan_shape_is_dynamic(shape: str) -> bool:
    """Whether ``shape`` names the dynamic tree (and raise on an unknown shape)."""
    if shape not in TREE_SHAPES:
        raise ConfigurationError(f"tree_shape must be one of {', '.join(TREE_SHAPES)}, got {shape!r}")
    return shape == "dynamic"


def rerank(nodes: Sequence[TreeNode], root: TreeNode, tree_nodes: int) -> list[int]:
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


class TreeGrower:
    """The nodes of one draft tree as it grows, and the rules that choose them.

    Args:
        state: the generation's state (sampling parameters, random source, end tokens, ``last_token``).
        tree_nodes: the node budget (the most draft nodes, root excluded).
        width: children per expanded node and nodes expanded per depth (dynamic shape).
        static: grow the fixed shape :func:`~selfspec.core.tree.static_tree` of ``max_depth`` levels.
        max_depth: the deepest level (a dynamic tree is also at most ``tree_nodes`` deep).
    """

    def __init__(self, state: DecodeState, tree_nodes: int, width: int, static: bool, max_depth: int) -> None:
        self.state = state
        self.tree_nodes = tree_nodes
        self.width = width
        self.max_depth = max_depth if static else min(max_depth, tree_nodes)
        self.plan = static_tree(tree_nodes, max_depth, width) if static else None
        #: the planned children of each planned node (index ``plan + 1``; ``0``: the root)
        self.plan_children: list[list[int]] = [[] for _ in range((len(self.plan) if self.plan else 0) + 1)]
        for index, (parent, _rank) in enumerate(self.plan or []):
            self.plan_children[parent + 1].append(index)
        self.nodes: list[TreeNode] = []
        self.root = TreeNode(token=state.last_token, parent=ROOT, depth=0, log_prob=0.0, row=None)

    def node(self, index: int) -> TreeNode:
        """The node at ``index`` (:data:`ROOT`: the root)."""
        return self.root if index < 0 else self.nodes[index]

    def add_children(self, frontier: Sequence[int], logits: torch.Tensor, depth: int) -> list[int]:
        """Add the children of each frontier node; return the new nodes' indices.

        Args:
            frontier: the expanded nodes (:data:`ROOT` for the root).
            logits: ``[len(frontier), vocab]`` draft logits, row ``r`` scoring ``frontier[r]``'s children.
            depth: the children's depth.
        """
        params = self.state.params
        probs = torch.softmax(logits, dim=-1) if params.greedy else logits_to_probs(logits, params)
        first_new = len(self.nodes)
        for row, parent in enumerate(frontier):
            planned = self.plan_children[self.node(parent).plan + 1] if self.plan is not None else []
            count = len(planned) if self.plan is not None else self.width
            if count:
                self._add_node_children(parent, probs[row], count, planned, depth)
        if self.plan is not None and len(self.nodes) > self.tree_nodes:
            del self.nodes[self.tree_nodes :]
        return list(range(first_new, len(self.nodes)))

    def _add_node_children(
        self, parent: int, row_probs: torch.Tensor, count: int, planned: list[int], depth: int
    ) -> None:
        """Up to ``count`` children of ``parent`` from its ``[vocab]`` draft distribution ``row_probs``."""
        greedy = self.state.params.greedy
        picked: list[int] = []
        if not greedy:  # the first child is sampled; its row is the distribution
            picked.append(int(sample(row_probs.unsqueeze(0), self.state.generator)[0]))
            rest = row_probs.clone()
            rest[picked[0]] = 0.0
        else:
            rest = row_probs
        top = torch.topk(rest, min(count - len(picked), rest.shape[-1]))
        picked += [t for t, p in zip(top.indices.tolist(), top.values.tolist(), strict=True) if p > 0]
        parent_node = self.node(parent)
        for rank, (token, prob) in enumerate(zip(picked, row_probs[picked].tolist(), strict=True)):
            sampled_first = rank == 0 and not greedy
            row: torch.Tensor | None = None
            if sampled_first:
                # a sampled child scores as its parent: the sampled chain (what a chain draft
                # would propose) is kept whole, and the rest of the budget goes to extras
                row, prob = row_probs, 1.0
                parent_node.first_child = len(self.nodes)
            elif not greedy:
                row = torch.zeros_like(row_probs)
                row[token] = 1.0
            self.nodes.append(
                TreeNode(
                    token=token,
                    parent=parent,
                    depth=depth,
                    log_prob=parent_node.log_prob + math.log(max(prob, 1e-30)),
                    row=row,
                    plan=planned[rank] if self.plan is not None else -1,
                )
            )

    def full(self) -> bool:
        """Whether the static shape has used the whole node budget."""
        return self.plan is not None and len(self.nodes) >= self.tree_nodes

    def next_frontier(self, new: Sequence[int]) -> list[int]:
        """The new nodes to expand next (never an end-of-sequence one), in index order.

        Dynamic: the ``width`` most probable. Static: those the shape gives children.
        """
        nodes = self.nodes
        candidates = [i for i in new if nodes[i].token not in self.state.eos_token_ids]
        if self.plan is None:
            return sorted(sorted(candidates, key=lambda i: -nodes[i].log_prob)[: self.width])
        return [i for i in candidates if self.plan_children[nodes[i].plan + 1]]

    def over_budget(self) -> bool:
        """Whether the grown tree has more nodes than the budget (a dynamic tree, before :meth:`reranked`)."""
        return len(self.nodes) > self.tree_nodes

    def reranked(self) -> list[int]:
        """The nodes :func:`rerank` keeps within the budget (increasing indices)."""
        return rerank(self.nodes, self.root, self.tree_nodes)

    def draft(self, order: Sequence[int], exit_states: torch.Tensor | None = None, exit_layer: int = 0) -> Draft:
        """The nodes ``order`` (topological) as a tree :class:`~selfspec.drafting.Draft`."""
        nodes = self.nodes
        index = {old: new for new, old in enumerate(order)}
        draft_probs = None
        if not self.state.params.greedy and order:
            draft_probs = torch.stack([nodes[i].row for i in order])  # type: ignore[misc]
        return Draft(
            tokens=[nodes[i].token for i in order],
            draft_probs=draft_probs,
            exit_states=exit_states,
            exit_layer=exit_layer,
            parents=[index[nodes[i].parent] if nodes[i].parent >= 0 else ROOT for i in order],
        )


#: ``expand(frontier, depth)``: run the drafter's forward over the frontier's nodes (dropping those it
#: has no room for) and return the nodes it ran with their ``[len(nodes), vocab]`` draft logits.
Expand = Callable[[list[int], int], tuple[list[int], torch.Tensor]]


def grow_tree(grower: TreeGrower, expand: Expand) -> None:
    """Grow ``grower``'s tree depth by depth, ``expand`` scoring each depth's frontier."""
    frontier = [ROOT]
    for depth in range(1, grower.max_depth + 1):
        frontier, logits = expand(frontier, depth)
        if not frontier:
            break
        new = grower.add_children(frontier, logits, depth)
        if depth == grower.max_depth or grower.full():
            break
        frontier = grower.next_frontier(new)
        if not frontier:
            break
