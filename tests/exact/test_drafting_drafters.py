"""Prompt lookup, the hybrid drafter, confidence stopping and adaptive draft lengths: all exact."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.decoding.controller import FALLBACK_ROUNDS, WINDOW, DraftController
from selfspec.drafting import DecodeState, EarlyExitDrafter, HybridDrafter, NgramIndex, PromptLookupDrafter


def repetitive_prompt() -> list[int]:
    gen = torch.Generator().manual_seed(3)
    span = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
    return [*span, 7, 8, *span, 9, *span[:4]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "phi3"])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "hybrid"])
def test_lookup_drafters_equal_generate(arch: str, drafter: str) -> None:
    model = make_model(arch, agreeing=False)
    for prompt in (repetitive_prompt(), list(range(10, 30))):
        reference = reference_greedy(model, prompt, 30)
        for num_draft in (1, 4, 40):
            engine = SpeculativeEngine(model, drafter=drafter, exit_layer=2, num_draft_tokens=num_draft)
            assert engine.generate_ids(prompt, max_new_tokens=30).token_ids == reference


def test_adaptive_auto_is_exact() -> None:
    model = make_model("llama")
    prompt = list(range(10, 30))
    reference = reference_greedy(model, prompt, 60)
    engine = SpeculativeEngine(model, exit_layer=2, drafter="early_exit")  # num_draft_tokens="auto"
    assert engine.adaptive and engine.draft_confidence > 0
    out = engine.generate_ids(prompt, max_new_tokens=60)
    assert out.token_ids == reference
    # the controller saw every round (how it adapts is timing-driven: unit-tested below)
    assert engine.controller.rounds > 0


def test_sampled_lookup_is_deterministic_per_seed() -> None:
    engine = SpeculativeEngine(make_model("llama"), drafter="hybrid", num_draft_tokens=3)
    a = engine.generate_ids(repetitive_prompt(), max_new_tokens=20, temperature=0.8, seed=5)
    b = engine.generate_ids(repetitive_prompt(), max_new_tokens=20, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids


def reference_lookup(ids: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    for n in range(min(max_ngram, len(ids)), min_ngram - 1, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == tail:
                return ids[start + n : start + n + k]
    return []


def test_ngram_index_matches_a_plain_scan() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (200,), generator=gen).tolist()
    index = NgramIndex(max_ngram=3)
    for end in range(1, len(ids) + 1):
        prefix = ids[:end]
        index.update(prefix)
        assert index.lookup(prefix, 1, 4) == reference_lookup(prefix, 3, 1, 4), end


def state_for(tokens: list[int], model) -> DecodeState:
    from selfspec.core.sampling import SamplingParams
    from selfspec.modeling import ModelRunner

    adapter = ModelRunner(model)
    cache = adapter.new_cache(64)
    # the cache must hold every position before the last token for the early-exit path
    ids = torch.tensor([tokens[:-1]])
    adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, torch.arange(len(tokens) - 1), cache)
    return DecodeState(adapter, cache, len(tokens) - 1, tokens[-1], list(tokens), SamplingParams(), None)


def test_hybrid_copies_repeated_spans_and_drafts_fresh_text() -> None:
    model = make_model("llama")
    hybrid = HybridDrafter(exit_layer=2)
    repeated = [20, 21, 22, 23, 24, 25, 30, 31, 20, 21, 22]
    with torch.inference_mode():
        copied = hybrid.propose(state_for(repeated, model), 3)
        assert copied.tokens == [23, 24, 25] and copied.exit_states is None
        fresh = hybrid.propose(state_for([40, 41, 42, 43, 44], model), 3)
    assert len(fresh.tokens) == 3 and fresh.exit_states is not None


def test_hybrid_learns_which_source_pays_in_this_generation() -> None:
    """Lookups that keep failing give way to the early exit (with a periodic retry); lookups that
    keep landing are preferred. The record is settled from the text that followed each draft."""
    model = make_model("llama")
    hybrid = HybridDrafter(exit_layer=2)
    hybrid._draft_cost = 0.1  # an early-exit token at a tenth of a step (the tiny model's head dominates)
    repeated = [20, 21, 22, 23, 24, 25, 30, 31, 20, 21, 22]
    with torch.inference_mode():
        state = state_for(repeated, model)
        first = hybrid.propose(state, 3)
    assert first.tokens == [23, 24, 25]  # a fresh generation trusts a match
    # the target rejected the copy at once: settled from the emitted text on the next call
    state.token_ids.extend([99, 20, 21, 22])
    book = hybrid._book(state)
    assert book.lookup.rate < 0.5 and book.pending == []
    for _ in range(6):
        book.lookup.record(3, 0)
    choices = [hybrid.choose(state, [23, 24, 25], 3) for _ in range(16)]
    assert choices.count("early_exit") == 14 and choices.count("lookup") == 2  # probes
    for _ in range(12):
        book.lookup.record(3, 3)
    assert hybrid.choose(state, [23, 24, 25], 3) == "lookup"


def test_hybrid_prices_both_sources_on_the_calibrated_verify_curve() -> None:
    """A lookup round costs the verify of its copy; an early-exit round its drafts plus that verify.

    With the same acceptance records, a curve on which verifying is cheap takes the free copy,
    and a steep one (verifying 3 drafts at 6 plain steps) takes the early exit, whose fresher
    drafts are accepted more often: the choice follows the measured costs, not a fixed guess.
    """
    from selfspec.core.speed import CostModel

    model = make_model("llama")
    repeated = [20, 21, 22, 23, 24, 25, 30, 31, 20, 21, 22]
    choices = {}
    for curve in ({3: 1.0}, {3: 6.0}):
        hybrid = HybridDrafter(exit_layer=2, costs=CostModel(0.3, curve))
        with torch.inference_mode():
            state = state_for(repeated, model)
        book = hybrid._book(state)
        book.lookup.accepted, book.lookup.rejected = 1.0, 1.0  # per-token acceptance 0.5
        book.early_exit.accepted, book.early_exit.rejected = 1.2, 0.8  # 0.6
        choices[curve[3]] = hybrid.choose(state, [23, 24, 25], 3)
    assert choices == {1.0: "lookup", 6.0: "early_exit"}


def test_prompt_lookup_proposes_nothing_without_a_match() -> None:
    model = make_model("llama")
    with torch.inference_mode():
        draft = PromptLookupDrafter().propose(state_for([40, 41, 42, 43], model), 4)
    assert draft.tokens == []


def test_confidence_threshold_shortens_drafts() -> None:
    model = make_model("llama", agreeing=False)
    with torch.inference_mode():
        sure = EarlyExitDrafter(2, confidence=0.0).propose(state_for([40, 41, 42, 43], model), 6)
        unsure = EarlyExitDrafter(2, confidence=0.999).propose(state_for([40, 41, 42, 43], model), 6)
    assert len(sure) == 6 and len(unsure) == 1


def test_controller_falls_back_when_speculation_is_slower_and_probes_again() -> None:
    controller = DraftController(4, adaptive=True)
    assert controller.budget() == 0  # measures a plain step first
    controller.record(0, 0, 1, seconds=0.010)  # plain: 10 ms per token
    assert controller.budget() == 4
    for _ in range(WINDOW - 1):  # one bad round is not enough: a window of them is
        controller.record(4, 1, 2, seconds=0.060)  # speculation: 30 ms per token (one draft accepted a round)
    assert controller.fallbacks == 0
    controller.record(4, 1, 2, seconds=0.060)
    assert controller.fallbacks == 1  # the ordinary pause (a window that accepts nothing pauses longest)
    budgets = []
    for _ in range(FALLBACK_ROUNDS):
        budgets.append(controller.budget())
        controller.record(0, 0, 1, seconds=0.010)
    assert budgets == [0] * FALLBACK_ROUNDS
    assert controller.budget() > 0  # tries speculation again


def test_fixed_draft_length_never_adapts() -> None:
    controller = DraftController(3, adaptive=False)
    controller.record(3, 0, 1, seconds=1.0)
    controller.record(3, 3, 4, seconds=0.001)
    assert controller.budget() == 3


def test_same_seed_same_text_with_adaptive_drafting() -> None:
    """Adaptive draft lengths must not make a seeded sampled run irreproducible."""
    engine = SpeculativeEngine(
        make_model("llama", agreeing=False), exit_layer=2, drafter="early_exit"
    )  # "auto": adaptive
    prompt = list(range(10, 30))
    first = engine.generate_ids(prompt, max_new_tokens=40, temperature=0.9, seed=11).token_ids
    for _ in range(3):  # the engine's shared controller keeps learning from greedy calls in between
        engine.generate_ids(prompt, max_new_tokens=40)
        assert engine.generate_ids(prompt, max_new_tokens=40, temperature=0.9, seed=11).token_ids == first


def test_untimed_controller_ignores_timing() -> None:
    controller = DraftController(4, adaptive=True).for_sampling()
    assert controller.budget() == 4  # no plain probe step
    controller.record(4, 0, 1, seconds=100.0)
    assert controller.budget() == 1 and controller.fallbacks == 0  # nothing accepted: one draft, whatever the time


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_draft_model_equals_generate(arch: str) -> None:
    target = make_model(arch, agreeing=False)
    draft = make_model("llama", agreeing=False, num_hidden_layers=2, seed=1)
    for prompt in (repetitive_prompt(), list(range(10, 30))):
        reference = reference_greedy(target, prompt, 30)
        for num_draft in (1, 3, 40):
            engine = SpeculativeEngine(target, drafter="draft_model", draft_model=draft, num_draft_tokens=num_draft)
            assert engine.generate_ids(prompt, max_new_tokens=30).token_ids == reference


def test_draft_model_that_agrees_gets_accepted() -> None:
    """A draft model identical to the target: every draft is accepted (the caches stay in step)."""
    target = make_model("llama", agreeing=False)
    engine = SpeculativeEngine(target, drafter="draft_model", draft_model=target, num_draft_tokens=4)
    out = engine.generate_ids(list(range(10, 30)), max_new_tokens=30)
    assert out.token_ids == reference_greedy(target, list(range(10, 30)), 30)
    assert out.stats.acceptance_rate == 1.0 and out.stats.mean_accepted_length > 4.5  # last round is cut


def test_draft_model_errors() -> None:
    from selfspec import ConfigurationError

    target = make_model("llama")
    with pytest.raises(ConfigurationError, match="vocabulary differs"):
        SpeculativeEngine(target, drafter="draft_model", draft_model=make_model("llama", vocab_size=64))
    with pytest.raises(ConfigurationError, match="needs draft_model="):
        SpeculativeEngine(target, drafter="draft_model")
    with pytest.raises(ConfigurationError, match="only used with drafter='draft_model'"):
        SpeculativeEngine(target, draft_model=make_model("llama"), drafter="early_exit")


def test_draft_model_by_name(tmp_path) -> None:
    target, draft = tmp_path / "target", tmp_path / "draft"
    make_model("llama", dtype=torch.float32).save_pretrained(target)
    make_model("llama", dtype=torch.float32, num_hidden_layers=2, seed=3).save_pretrained(draft)
    engine = SpeculativeEngine.from_pretrained(target, drafter="draft_model", draft_model=draft, num_draft_tokens=3)
    assert engine.drafter.name == "draft_model"
    assert engine.generate_ids(list(range(10, 20)), max_new_tokens=12).token_ids == reference_greedy(
        engine.model, list(range(10, 20)), 12
    )


def test_contiguous_runs_and_default_subset() -> None:
    from selfspec.drafting import contiguous_runs, default_skip_layers

    assert contiguous_runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    assert default_skip_layers(16) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text", "phi3"])
def test_layer_skip_equals_generate(arch: str) -> None:
    model = make_model(arch)
    for prompt in (repetitive_prompt(), list(range(10, 30))):
        reference = reference_greedy(model, prompt, 30)
        for num_draft in (1, 3, 40):
            engine = SpeculativeEngine(model, drafter="layer_skip", num_draft_tokens=num_draft)
            out = engine.generate_ids(prompt, max_new_tokens=30)
            assert out.token_ids == reference
    assert out.stats.num_accepted > 0


def test_layer_skip_uses_calibrated_layers() -> None:
    engine = SpeculativeEngine(make_model("llama"), drafter="layer_skip", calibration={"layer_skip_layers": [0, 2, 5]})
    assert engine.drafter.layers == [0, 2, 5]


def test_graft_puts_the_lookup_beside_the_chain() -> None:
    from selfspec.drafting import Draft, graft

    chain = Draft(tokens=[1, 2, 3], exit_layer=2)
    tree = graft(chain, [1, 5, 6])  # shares the first token
    assert tree.tokens == [1, 2, 3, 5, 6] and tree.parents == [-1, 0, 1, 0, 3]
    tree = graft(chain, [7, 8])  # shares nothing: a second child of the root
    assert tree.tokens == [1, 2, 3, 7, 8] and tree.parents == [-1, 0, 1, -1, 3]
    assert graft(chain, [1, 2]) is chain  # nothing new
    assert graft(Draft(), [1, 2]) == Draft()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_hybrid_verifies_a_rejected_lookup_beside_the_early_exit(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy rounds where the early exit wins the choice still verify the copied continuation
    as a second branch; the text equals generate, and the lookup branch is sometimes the one kept."""
    from selfspec.decoding.engine import SpeculativeEngine as Engine

    model = make_model(arch, agreeing=False)
    prompt = repetitive_prompt()
    reference = reference_greedy(model, prompt, 40)
    engine = Engine(model, drafter="hybrid", exit_layer=2, num_draft_tokens=3)
    engine.drafter.PROBE_EVERY = 10**6  # never take the lookup alone: every match is grafted
    engine.drafter.choose = lambda state, copied, max_tokens: "early_exit"
    grafted, kept_lookup = [], []
    import selfspec.decoding.loop

    propose, accept = engine.drafter.propose, selfspec.decoding.loop.accept_tree_greedy

    def spy_propose(state, max_tokens):
        draft = propose(state, max_tokens)
        if draft.parents is not None:
            grafted.append(draft)
        return draft

    def spy_accept(tokens, parents, logits):
        acceptance = accept(tokens, parents, logits)
        chain = next(i for i, parent in enumerate(parents) if parent != i - 1)  # where the graft starts
        kept_lookup.append(any(i >= chain for i in acceptance.path))
        return acceptance

    engine.drafter.propose = spy_propose
    monkeypatch.setattr(selfspec.decoding.loop, "accept_tree_greedy", spy_accept)
    assert engine.generate_ids(prompt, max_new_tokens=40).token_ids == reference
    assert grafted, "no round grafted a lookup"
    assert any(kept_lookup), "the lookup branch never won"
    # without the graft, the same text
    plain = Engine(model, drafter="hybrid", exit_layer=2, num_draft_tokens=3)
    plain.drafter.graft_lookup = False
    assert plain.generate_ids(prompt, max_new_tokens=40).token_ids == reference
