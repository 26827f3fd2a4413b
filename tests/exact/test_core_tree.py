"""Token trees: tree attention, exact greedy and sampled decoding, cache compaction.

* A tree forward (every node at once, tree attention mask, per-node positions) equals
  separate forwards of each root-to-leaf path, in float64, for every architecture (sliding
  windows crossed; the fast path and the transformers-module path).
* Greedy decoding with early-exit trees equals transformers' ``generate``.
* Recursive rejection sampling over siblings keeps the target's distribution exactly
  (chi-square), for a pure tree loop and through the engine; a lossy variant fails the test.
* After a tree round the KV cache equals one built by a chain over the accepted text.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from test_core_acceptance import PROMPT, chi_square_pvalue, exact_distribution, sampled_counts
from test_core_acceptance import model as distribution_model  # noqa: F401  (a fixture)
from tiny_models import ARCHITECTURES, make_model, reference_greedy

import selfspec.decoding.loop
from selfspec import GenerationRequest, SpeculativeEngine
from selfspec.core.sampling import SamplingParams
from selfspec.core.tree import (
    TreeAcceptance,
    TreeMask,
    accept_tree_greedy,
    accept_tree_sampled,
    static_tree,
    tree_attention,
    tree_children,
    tree_depths,
    tree_paths,
)
from selfspec.drafting import DecodeState, Draft, Drafter
from selfspec.errors import ConfigurationError

# ------------------------------------------------------------------ pure tree helpers

trees = st.integers(0, 12).flatmap(
    lambda n: st.tuples(*(st.integers(-1, i - 1) for i in range(n))).map(list) if n else st.just([])
)


@given(trees)
def test_tree_helpers_match_plain_definitions(parents: list[int]) -> None:
    def ancestors(i: int) -> list[int]:
        chain = []
        while i >= 0:
            chain.append(i)
            i = parents[i]
        return chain

    depths = tree_depths(parents)
    assert depths == [len(ancestors(i)) for i in range(len(parents))]
    allowed = tree_attention(parents)
    for a in range(len(parents) + 1):
        expected = {0} | {j + 1 for j in ancestors(a - 1)} if a else {0}
        assert {b for b in range(len(parents) + 1) if allowed[a, b]} == expected
    leaves = [i for i in range(len(parents)) if i not in parents]
    assert sorted(path[-1] for path in tree_paths(parents)) == leaves
    for path in tree_paths(parents):
        assert path == ancestors(path[-1])[::-1]
    assert sorted(c for kids in tree_children(parents) for c in kids) == list(range(len(parents)))


@given(st.integers(1, 40), st.integers(1, 6), st.integers(1, 4))
def test_static_tree_is_a_bounded_topological_tree(nodes: int, depth: int, width: int) -> None:
    shape = static_tree(nodes, depth, width)
    parents = [p for p, _ in shape]
    assert len(shape) <= nodes and all(-1 <= p < i for i, p in enumerate(parents))
    assert max(tree_depths(parents), default=0) <= depth
    for kids in tree_children(parents):
        assert [shape[c][1] for c in kids] == list(range(len(kids)))  # ranks 0, 1, ... in order
        assert len(kids) <= width


@settings(max_examples=200)
@given(trees, st.integers(0, 2**31 - 1))
def test_accept_tree_greedy_matches_a_plain_walk(parents: list[int], seed: int) -> None:
    rng = random.Random(seed)
    vocab = 3
    tokens = [rng.randrange(vocab) for _ in parents]
    logits = torch.randn(len(parents) + 1, vocab, generator=torch.Generator().manual_seed(seed))
    result = accept_tree_greedy(tokens, parents, logits)
    # plain walk: from the root, the first child whose token is the argmax
    node, path = -1, []
    while True:
        best = int(logits[node + 1].argmax())
        nxt = [i for i in range(len(parents)) if parents[i] == node and tokens[i] == best]
        if not nxt:
            break
        node = nxt[0]
        path.append(node)
    assert result == TreeAcceptance(tuple(path), best)
    assert result.emitted(tokens) == [tokens[i] for i in path] + [best]


@settings(max_examples=200)
@given(trees, st.integers(0, 2**31 - 1), st.booleans())
def test_sampling_against_one_hot_targets_is_greedy(parents: list[int], seed: int, with_probs: bool) -> None:
    """A one-hot target leaves rejection sampling no choice: it must pick the greedy path."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 3
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen).tolist()
    target_logits = torch.randn(len(parents) + 1, vocab, generator=gen, dtype=torch.float64)
    target_probs = torch.nn.functional.one_hot(target_logits.argmax(-1), vocab).double()
    draft_probs = None
    if with_probs:  # any draft rows that give the drafted tokens some mass
        draft_probs = torch.softmax(torch.randn(len(parents), vocab, generator=gen, dtype=torch.float64), -1)
    sampled = accept_tree_sampled(tokens, parents, draft_probs, target_probs, gen)
    assert sampled == accept_tree_greedy(tokens, parents, target_logits)


# A pure "model": target and draft next-token distributions as functions of the text so far.
VOCAB = 4
LENGTH = 3


def _dist(prefix: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((prefix, salt)) % 2**31)
    return torch.softmax(sharpness * torch.randn(VOCAB, generator=g, dtype=torch.float64), dim=-1)


def target_dist(prefix: tuple[int, ...]) -> torch.Tensor:
    return _dist(prefix, 1, 1.5)


def draft_dist(prefix: tuple[int, ...]) -> torch.Tensor:
    return 0.5 * _dist(prefix, 2, 1.5) + 0.5 * target_dist(prefix)  # related, not equal


def build_iid_tree(prefix: tuple[int, ...], siblings: int, depth: int, rng: torch.Generator):
    """Each node gets ``siblings`` i.i.d. children from the draft distribution."""
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    frontier = [(-1, prefix)]
    for _ in range(depth):
        new = []
        for parent, text in frontier:
            q = draft_dist(text)
            for _ in range(siblings):
                token = int(torch.multinomial(q, 1, generator=rng))
                tokens.append(token)
                parents.append(parent)
                rows.append(q)
                new.append((len(tokens) - 1, (*text, token)))
        frontier = new
    return tokens, parents, torch.stack(rows)


def pure_tree_decode(accept, rounds_seed: int) -> tuple[int, ...]:
    rng = torch.Generator().manual_seed(rounds_seed)
    text: tuple[int, ...] = ()
    while len(text) < LENGTH:
        tokens, parents, rows = build_iid_tree(text, siblings=3, depth=2, rng=rng)
        # target rows: root, then each node's prefix
        prefixes = [text]
        for i in range(len(tokens)):
            prefixes.append((*(prefixes[parents[i] + 1]), tokens[i]))
        target = torch.stack([target_dist(p) for p in prefixes])
        result = accept(tokens, parents, rows, target, rng)
        text = (*text, *result.emitted(tokens))
    return text[:LENGTH]


def exact_pure() -> dict[tuple[int, ...], float]:
    exact = {}
    for seq in itertools.product(range(VOCAB), repeat=LENGTH):
        prob = 1.0
        for i in range(LENGTH):
            prob *= float(target_dist(seq[:i])[seq[i]])
        exact[seq] = prob
    return exact


def pure_pvalue(accept, samples: int = 3000) -> float:
    counts = Counter(pure_tree_decode(accept, seed) for seed in range(samples))
    exact = exact_pure()
    observed = [counts.get(seq, 0) for seq in exact]
    expected = [p * samples for p in exact.values()]
    return float(chisquare(observed, expected).pvalue)


def test_recursive_rejection_sampling_is_exact_on_iid_sibling_trees() -> None:
    assert pure_pvalue(accept_tree_sampled) > 1e-3


def accept_without_residual(tokens, parents, draft_probs, target_probs, generator):
    """Lossy: every sibling is judged against the original target row, not the residual."""
    children = tree_children(parents)
    node, path = -1, []
    while True:
        target = target_probs[node + 1]
        for child in children[node + 1]:
            ratio = float(target[tokens[child]] / draft_probs[child, tokens[child]])
            if float(torch.rand(1, generator=generator)) < ratio:
                path.append(child)
                node = child
                break
        else:
            return TreeAcceptance(tuple(path), int(torch.multinomial(target, 1, generator=generator)))


def test_the_pure_test_rejects_sampling_without_residuals() -> None:
    assert pure_pvalue(accept_without_residual) < 1e-6


# ------------------------------------------------------------------ tree attention


def _tree_forward_matches_paths(model, fast: bool) -> None:
    adapter = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit").runner
    if not fast:
        adapter.fast_layers = None
    elif adapter.fast_layers is None:
        pytest.skip("no fast path for this architecture")
    prompt = [(7 * i + 3) % 90 + 4 for i in range(14)]  # longer than the sliding window (12)
    tokens = [11, 12, 13, 21, 22, 31, 32, 33]
    parents = [-1, -1, 0, 0, 2, 1, 5, -1]
    root = 40
    depths = tree_depths(parents)
    start = len(prompt)
    with torch.inference_mode():
        cache = adapter.new_cache(64)
        adapter.run_layers(adapter.embed(torch.tensor([prompt])), 0, adapter.num_layers, torch.arange(start), cache)
        positions = torch.tensor([start, *(start + d for d in depths)])
        mask = TreeMask(tree_attention(parents), positions)
        ids = torch.tensor([[root, *tokens]])
        tree_out = adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, positions, cache, tree=mask)
        for path in tree_paths(parents):
            chain = adapter.new_cache(64)
            text = [*prompt, root, *(tokens[i] for i in path)]
            out = adapter.run_layers(
                adapter.embed(torch.tensor([text])), 0, adapter.num_layers, torch.arange(len(text)), chain
            )
            expected = out[0, start:]  # root, then the path's nodes
            got = tree_out[0, [0, *(1 + i for i in path)]]
            # eager attention (Gemma 2 here) takes its softmax in float32
            tol = 1e-10 if adapter.attn_implementation == "sdpa" else 1e-5
            torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_tree_forward_equals_separate_path_forwards(arch: str) -> None:
    model = make_model(arch)
    _tree_forward_matches_paths(model, fast=False)
    if arch in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        _tree_forward_matches_paths(model, fast=True)


# ------------------------------------------------------------------ greedy decoding

GREEDY_PROMPT = [5, 17, 33, 8, 9, 41, 3, 60, 22, 14]  # crosses the sliding window while decoding


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_tree_decoding_equals_generate(arch: str) -> None:
    model = make_model(arch)
    reference = reference_greedy(model, GREEDY_PROMPT, 24)
    for shape, nodes in (("dynamic", 8), ("static", 6)):
        engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=4, tree_nodes=nodes, drafter="early_exit")
        engine.drafter.tree_shape = shape
        out = engine.generate_ids(GREEDY_PROMPT, max_new_tokens=24)
        assert out.token_ids == reference, (arch, shape)
        histogram = out.stats.accepted_length_histogram
        assert sum(histogram[1:]) > 0, "no tree node was ever accepted"
        assert sum(histogram[:-1]) > 0, "every round accepted the deepest path: rejections untested"


def test_greedy_tree_with_a_disagreeing_model_and_adaptive_length() -> None:
    model = make_model("llama", agreeing=False)
    reference = reference_greedy(model, GREEDY_PROMPT, 20)
    engine = SpeculativeEngine(
        model, exit_layer=1, num_draft_tokens="auto", tree_nodes=5, calibration={}, drafter="early_exit"
    )
    assert engine.generate_ids(GREEDY_PROMPT, max_new_tokens=20).token_ids == reference


# ------------------------------------------------------------------ cache compaction


def test_cache_after_a_tree_round_equals_a_chain_over_the_accepted_text() -> None:
    model = make_model("qwen2")
    engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=4, tree_nodes=10, drafter="early_exit")
    adapter = engine.runner
    run = engine._start(GenerationRequest(prompt_ids=GREEDY_PROMPT, max_new_tokens=20, seed=0))
    rounds = engine._rounds(run)
    emitted = [*next(rounds), *next(rounds), *next(rounds)]  # the prefill, then two tree rounds
    text = [*GREEDY_PROMPT, *emitted[:-1]]  # the last emitted token is not in the cache yet
    state_cache = rounds.gi_frame.f_locals["cache"]
    assert state_cache.lengths == [len(text)] * adapter.num_layers
    chain = adapter.new_cache(64)
    with torch.inference_mode():
        adapter.run_layers(adapter.embed(torch.tensor([text])), 0, adapter.num_layers, torch.arange(len(text)), chain)
    for layer in range(adapter.num_layers):
        torch.testing.assert_close(state_cache.keys[layer][..., : len(text), :], chain.keys[layer][..., : len(text), :])
        torch.testing.assert_close(
            state_cache.values[layer][..., : len(text), :], chain.values[layer][..., : len(text), :]
        )
    rounds.close()


# ------------------------------------------------------------------ sampling through the engine


class IIDTreeDrafter(Drafter):
    """A tree of i.i.d. siblings from a fixed distribution far from the target's (like a bad head)."""

    name = "iid_tree"
    tree_nodes = 12

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        probs = torch.full((8,), 0.05)
        probs[state.last_token % 8] = 0.65
        tokens, parents, rows = [], [], []
        frontier = [-1]
        for _ in range(min(2, max_tokens)):
            new = []
            for parent in frontier:
                for token in torch.multinomial(probs, 3, replacement=True, generator=state.generator).tolist():
                    tokens.append(token)
                    parents.append(parent)
                    rows.append(probs)
                    new.append(len(tokens) - 1)
            frontier = new
        return Draft(tokens=tokens, draft_probs=torch.stack(rows), parents=parents)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drafter", "params"),
    [
        ("dynamic", SamplingParams(1.0)),
        ("static", SamplingParams(0.7, top_k=4, top_p=0.9)),
        ("iid_tree", SamplingParams(1.0)),
    ],
    ids=["early-exit-dynamic-t1", "early-exit-static-t0.7-topk4-topp0.9", "iid-siblings-t1"],
)
def test_tree_sampling_follows_target(distribution_model, drafter: str, params: SamplingParams) -> None:  # noqa: F811
    if drafter == "iid_tree":
        engine = SpeculativeEngine(distribution_model, drafter=IIDTreeDrafter(), num_draft_tokens=2)
    else:
        engine = SpeculativeEngine(
            distribution_model, exit_layer=1, num_draft_tokens=2, tree_nodes=4, drafter="early_exit"
        )
        engine.drafter.tree_shape = drafter
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(distribution_model, params)) > 1e-3
    out = engine.generate_ids(PROMPT, max_new_tokens=3, temperature=1.0, seed=0)
    assert out.stats.num_drafted > 0


@pytest.mark.slow
def test_the_engine_test_rejects_a_lossy_tree_acceptance(distribution_model, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(selfspec.decoding.loop, "accept_tree_sampled", accept_without_residual)
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(distribution_model, drafter=IIDTreeDrafter(), num_draft_tokens=2)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(distribution_model, params)) < 1e-6


# ------------------------------------------------------------------ arguments and bad trees


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "tree"])
def test_bad_tree_nodes_are_refused(bad) -> None:
    with pytest.raises(ConfigurationError, match="tree_nodes"):
        SpeculativeEngine(make_model("llama"), tree_nodes=bad, drafter="early_exit")


@pytest.mark.parametrize("drafter", ["prompt_lookup", "layer_skip", "none"])
def test_tree_nodes_with_a_drafter_that_drafts_no_trees_is_refused(drafter: str) -> None:
    with pytest.raises(ConfigurationError, match="early_exit, hybrid, medusa, eagle and eagle_hybrid drafters"):
        SpeculativeEngine(make_model("llama"), drafter=drafter, tree_nodes=4)
    # "auto" quietly means a chain for them
    assert SpeculativeEngine(make_model("llama"), drafter=drafter, tree_nodes="auto").tree_nodes is None


def test_auto_tree_nodes_reads_the_calibration() -> None:
    model = make_model("llama")
    assert SpeculativeEngine(model, tree_nodes="auto", calibration={}, drafter="early_exit").tree_nodes is None
    assert (
        SpeculativeEngine(model, tree_nodes="auto", calibration={"tree_nodes": 9}, drafter="early_exit").tree_nodes == 9
    )
    assert "tree_nodes=9" in repr(SpeculativeEngine(model, tree_nodes=9, drafter="early_exit"))


class BrokenTreeDrafter(Drafter):
    name = "broken"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        return Draft(tokens=[3, 4], parents=[1, -1])  # a child before its parent


def test_a_malformed_tree_is_a_clear_error_and_the_engine_stays_usable() -> None:
    model = make_model("llama")
    engine = SpeculativeEngine(model, drafter=BrokenTreeDrafter(), num_draft_tokens=2)
    with pytest.raises(ConfigurationError, match="parent"):
        engine.generate_ids(GREEDY_PROMPT, max_new_tokens=4)
    engine.drafter = SpeculativeEngine(model, exit_layer=2, tree_nodes=4, drafter="early_exit").drafter
    assert engine.generate_ids(GREEDY_PROMPT, max_new_tokens=8).token_ids == reference_greedy(model, GREEDY_PROMPT, 8)


def test_cli_tree_nodes_option(capsys) -> None:
    import argparse

    from selfspec.cli.args import add_engine_arguments, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, "generate", default_model="m")
    assert engine_kwargs(parser.parse_args([]))["tree_nodes"] is None
    assert engine_kwargs(parser.parse_args(["--tree-nodes", "6"]))["tree_nodes"] == 6
    assert engine_kwargs(parser.parse_args(["--tree-nodes", "auto"]))["tree_nodes"] == "auto"
    assert engine_kwargs(parser.parse_args(["--tree-nodes", "None"]))["tree_nodes"] is None
    # a malformed value is an argument error (exit status 2) at parse time, before any model loads
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--tree-nodes", "many"])
    assert exited.value.code == 2
    assert "--tree-nodes" in capsys.readouterr().err


def test_calibration_races_trees_and_auto_uses_the_choice(tmp_path) -> None:
    from selfspec.calibration.measure import calibrate, choose_tree_nodes

    assert choose_tree_nodes({"chain": 10.0, "4": 10.1, "8": 9.0}) is None  # within the margin
    assert choose_tree_nodes({"chain": 10.0, "4": 12.0, "8": 13.0}) == 8
    model = make_model("llama")
    engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=2, calibration={}, drafter="early_exit")
    result = calibrate(
        engine, [GREEDY_PROMPT], max_new_tokens=6, max_draft_tokens=2, save=False, progress=False, trees=True
    )
    assert set(result.tree_speed) == {"chain", "4", "8", "16"}
    saved = result.to_json()
    assert saved["tree_nodes"] == result.tree_nodes
    auto = SpeculativeEngine(model, tree_nodes="auto", calibration=saved, drafter="early_exit")
    assert auto.tree_nodes == result.tree_nodes
    chain_only = calibrate(engine, [GREEDY_PROMPT], max_new_tokens=4, save=False, progress=False)
    assert "tree_nodes" not in chain_only.to_json()


def test_tree_nodes_with_other_drafters() -> None:
    model = make_model("llama")
    with pytest.raises(ConfigurationError, match="tree_nodes"):
        SpeculativeEngine(model, drafter="prompt_lookup", tree_nodes=4)
    with pytest.raises(ConfigurationError, match="tree_nodes"):
        SpeculativeEngine(model, drafter=IIDTreeDrafter(), tree_nodes=4)
    assert (
        SpeculativeEngine(model, drafter="prompt_lookup", tree_nodes="auto", calibration={"tree_nodes": 4}).tree_nodes
        is None
    )
    hybrid = SpeculativeEngine(model, drafter="hybrid", exit_layer=2, num_draft_tokens=3, tree_nodes=6)
    assert hybrid.drafter.early_exit.tree_nodes == 6
    assert hybrid.generate_ids(GREEDY_PROMPT, max_new_tokens=16).token_ids == reference_greedy(model, GREEDY_PROMPT, 16)


class Forbid:
    """A grammar-like constraint that forbids a few tokens everywhere."""

    def __init__(self, forbidden: list[int]) -> None:
        self.mask = torch.ones(96, dtype=torch.bool)
        self.mask[forbidden] = False

    def allowed_tokens(self) -> torch.Tensor:
        return self.mask

    def advance(self, token_id: int) -> None:
        assert self.mask[token_id]

    def rollback(self, num_tokens: int) -> None:
        pass


def test_constrained_rounds_draft_chains_and_stay_exact() -> None:
    model = make_model("llama")
    plain = SpeculativeEngine(model, drafter="none")
    forbidden = plain.generate_ids(GREEDY_PROMPT, max_new_tokens=6).token_ids[1:4]  # tokens it would write
    expected = plain.generate_ids(GREEDY_PROMPT, max_new_tokens=16, constraint=Forbid(forbidden)).token_ids
    assert not set(expected) & set(forbidden)
    tree = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, tree_nodes=6, drafter="early_exit")
    assert tree.generate_ids(GREEDY_PROMPT, max_new_tokens=16, constraint=Forbid(forbidden)).token_ids == expected
    iid = SpeculativeEngine(model, drafter=IIDTreeDrafter(), num_draft_tokens=2)  # trees cut to chains
    assert iid.generate_ids(GREEDY_PROMPT, max_new_tokens=16, constraint=Forbid(forbidden)).token_ids == expected


def test_wide_trees_near_the_end_of_the_cache() -> None:
    model = make_model("llama")
    reference = reference_greedy(model, GREEDY_PROMPT, 12)
    for nodes in (1, 2, 40):
        engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=8, tree_nodes=nodes, drafter="early_exit")
        assert engine.generate_ids(GREEDY_PROMPT, max_new_tokens=12).token_ids == reference


def test_no_layer_runs_twice_on_a_tree_node(monkeypatch) -> None:
    """With a static tree every layer writes each node's KV exactly once (exit states reused)."""
    from selfspec.modeling.cache import StaticKVCache

    writes: Counter = Counter()
    update = StaticKVCache.update

    def counting_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        writes[layer_idx] += key_states.shape[-2]
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(StaticKVCache, "update", counting_update)
    model = make_model("llama")
    engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, tree_nodes=6, drafter="early_exit")
    engine.drafter.tree_shape = "static"
    out = engine.generate_ids(GREEDY_PROMPT, max_new_tokens=20)
    assert out.token_ids == reference_greedy(model, GREEDY_PROMPT, 20)
    assert len(set(writes.values())) == 1, writes  # shallow layers ran exactly the nodes the deep ones did
    # prefill, then per round the root and every node
    assert writes[0] == len(GREEDY_PROMPT) + out.stats.target_forwards - 1 + out.stats.num_drafted
