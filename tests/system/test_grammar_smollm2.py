"""``drafter="auto"`` with SmolLM2's plan under grammars: the engine and ``selfspec serve``.

The plan calibration picks for SmolLM2-135M-Instruct on these machines is ``eagle_hybrid`` with
k=2: the shipped EAGLE head drafts from an 8,192-token reduced vocabulary, so a grammar often
admits only tokens outside it (``<tool_call>``, most JSON punctuation runs). Structured output,
forced tools and ``tool_choice="required"`` must give the answer ``drafter="none"`` gives, greedy,
and a valid answer at T=0.7. (Before the fix: ``ValueError: token 0 is not allowed by the
grammar`` greedy, ``RuntimeError: probability tensor contains inf/nan`` sampled, a 500 from the
server.) The adapters are tested the same way in their own packages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import SHIPPED_HEADS
from selfspec.serving.grammar import json_schema_constraint, tool_call_constraint

pytestmark = pytest.mark.slow

#: The plan ``auto`` calibrates for SmolLM2 on this machine kind (README, benchmarks/results).
SMOLLM2_PLAN = {
    "method": "eagle_hybrid",
    "num_draft_tokens": 2,
    "eagle_head": str(SHIPPED_HEADS / "smollm2-135m-instruct"),
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "GetWeather",
        "description": "Get the current weather in a given location.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["location"],
        },
    },
}
ASK_PERSON = [{"role": "user", "content": "Give the name and age of a fictional person as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_NEW = 48


@pytest.fixture(scope="module")
def engines(smollm2_path: Path) -> dict[str, SpeculativeEngine]:
    """``auto`` with SmolLM2's plan, and plain decoding, over one float32 model."""
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(smollm2_path, dtype="float32", device="cpu")
    auto = SpeculativeEngine(model, tokenizer, drafter="auto", calibration={"plan": SMOLLM2_PLAN})
    assert auto.drafter.name == "eagle_hybrid", auto.drafter
    return {"auto": auto, "none": SpeculativeEngine(model, tokenizer, drafter="none")}


def constrained(engine: SpeculativeEngine, kind: str) -> tuple[list[int], Any]:
    vocab, eos = engine.runner.vocab_size, engine.eos_token_ids
    if kind == "json_schema":
        return engine.encode_prompt(ASK_PERSON), json_schema_constraint(
            engine.tokenizer, PERSON, vocab_size=vocab, eos_token_ids=eos
        )
    name = "GetWeather" if kind == "forced_tool" else None
    constraint = tool_call_constraint(
        engine.tokenizer, [WEATHER], tool_name=name, vocab_size=vocab, eos_token_ids=eos, required=True
    )
    return engine.encode_prompt(ASK_WEATHER, tools=[WEATHER]), constraint


@pytest.mark.parametrize("kind", ["json_schema", "forced_tool", "tool_required"])
def test_auto_gives_plain_decodings_structured_answer(engines: dict[str, SpeculativeEngine], kind: str) -> None:
    answers = {}
    for name, engine in engines.items():
        ids, constraint = constrained(engine, kind)
        answers[name] = engine.generate_ids(ids, max_new_tokens=MAX_NEW, constraint=constraint)
    assert answers["auto"].token_ids == answers["none"].token_ids
    assert answers["auto"].finish_reason == "stop"
    text = engines["auto"].tokenizer.decode(answers["auto"].token_ids, skip_special_tokens=False)
    if kind == "json_schema":
        assert set(json.loads(text.removesuffix("<|im_end|>"))) == {"name", "age"}
    else:
        assert '"name": "GetWeather"' in text


@pytest.mark.parametrize("kind", ["json_schema", "forced_tool", "tool_required"])
def test_auto_samples_valid_structured_answers(engines: dict[str, SpeculativeEngine], kind: str) -> None:
    engine = engines["auto"]
    for seed in range(2):
        ids, constraint = constrained(engine, kind)
        out = engine.generate_ids(ids, max_new_tokens=MAX_NEW, constraint=constraint, temperature=0.7, seed=seed)
        assert out.finish_reason == "stop", (kind, seed)
        text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=False).removesuffix("<|im_end|>")
        if kind == "json_schema":
            assert set(json.loads(text)) == {"name", "age"}
        else:
            assert text.startswith("<tool_call>") and "GetWeather" in text


def test_serve_with_auto_answers_structured_requests_like_plain(engines: dict[str, SpeculativeEngine]) -> None:
    """``selfspec serve`` over the ``auto`` engine: 200s, and the plain engine's answers."""
    pytest.importorskip("uvicorn")
    import httpx

    from selfspec.serving.server import serve_in_background

    requests = {
        "json_schema": {"messages": ASK_PERSON, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        "forced_tool": {"messages": ASK_WEATHER, "tools": [WEATHER],
                        "tool_choice": {"type": "function", "function": {"name": "GetWeather"}}},
        "tool_required": {"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required"},
    }  # fmt: skip
    answers: dict[str, dict[str, Any]] = {}
    for name, engine in engines.items():
        with serve_in_background(engine, model_id="smollm2") as root:
            for kind, body in requests.items():
                for temperature in (0.0, 0.7):
                    response = httpx.post(
                        f"{root}/v1/chat/completions",
                        json={"model": "smollm2", "max_tokens": MAX_NEW, "temperature": temperature, "seed": 1,
                              **body},
                        timeout=300,
                    )  # fmt: skip
                    assert response.status_code == 200, (name, kind, temperature, response.text)
                    message = response.json()["choices"][0]["message"]
                    for call in message.get("tool_calls") or []:
                        call.pop("id")  # a fresh id per call
                    answers[f"{name}/{kind}/{temperature}"] = message
    for kind in requests:
        assert answers[f"auto/{kind}/0.0"] == answers[f"none/{kind}/0.0"], kind
        sampled = answers[f"auto/{kind}/0.7"]
        if kind == "json_schema":
            assert set(json.loads(sampled["content"])) == {"name", "age"}
        else:
            assert sampled["tool_calls"][0]["function"]["name"] == "GetWeather"
