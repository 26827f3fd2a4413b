"""Sampling is lossless: the engine's output follows the target's exact distribution.

A tiny model with an 8-token vocabulary has only 8^3 = 512 possible 3-token continuations;
their exact probabilities come from the model itself (float64, the same temperature /
top-k / top-p processing). Thousands of seeded generations are compared with them by a
chi-square test. The same test rejects a deliberately lossy engine, so it can fail.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_model, scale_deep_layers

import selfspec.decoding.loop
from selfspec import Draft, Drafter, SpeculativeEngine
from selfspec.core.acceptance import Acceptance
from selfspec.core.sampling import SamplingParams, logits_to_probs
from selfspec.drafting import DecodeState

VOCAB = 8
NEW_TOKENS = 3
PROMPT = [3, 1, 4]
SAMPLES = 2500

pytestmark = pytest.mark.slow


def make_distribution_model() -> Any:
    """An 8-token Llama whose early exits partly agree with it: drafts are accepted often and
    rejected often; no end-of-sequence token, so every sequence has exactly NEW_TOKENS tokens."""
    m = make_model(
        "llama",
        agreeing=False,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
    )
    scale_deep_layers(m, start=1, factor=0.5)
    m.generation_config.eos_token_id = None
    m.config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def model():
    return make_distribution_model()


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation, from full forwards of each prefix."""
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
            ids = torch.tensor([PROMPT + list(seq)])
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()  # [NEW_TOKENS, vocab]
            step_probs = logits_to_probs(logits, params).double()
            probs[seq] = float(torch.prod(step_probs[torch.arange(NEW_TOKENS), torch.tensor(seq)]))
    return probs


def sampled_counts(engine: SpeculativeEngine, params: SamplingParams) -> Counter:
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        out = engine.generate_ids(
            PROMPT,
            max_new_tokens=NEW_TOKENS,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
        )
        counts[tuple(out.token_ids)] += 1
    return counts


def chi_square_pvalue(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square over cells with enough expected mass; the rare ones pooled into one cell."""
    observed, expected = [], []
    rare_obs = rare_exp = 0.0
    for seq, p in exact.items():
        e = p * SAMPLES
        if e >= 5:
            observed.append(counts.get(seq, 0))
            expected.append(e)
        else:
            rare_obs += counts.get(seq, 0)
            rare_exp += e
    if rare_exp > 0:
        observed.append(rare_obs)
        expected.append(rare_exp)
    else:
        assert rare_obs == 0, "sampled a continuation the target gives probability zero"
    assert sum(counts.values()) == SAMPLES
    total = sum(expected)  # float32 probabilities sum to 1 only up to ~1e-7
    expected = [e * SAMPLES / total for e in expected]
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.7, top_k=4, top_p=0.9)],
    ids=["t1", "t0.7-topk4-topp0.9"],
)
def test_early_exit_sampling_follows_target(model, params: SamplingParams) -> None:
    engine = SpeculativeEngine(model, exit_layer=1, num_draft_tokens=2, drafter="early_exit")
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    # both acceptance and rejection happen with this model
    stats = engine.generate_ids(PROMPT, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0).stats
    rates = [
        engine.generate_ids(PROMPT, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=s).stats.acceptance_rate
        for s in range(40)
    ]
    assert 0.2 < sum(rates) / len(rates) < 0.9, stats


def test_draft_model_sampling_follows_target(model) -> None:
    draft = make_model(
        "llama",
        agreeing=False,
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
        seed=7,
    )
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, drafter="draft_model", draft_model=draft, num_draft_tokens=2)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3


def test_layer_skip_sampling_follows_target(model) -> None:
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(
        model, drafter="layer_skip", calibration={"layer_skip_layers": [0, 2]}, num_draft_tokens=2
    )
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3


class BiasedDrafter(Drafter):
    """Drafts from a distribution far from the target's (mostly token 0)."""

    name = "biased"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        probs = torch.full((max_tokens, VOCAB), 0.02)
        probs[:, 0] = 1 - 0.02 * (VOCAB - 1)
        tokens = torch.multinomial(probs, 1, generator=state.generator).squeeze(-1).tolist()
        return Draft(tokens=tokens, draft_probs=probs)


class ConstantDrafter(Drafter):
    """A deterministic drafter (no probabilities): always proposes token 5."""

    name = "constant"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        return Draft(tokens=[5] * max_tokens)


@pytest.mark.parametrize("drafter", [BiasedDrafter(), ConstantDrafter()], ids=["biased", "deterministic"])
def test_bad_drafters_still_give_target_distribution(model, drafter: Drafter) -> None:
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, drafter=drafter, num_draft_tokens=2)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3


def test_the_test_rejects_a_lossy_engine(model, monkeypatch) -> None:
    """Accepting every draft outputs the draft's distribution: the chi-square test must fail."""

    def accept_everything(draft_tokens, draft_probs, target_probs, generator):
        k = draft_tokens.shape[0]
        bonus = int(torch.multinomial(target_probs[k], 1, generator=generator))
        return Acceptance(k, bonus)

    monkeypatch.setattr(selfspec.decoding.loop, "accept_sampled", accept_everything)
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, exit_layer=1, num_draft_tokens=2, drafter="early_exit")
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) < 1e-6
