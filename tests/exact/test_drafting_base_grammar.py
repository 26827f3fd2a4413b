"""Every registered drafter is safe under every constraint, and gives the answer plain decoding gives.

A drafter's distribution may be zero where the target's is not: an EAGLE head with a reduced
draft vocabulary gives ``-inf`` outside it. Where a grammar admits only such tokens, the draft
must stop (never argmax or sample an all ``-inf`` row), and the target picks the token. The
tiny head here drafts from a vocabulary without JSON punctuation, so every structured answer
passes through such positions; ``drafter="auto"`` runs it through an ``eagle_hybrid`` plan,
like the plan calibration picks for SmolLM2 (tested on the real model in
``test_grammar_smollm2.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_serving_grammar import (
    EXTRA_VOCAB,
    SCHEMA,
    build_tokenizer,
    json_constraint,
    prompt,
    tools_constraint,
    valid_for_schema,
)
from tiny_models import make_model

from selfspec import SpeculativeEngine
from selfspec.core.sampling import SamplingParams
from selfspec.drafting import list_drafters
from selfspec.drafting.base import choose_draft_token
from selfspec.drafting.eagle.head import EagleHead, EagleHeadConfig
from selfspec.drafting.medusa.drafter import MedusaHeads
from selfspec.serving.grammar import json_schema_constraint

MAX_NEW = 40


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(with_tool_tokens=True)


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> Any:
    return make_model("llama", vocab_size=len(tokenizer) + EXTRA_VOCAB, max_position_embeddings=512)


def reduced_head(model: Any, tokenizer: Any) -> EagleHead:
    """A random EAGLE head whose draft vocabulary leaves out every token holding JSON punctuation."""
    vocab = model.config.vocab_size
    punctuation = set('{}[]":,')
    kept = [i for i in range(vocab) if i >= len(tokenizer) or not set(tokenizer.decode([i])) & punctuation]
    config = EagleHeadConfig.for_target(model)
    config.draft_vocab_size = len(kept)
    torch.manual_seed(0)
    head = EagleHead(model, config, draft_token_ids=torch.tensor(kept))
    assert len(kept) < vocab - 10, "the draft vocabulary must leave tokens out"
    return head.to(dtype=model.dtype).eval().requires_grad_(False)


def engine_for(name: str, model: Any, tokenizer: Any, tmp_path: Path) -> SpeculativeEngine:
    """An engine with drafter ``name`` and whatever that drafter needs."""
    options: dict[str, Any] = {"num_draft_tokens": 4}
    if name in ("early_exit", "hybrid"):
        options["exit_layer"] = 2
    elif name == "draft_model":
        options["draft_model"] = make_model("llama", num_hidden_layers=2, seed=1, vocab_size=model.config.vocab_size)
    elif name == "medusa":
        torch.manual_seed(0)
        options["medusa_heads"] = MedusaHeads(3, model.config.hidden_size, model.config.vocab_size).to(model.dtype)
    elif name in ("eagle", "eagle_hybrid"):
        options["eagle_head"] = reduced_head(model, tokenizer)
    elif name == "auto":  # the SmolLM2 plan's shape: EAGLE chains with lookup copies, a reduced-vocabulary head
        folder = reduced_head(model, tokenizer).save(tmp_path / "head", dtype=model.dtype)
        options["calibration"] = {"plan": {"method": "eagle_hybrid", "num_draft_tokens": 4, "eagle_head": str(folder)}}
    return SpeculativeEngine(model, tokenizer, drafter=name, **options)


@pytest.fixture(scope="module")
def plain(model: Any, tokenizer: Any) -> SpeculativeEngine:
    return SpeculativeEngine(model, tokenizer, drafter="none")


def constraints(engine: SpeculativeEngine) -> dict[str, Any]:
    return {
        "json_schema": json_constraint(engine),
        "forced_tool": tools_constraint(engine, "magic_function"),
        "tool_required": tools_constraint(engine, required=True),
    }


@pytest.mark.parametrize("name", list_drafters())
def test_every_drafter_gives_plain_decodings_structured_answer(
    name: str, model: Any, tokenizer: Any, plain: SpeculativeEngine, tmp_path: Path
) -> None:
    engine = engine_for(name, model, tokenizer, tmp_path)
    if name == "auto":
        assert engine.drafter.name == "eagle_hybrid", engine.drafter  # the plan's head, not a fallback
    for kind in ("json_schema", "forced_tool", "tool_required"):
        for seed in range(2):
            ids = prompt(seed, tokenizer)
            expected = plain.generate_ids(ids, max_new_tokens=MAX_NEW, constraint=constraints(plain)[kind])
            out = engine.generate_ids(ids, max_new_tokens=MAX_NEW, constraint=constraints(engine)[kind])
            assert out.token_ids == expected.token_ids, (name, kind, seed)


@pytest.mark.parametrize("name", list_drafters())
def test_every_drafter_samples_valid_output_under_a_schema(
    name: str, model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    engine = engine_for(name, model, tokenizer, tmp_path)
    for seed in range(3):
        constraint = json_constraint(engine)
        out = engine.generate_ids(prompt(seed, tokenizer), max_new_tokens=120, constraint=constraint,
                                  temperature=0.7, seed=seed)  # fmt: skip
        assert out.finish_reason == "stop", (name, seed, out.finish_reason)
        assert valid_for_schema(json.loads(tokenizer.decode(out.token_ids[:-1]))), (name, seed)


def test_the_reduced_head_drafts_where_it_can_and_stops_where_it_cannot(
    model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    """The head drafted (the test exercises it), and the tool grammar's punctuation is outside its vocabulary."""
    engine = engine_for("eagle", model, tokenizer, tmp_path)
    out = engine.generate_ids(prompt(0, tokenizer), max_new_tokens=MAX_NEW, constraint=tools_constraint(engine))
    assert out.stats.num_drafted > 0, out.stats
    head = engine.drafter.head  # type: ignore[attr-defined]
    brace = tokenizer.encode("{")[0]
    assert brace not in set(head.draft_token_ids.tolist())


def test_choose_draft_token_stops_on_an_empty_admissible_set(tokenizer: Any) -> None:
    """Greedy and sampled: no admissible finite logit -> ``None``, never an arbitrary or NaN pick."""
    vocab = len(tokenizer) + EXTRA_VOCAB
    constraint = json_schema_constraint(tokenizer, SCHEMA, vocab_size=vocab, eos_token_ids=[2])
    allowed = constraint.allowed_tokens()
    logits = torch.zeros(vocab)
    logits[: allowed.shape[-1]][allowed] = float("-inf")  # finite only where the grammar forbids
    for params in (SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=5)):
        assert choose_draft_token(logits, params, torch.Generator().manual_seed(0), constraint) is None
    logits[int(allowed.nonzero()[0])] = 0.0  # one admissible token left: it is the pick
    token, _ = choose_draft_token(logits, SamplingParams(temperature=0.7), torch.Generator(), constraint)  # type: ignore[misc]
    assert token == int(allowed.nonzero()[0])

