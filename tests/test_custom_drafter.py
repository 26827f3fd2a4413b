"""A drafter registered with one call works like a built-in one: alone and in a batch.

The drafter of ``docs/custom_drafter.md`` (bigram chains over the token history) is registered
with :func:`selfspec.register_drafter`; greedy output equals transformers' ``generate`` (float64)
in a single call and in a batch of four concurrent calls on a ``batching=True`` engine, which
verifies the rows together (no ``isinstance`` on drafters anywhere in the scheduler).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
from tiny_models import make_model, reference_greedy

from selfspec import Draft, Drafter, SpeculativeEngine, list_drafters, register_drafter
from selfspec.drafting import DecodeState, unregister_drafter
from selfspec.errors import ConfigurationError


class BigramDrafter(Drafter):
    """Drafts by following, from the last token, what came after each token last time."""

    name = "bigram"
    can_batch = True

    def __init__(self, max_chain: int = 8) -> None:
        self.max_chain = max_chain

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        ids = state.token_ids
        follows = dict(pairwise(ids))
        tokens, token = [], state.last_token
        while len(tokens) < min(max_tokens, self.max_chain) and token in follows:
            token = follows[token]
            tokens.append(token)
        return Draft(tokens=tokens)


@pytest.fixture
def bigram() -> Iterator[str]:
    register_drafter("test_bigram", lambda engine, **options: BigramDrafter(**options))
    yield "test_bigram"
    unregister_drafter("test_bigram")


PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [11, 12, 13, 11, 12], [20, 21, 22, 23, 20, 21]]


def test_registered_drafter_is_exact_alone_and_in_a_batch(bigram: str) -> None:
    model = make_model("llama")  # float64
    expected = [reference_greedy(model, prompt, 16) for prompt in PROMPTS]
    assert bigram in list_drafters()
    alone = SpeculativeEngine(model, drafter=bigram, num_draft_tokens=3, calibration={})
    assert isinstance(alone.drafter, BigramDrafter)
    outputs = [alone.generate_ids(prompt, max_new_tokens=16) for prompt in PROMPTS]
    assert [out.token_ids for out in outputs] == expected
    assert sum(out.stats.num_drafted for out in outputs) > 0, "the drafter never drafted"

    batched = SpeculativeEngine(model, drafter=bigram, num_draft_tokens=3, calibration={}, batching=True)
    results: dict[int, Any] = {}
    start = threading.Barrier(len(PROMPTS))

    def call(i: int) -> None:
        start.wait()
        results[i] = batched.generate_ids(PROMPTS[i], max_new_tokens=16)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [results[i].token_ids for i in range(len(PROMPTS))] == expected
    assert batched._batcher is not None and batched._batcher.rounds_run > 0


def test_drafter_options_reach_the_factory_and_bad_registrations_are_refused(bigram: str) -> None:
    model = make_model("llama")
    engine = SpeculativeEngine(model, drafter=bigram, calibration={}, drafter_options={"max_chain": 2})
    assert engine.drafter.max_chain == 2
    with pytest.raises(ConfigurationError, match="already registered"):
        register_drafter(bigram, lambda engine, **options: BigramDrafter())
    with pytest.raises(ConfigurationError, match="callable"):
        register_drafter("not_callable", 3)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="unknown drafter 'test_missing'"):
        SpeculativeEngine(model, drafter="test_missing")
