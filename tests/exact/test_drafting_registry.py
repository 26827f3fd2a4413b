"""A drafter registered with one call works like a built-in one: alone and in a batch.

The drafter of ``docs/custom_drafter.md`` (bigram chains over the token history) is registered
with :func:`selfspec.register_drafter`; greedy output equals transformers' ``generate`` (float64)
in a single call and in a batch of four concurrent calls on a ``batching=True`` engine, which
verifies the rows together (no ``isinstance`` on drafters anywhere in the scheduler).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
from tiny_models import make_model, reference_greedy

from selfspec import Draft, Drafter, SpeculativeEngine, list_drafters, register_drafter
from selfspec.calibration import Plan, calibrate, plan_methods
from selfspec.calibration.bench import build_methods, filter_methods, method_families
from selfspec.calibration.measure import Continuations, choose_plan
from selfspec.drafting import DecodeState, unregister_drafter
from selfspec.drafting.planning import BenchRow, DrafterBench, RoundsCalibration
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


# ----------------------------------------------------------------------------- in drafter="auto" and selfspec bench


def _bigram_rows(name: str, context: Any) -> list[BenchRow]:
    return [
        BenchRow(
            f"selfspec_{name}_{cap}",
            context.engine(drafter=name, drafter_options={"max_chain": cap}, num_draft_tokens=3),
            f"bigram chains of at most {cap}",
            name,
        )
        for cap in (1, 3)
    ]


@pytest.fixture
def planned_bigram() -> Iterator[str]:
    """The docs' drafter, registered with its calibration (its own option: max_chain) and bench rows."""
    register_drafter(
        "test_bigram_auto",
        lambda engine, **options: BigramDrafter(**options),
        calibration=RoundsCalibration([{"max_chain": 1}, {"max_chain": 3}], num_draft_tokens=3),
        bench=DrafterBench(_bigram_rows, {"test_bigram_auto": "bigram chains, by cap"}),
    )
    yield "test_bigram_auto"
    unregister_drafter("test_bigram_auto")


def test_a_registered_drafter_with_an_option_is_calibrated_planned_and_run_by_auto(planned_bigram: str) -> None:
    name = planned_bigram
    model = make_model("llama")
    engine = SpeculativeEngine(model, drafter="none", calibration={})
    result = calibrate(engine, PROMPTS, save=False, progress=False, max_new_tokens=12, max_draft_tokens=3)
    (label,) = [label for label in result.candidates if label.startswith(f"{name}(")]  # measured, offered
    assert "max_chain=" in label and result.plan.method in plan_methods()
    # a measured round that always accepts the whole chain, drafted for free: it beats every built-in
    figures = {
        name: [{"options": {"max_chain": 3}, "num_draft_tokens": 3, "draft_cost": 0.0, "accepted_per_round": [3] * 40}]
    }
    data = Continuations([list(range(60))], [10])  # nothing repeats: no copies, no early-exit agreement
    plan, candidates, _ = choose_plan(data, {1: [[False] * 50]}, {1: 0.3}, {1: 1.05, 2: 1.1, 3: 1.15}, figures=figures)
    assert plan.method == name and plan.settings == {"options": {"max_chain": 3}, "num_draft_tokens": 3}
    assert round(candidates[f"{name}(max_chain=3,k=3)"], 3) == plan.predicted_speedup > 2.0
    assert "max_chain" in plan.summary()
    saved = Plan.from_json(json.loads(json.dumps(plan.to_json())))  # through selfspec.json and back
    auto = SpeculativeEngine(model, drafter="auto", calibration={"plan": saved.to_json()})  # type: ignore[union-attr]
    assert isinstance(auto.drafter, BigramDrafter) and auto.drafter.max_chain == 3
    assert auto.num_draft_tokens == 3
    for prompt in PROMPTS[:2]:
        assert auto.generate_ids(prompt, max_new_tokens=16).token_ids == reference_greedy(model, prompt, 16)


def test_a_registered_drafter_adds_its_bench_rows_and_family(planned_bigram: str) -> None:
    name = planned_bigram
    model = make_model("llama")
    engine = SpeculativeEngine(model, drafter="none", calibration={})
    assert name in method_families()
    methods = build_methods(engine, exit_layer=1, num_draft_tokens=2, lookup_tokens=2, temperatures=())
    kept = filter_methods(methods, [name])
    assert [m.name for m in kept] == ["hf_greedy", f"selfspec_{name}_1", f"selfspec_{name}_3"]
    assert all(m.family == name for m in kept[1:])
    ids, _ = kept[2].generate(PROMPTS[0], 12, 0)
    assert ids == reference_greedy(model, PROMPTS[0], 12)
