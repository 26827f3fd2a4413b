"""The tree grower alone (drafting/tree_grower.py): children, frontier, rerank and the draft, with no model.

The drafter's forward is replaced by a fixed table of draft logits per parent token, so every
choice the grower makes can be checked by hand.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import check_tree, static_tree
from selfspec.drafting.tree_grower import ROOT, TreeGrower, grow_tree, rerank

VOCAB = 6
EOS = 5


def table_logits(parent_token: int) -> torch.Tensor:
    """Draft logits after ``parent_token``: token ``(parent + 1 + r) % 5`` has rank ``r``; EOS is second."""
    logits = torch.full((VOCAB,), -8.0)
    for rank in range(4):
        logits[(parent_token + 1 + rank) % 5] = 4.0 - 2.0 * rank
    logits[EOS] = 3.0
    return logits


def state(temperature: float = 0.0, seed: int = 0) -> Any:
    return SimpleNamespace(
        params=SamplingParams(temperature),
        generator=torch.Generator().manual_seed(seed),
        eos_token_ids={EOS},
        last_token=0,
    )


def grow(grower: TreeGrower) -> list[tuple[list[int], int]]:
    """Grow with the table; return each depth's (frontier, depth) as the grower asked for it."""
    asked: list[tuple[list[int], int]] = []

    def expand(frontier: list[int], depth: int) -> tuple[list[int], torch.Tensor]:
        asked.append((list(frontier), depth))
        return frontier, torch.stack([table_logits(grower.node(i).token) for i in frontier])

    grow_tree(grower, expand)
    return asked


def test_greedy_dynamic_tree_expands_the_most_probable_non_eos_nodes() -> None:
    grower = TreeGrower(state(), tree_nodes=5, width=2, static=False, max_depth=3)
    asked = grow(grower)
    nodes = grower.nodes
    # depth 1: the root's two most probable children, 1 then EOS
    assert [(n.token, n.parent, n.depth) for n in nodes[:2]] == [(1, ROOT, 1), (EOS, ROOT, 1)]
    # depth 2 expands only the non-EOS child; depth 3 its two children but the EOS one
    assert asked == [([ROOT], 1), ([0], 2), ([2], 3)]
    assert all(n.row is None for n in nodes)  # greedy: no draft_probs rows
    probs = torch.softmax(table_logits(0), dim=-1)
    assert nodes[0].log_prob == pytest.approx(math.log(float(probs[1])))
    keep = rerank(nodes, grower.root, 5)
    assert keep == grower.reranked() and len(keep) == 5 and grower.over_budget()
    draft = grower.draft(keep)
    check_tree(draft.tokens, draft.parents)
    assert draft.draft_probs is None and draft.tokens[0] == 1


def test_sampled_first_child_is_kept_and_others_are_one_hot() -> None:
    grower = TreeGrower(state(temperature=1.0, seed=3), tree_nodes=4, width=3, static=False, max_depth=2)
    grow(grower)
    root_children = [i for i, n in enumerate(grower.nodes) if n.parent == ROOT]
    first = grower.nodes[grower.root.first_child]
    assert grower.root.first_child == root_children[0] and first.log_prob == 0.0  # scores as its parent
    assert first.row is not None and torch.allclose(first.row, torch.softmax(table_logits(0), dim=-1))
    for i in root_children[1:]:
        row = grower.nodes[i].row
        assert row is not None and row.sum() == 1.0 and row[grower.nodes[i].token] == 1.0
    keep = grower.reranked()
    assert grower.root.first_child in keep and len(keep) <= 4
    draft = grower.draft(keep)
    assert draft.draft_probs is not None and draft.draft_probs.shape == (len(keep), VOCAB)


def test_static_tree_follows_its_shape() -> None:
    grower = TreeGrower(state(), tree_nodes=6, width=2, static=True, max_depth=3)
    grow(grower)
    shape = static_tree(6, 3, 2)
    plans = [n.plan for n in grower.nodes]
    assert len(set(plans)) == len(plans) and set(plans) <= set(range(len(shape)))
    for node in grower.nodes:  # rank r of the plan is the r-th most probable token after the parent
        parent_plan, rank = shape[node.plan]
        parent_token = 0 if parent_plan < 0 else grower.nodes[parent_plan].token
        ranked = torch.argsort(table_logits(parent_token), descending=True).tolist()
        assert node.token == ranked[rank]
        if parent_plan < 0:
            assert node.parent == ROOT
        else:
            assert grower.nodes[node.parent].plan == parent_plan
    # an EOS node (rank 1 here) is never expanded: its planned children are not grown
    assert all(grower.nodes[n.parent].token != EOS for n in grower.nodes if n.parent >= 0)
    assert not grower.over_budget()


def test_an_expand_with_no_room_stops_the_tree() -> None:
    grower = TreeGrower(state(), tree_nodes=8, width=2, static=False, max_depth=4)
    depths = []

    def expand(frontier: list[int], depth: int) -> tuple[list[int], torch.Tensor]:
        depths.append(depth)
        if depth > 1:
            return [], torch.empty(0)
        return frontier, table_logits(0)[None]

    grow_tree(grower, expand)
    assert depths == [1, 2] and {n.depth for n in grower.nodes} == {1}
