"""Greedy output equals transformers' ``generate`` for every architecture, exit layer and draft
length, in float64, on models whose drafts are mostly accepted and mostly rejected."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, VOCAB, lean_and_module_logits, make_model, reference_greedy

from selfspec import SpeculativeEngine

PROMPT_LENGTHS = (1, 7, 20)
MAX_NEW = 24


def prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("agreeing", [True, False], ids=["accepting", "rejecting"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_equals_generate(arch: str, agreeing: bool) -> None:
    model = make_model(arch, agreeing=agreeing)
    accepted = rejected = 0
    for prompt in prompts():
        reference = reference_greedy(model, prompt, MAX_NEW)
        # draft lengths: 1, a few, and more than the tokens left
        for exit_layer in (1, 3, 5):
            for num_draft in (1, 3, MAX_NEW + 5):
                engine = SpeculativeEngine(
                    model, exit_layer=exit_layer, num_draft_tokens=num_draft, drafter="early_exit"
                )
                out = engine.generate_ids(prompt, max_new_tokens=MAX_NEW)
                assert out.token_ids == reference, (arch, exit_layer, num_draft, len(prompt))
                assert out.finish_reason == ("stop" if reference[-1] == 2 else "length")
                accepted += out.stats.num_accepted
                rejected += out.stats.num_drafted - out.stats.num_accepted
        plain = SpeculativeEngine(model, drafter="none").generate_ids(prompt, max_new_tokens=MAX_NEW)
        assert plain.token_ids == reference
        assert plain.stats.mean_accepted_length == 1.0
    # both paths of acceptance were exercised on this architecture
    assert accepted > 0 and rejected > 0


def test_eos_ends_generation_like_generate() -> None:
    model = make_model("llama")
    prompt = prompts()[1]
    reference = reference_greedy(model, prompt, 16)
    eos = reference[5]  # make the 6th generated token the end-of-sequence token
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    expected = reference_greedy(model, prompt, 16)
    assert expected[-1] == eos and len(expected) <= 6
    out = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=4, drafter="early_exit").generate_ids(
        prompt, max_new_tokens=16
    )
    assert out.token_ids == expected
    assert out.finish_reason == "stop"


def test_max_new_tokens_one() -> None:
    model = make_model("qwen2")
    prompt = prompts()[2]
    out = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=4, drafter="early_exit").generate_ids(
        prompt, max_new_tokens=1
    )
    assert out.token_ids == reference_greedy(model, prompt, 1)
    assert out.stats.target_forwards == 1


def test_cache_positions_stay_consistent_over_long_generation() -> None:
    """A long run crosses the sliding window many times; every round's rollback must be exact."""
    model = make_model("mistral", max_position_embeddings=512)
    prompt = prompts()[1]
    reference = reference_greedy(model, prompt, 120)
    out = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=5, drafter="early_exit").generate_ids(
        prompt, max_new_tokens=120
    )
    assert out.token_ids == reference


def test_sampling_same_seed_same_text() -> None:
    model = make_model("llama")
    engine = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit")
    prompt = prompts()[1]
    first = engine.generate_ids(prompt, max_new_tokens=20, temperature=0.9, seed=123)
    second = engine.generate_ids(prompt, max_new_tokens=20, temperature=0.9, seed=123)
    other = [engine.generate_ids(prompt, max_new_tokens=20, temperature=0.9, seed=s).token_ids for s in range(5)]
    assert first.token_ids == second.token_ids
    assert len({tuple(t) for t in other}) > 1  # sampling does vary with the seed


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_fast_path_is_bitwise_identical_to_the_model_in_float32(arch: str) -> None:
    """The lean layer path computes the same float32 numbers as transformers' own modules."""
    from selfspec.modeling import ModelRunner

    model = make_model(arch, dtype=torch.float32, agreeing=False)
    adapter = ModelRunner(model)
    assert adapter.fast_layers is not None
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    outputs = lean_and_module_logits(adapter, ids)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    with torch.inference_mode():
        assert torch.equal(outputs[1][0], model(ids).logits[0].float())


def test_fast_path_is_off_where_it_does_not_apply() -> None:
    from selfspec.modeling import ModelRunner

    assert ModelRunner(make_model("gemma2")).fast_layers is None  # eager attention, sandwich norms
    assert ModelRunner(make_model("gemma")).fast_layers is None
