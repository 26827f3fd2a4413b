"""Token trees: shapes, tree attention, and lossless acceptance over a tree.

A tree draft proposes several continuations at once (SpecInfer, Miao et al. 2024; Medusa,
Cai et al. 2024; EAGLE-2, Li et al. 2024). Vocabulary, for a tree of ``n`` draft nodes:

* The **root** is the last emitted token (``state.last_token``, not in the cache yet), at
  position ``P``. Draft node ``i`` holds ``tokens[i]``; ``parents[i]`` is the index of its
  parent in ``tokens``, or ``-1`` for a child of the root. Nodes are in topological order
  (every parent before its children); siblings are tried in the order they appear.
* **Depth**: a child of the root has depth 1, and ``depth(i) = 1 + depth(parents[i])``; node
  ``i`` sits at position ``P + depth(i)``.
* **Verifier rows**: the target runs the root and every node in one forward with a tree
  attention mask (each node sees the cached text, its ancestors and itself). Row ``0`` of
  ``target_probs`` (``[n + 1, vocab]``) is the root's next-token distribution and row
  ``i + 1`` is node ``i``'s: a node's row judges its children.
* ``draft_probs[i]`` (``[n, vocab]``) is the distribution node ``i`` was drawn from, given
  everything drafted before it; ``None`` means every node was chosen deterministically
  (one-hot rows).

Greedy acceptance follows the target's argmax down the tree: the longest root-to-node path
whose tokens are the target's argmax. Sampling uses recursive rejection sampling over
siblings (SpecInfer's multi-step speculative sampling; Chen et al. 2023 for one draft): at a
node with target distribution ``t``, try its children in order, accepting child ``x`` with
probability ``min(1, t(x) / draft(x))``; after a rejection ``t <- normalize(max(0, t - draft))``
and the next sibling is tried against it; when every sibling is rejected the **recovered**
token is drawn from the residual ``t``; on acceptance descend into the child; at a leaf the
**bonus** token is drawn from the leaf's row. Each sibling must be drawn from its
``draft_probs`` row independently of the target (i.i.d. samples, or a deterministic choice
with a one-hot row); then the emitted tokens follow the target's distribution exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigurationError
from .sampling import sample


def check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raise :class:`ConfigurationError` unless ``parents`` describes a topological tree."""
    if len(parents) != len(tokens):
        raise ConfigurationError(
            f"a tree draft needs one parent per token: {len(tokens)} tokens, {len(parents)} parents"
        )
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ConfigurationError(
                f"tree node {i} has parent {parent}: parents must come before their children (-1 is the root)"
            )


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (a child of the root has depth 1)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_children(parents: Sequence[int]) -> list[list[int]]:
    """Children of the root (entry ``0``) and of node ``i`` (entry ``i + 1``), in sibling order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        children[parent + 1].append(i)
    return children


def tree_paths(parents: Sequence[int]) -> list[list[int]]:
    """Every root-to-leaf path, as node indices from the root's child down to the leaf."""
    children = tree_children(parents)
    paths: list[list[int]] = []
    for i in range(len(parents)):
        if not children[i + 1]:
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            paths.append(path[::-1])
    return paths


def tree_attention(parents: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[n + 1, n + 1]`` bool: row ``a`` may attend to column ``b`` (ancestor or self).

    Index ``0`` is the root, ``i + 1`` is node ``i``; every node sees the root.
    """
    size = len(parents) + 1
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:, 0] = True
    allowed[0, 0] = True
    for i, parent in enumerate(parents):
        allowed[i + 1] = allowed[parent + 1]  # the parent's ancestors (parents come first)
        allowed[i + 1, i + 1] = True
    return allowed.to(device) if device is not None else allowed


@dataclass(frozen=True)
class TreeMask:
    """Attention over tree nodes held at the end of the cache, for :meth:`ModelRunner.run_layers`.

    The cache holds the committed text (slot = position) followed by ``t`` tree nodes; the
    new queries see all of the committed text and those tree nodes that ``allowed`` marks
    (sliding windows still apply, by position).

    Attributes:
        allowed: ``[q, t]`` bool, query ``j`` may attend to tree node ``c`` (the last ``t``
            keys of the cache once the queries are written).
        key_positions: ``[t]`` positions of those tree nodes.
    """

    allowed: torch.Tensor
    key_positions: torch.Tensor

    def __repr__(self) -> str:
        return f"TreeMask(queries={self.allowed.shape[0]}, tree_keys={self.allowed.shape[1]})"


@dataclass(frozen=True)
class TreeAcceptance:
    """The outcome of verifying a tree.

    Attributes:
        path: accepted draft nodes from the root's child down (indices into ``tokens``).
        next_token: the recovered token (after every child of the last accepted node was
            rejected) or the bonus token (the path ends at a leaf).
    """

    path: tuple[int, ...]
    next_token: int

    @property
    def num_accepted(self) -> int:
        """How many draft tokens were kept."""
        return len(self.path)

    def emitted(self, tokens: Sequence[int]) -> list[int]:
        """The tokens this round adds to the text: the accepted path, then ``next_token``."""
        return [*(tokens[i] for i in self.path), self.next_token]


def accept_tree_greedy(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> TreeAcceptance:
    """Greedy acceptance over a tree: follow the target's argmax while a child matches it.

    Args:
        tokens: ``[n]`` draft node tokens.
        parents: ``[n]`` parent indices (``-1``: the root).
        target_logits: ``[n + 1, vocab]`` target logits (or probabilities), root row first.

    Returns:
        The longest path whose tokens equal the target's argmax, and the argmax after it.
    """
    target_tokens = target_logits.argmax(dim=-1).tolist()  # one host sync: [n + 1]
    children = tree_children(parents)
    path: list[int] = []
    node = -1
    while True:
        wanted = target_tokens[node + 1]
        match = next((c for c in children[node + 1] if tokens[c] == wanted), None)
        if match is None:
            return TreeAcceptance(tuple(path), int(wanted))
        path.append(match)
        node = match


def accept_tree_sampled(
    tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> TreeAcceptance:
    """Recursive rejection sampling over siblings (SpecInfer): lossless for any tree.

    Args:
        tokens: ``[n]`` draft node tokens.
        parents: ``[n]`` parent indices (``-1``: the root).
        draft_probs: ``[n, vocab]`` distribution each node was drawn from (given the nodes
            drafted before it), or ``None`` for deterministic nodes (one-hot rows).
        target_probs: ``[n + 1, vocab]`` target distributions, root row first.
        generator: the random source.

    Returns:
        The accepted path and the recovered or bonus token; they follow the target's
        distribution exactly.
    """
    children = tree_children(parents)
    device, dtype = target_probs.device, target_probs.dtype
    num_nodes = len(tokens)
    # one host sync for every node's first test: its target and draft probability and a uniform
    token_index = torch.tensor(list(tokens), dtype=torch.long, device=device)
    parent_rows = torch.tensor([p + 1 for p in parents], dtype=torch.long, device=device)
    uniforms = torch.rand(num_nodes, generator=generator, device=device, dtype=dtype)
    target_of = target_probs[parent_rows, token_index]  # [n]
    if draft_probs is None:
        draft_of = torch.ones_like(target_of)
    else:
        draft_of = draft_probs[torch.arange(num_nodes, device=device), token_index].to(dtype)  # [n]
    first_test = (uniforms * draft_of < target_of).tolist()  # accepted against the node's own row?
    uniform_of, draft_prob_of = uniforms.tolist(), draft_of.tolist()
    path: list[int] = []
    node = -1
    while True:
        residual: torch.Tensor | None = None  # None: the node's target row, untouched so far
        accepted = None
        for child in children[node + 1]:
            token = tokens[child]
            # accept with probability min(1, residual / draft), i.e. u * draft < residual
            if residual is None:
                ok = bool(first_test[child])
            else:
                ok = uniform_of[child] * draft_prob_of[child] < float(residual[token])
            if ok:
                accepted = child
                break
            current = target_probs[node + 1] if residual is None else residual
            if draft_probs is None:
                residual = current.clone()
                residual[token] = 0.0
            else:
                residual = torch.clamp(current - draft_probs[child].to(dtype), min=0)
            total = residual.sum()
            # a zero residual means target == draft, where rejection has probability zero
            residual = residual / total if total > 0 else target_probs[node + 1]
        if accepted is None:
            probs = target_probs[node + 1] if residual is None else residual
            return TreeAcceptance(tuple(path), int(sample(probs.unsqueeze(0), generator)[0]))
        path.append(accepted)
        node = accepted


def default_tree_width(tree_nodes: int) -> int:
    """Children per expanded node and nodes expanded per depth: ``round(sqrt(N / 2))``, >= 2."""
    return max(2, round(math.sqrt(tree_nodes / 2)))


def rank_prior(rank: int) -> float:
    """Prior chance that a node's rank-``r`` child is accepted: 0.6 for the top one, ``0.2 / r`` after."""
    return 0.6 if rank == 0 else 0.2 / rank


def static_tree(tree_nodes: int, max_depth: int, width: int | None = None) -> list[tuple[int, int]]:
    """A fixed tree shape: ``(parent, rank)`` per node, in topological order.

    Node ``i`` is the ``rank``-th most probable child of ``parent`` (``-1``: the root). The
    shape keeps the ``tree_nodes`` nodes of highest prior score, a child of rank ``r``
    scoring :func:`rank_prior` times its parent (the most probable child continues the
    chain, the others branch off it), with at most ``width`` children per node and
    ``max_depth`` levels.
    """
    width = width or default_tree_width(tree_nodes)
    # candidates: (score, depth, parent, rank); grow best-first, parents before children
    nodes: list[tuple[int, int]] = []
    depth_of: list[int] = []
    frontier: list[tuple[float, int, int]] = [(rank_prior(r), -1, r) for r in range(width)]
    while frontier and len(nodes) < tree_nodes:
        frontier.sort(key=lambda c: (-c[0], c[1], c[2]))
        score, parent, rank = frontier.pop(0)
        depth = 1 if parent < 0 else depth_of[parent] + 1
        nodes.append((parent, rank))
        depth_of.append(depth)
        if depth < max_depth:
            index = len(nodes) - 1
            frontier.extend((score * rank_prior(r), index, r) for r in range(width))
    # topological order by depth, keeping best-first order within a depth
    order = sorted(range(len(nodes)), key=lambda i: (depth_of[i], i))
    new_index = {old: new for new, old in enumerate(order)}
    # best-first puts a parent's rank-0 child before its rank-1 child: siblings stay in rank order
    return [(new_index[nodes[i][0]] if nodes[i][0] >= 0 else -1, nodes[i][1]) for i in order]
