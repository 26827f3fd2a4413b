"""Grammar constraints: valid output always, and speculation stays lossless under constraints.

A tiny random Llama (float64, deep layers scaled down so that early-exit drafts are often
accepted) with a small byte-level BPE tokenizer that has the demo model's special and
tool tokens. Schemas are bounded (``maxLength``, numeric ranges, ``maxItems``) so that even a
random model finishes the JSON within the token budget.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from tiny_models import make_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

from selfspec import SpeculativeEngine
from selfspec.core.constraints import apply_mask
from selfspec.serving.grammar import (
    GrammarConstraint,
    has_tool_call_tokens,
    json_schema_constraint,
    tool_call_constraint,
    tool_call_grammar,
)
from selfspec.serving.tools import parse_tool_calls

EOS = 2  # <|im_end|>, also the tiny models' eos
EXTRA_VOCAB = 45  # logits vocabulary beyond the tokenizer (padded embeddings), over a 32-token word

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "count"],
}

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "magic_function",
            "description": "Apply a magic function to an input.",
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "integer", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000}},
                "required": ["input"],
            },
        },
    },
    {"name": "get_weather", "description": "Weather at a place.",
     "parameters": {"type": "object", "properties": {"location": {"type": "string", "maxLength": 5}},
                    "required": ["location"]}},
    {"name": "no_args", "description": "Takes nothing.", "parameters": {"type": "object", "properties": {}}},
]


def valid_for_schema(value: Any) -> bool:
    """SCHEMA's rules, checked by hand (no jsonschema dependency)."""
    if not isinstance(value, dict) or set(value) - set(SCHEMA["properties"]):
        return False
    if not isinstance(value.get("name"), str) or len(value["name"]) > 6:
        return False
    count = value.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= 99:
        return False
    if "ok" in value and not isinstance(value["ok"], bool):
        return False
    tags = value.get("tags", [])
    return isinstance(tags, list) and len(tags) <= 3 and all(t in ("red", "blue") for t in tags)


def valid_tool_call(name: str, arguments: dict[str, Any]) -> bool:
    if name == "magic_function":
        value = arguments.get("input")
        return set(arguments) == {"input"} and isinstance(value, int) and -1000 < value < 1000
    if name == "get_weather":
        return set(arguments) == {"location"} and isinstance(arguments["location"], str)
    return name == "no_args" and arguments == {}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(with_tool_tokens=True)


def build_tokenizer(*, with_tool_tokens: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    corpus = [
        '{"name": "magic_function", "arguments": {"input": 3}}',
        '{"name": "abc", "count": 12, "ok": true, "tags": ["red", "blue"]}',
        "the weather in Paris is sunny and mild",
    ] * 10
    tok.train_from_iterator(corpus, trainer=trainer)
    if with_tool_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    assert hf.eos_token_id == EOS
    return hf


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> Any:
    return make_model("llama", vocab_size=len(tokenizer) + EXTRA_VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="module")
def engines(model: Any, tokenizer: PreTrainedTokenizerFast) -> dict[str, SpeculativeEngine]:
    return {
        "speculative": SpeculativeEngine(model, tokenizer, exit_layer=2, num_draft_tokens=4, drafter="early_exit"),
        "plain": SpeculativeEngine(model, tokenizer, drafter="none"),
    }


@pytest.fixture(scope="module", params=["accepting", "rejecting"])
def engine_pair(request: Any, model: Any, tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """Speculative and plain engines on a model whose drafts are mostly accepted, or mostly rejected."""
    if request.param == "rejecting":
        model = make_model("llama", agreeing=False, vocab_size=len(tokenizer) + EXTRA_VOCAB,
                           max_position_embeddings=512)
    return {
        "speculative": SpeculativeEngine(model, tokenizer, exit_layer=2, num_draft_tokens=4, drafter="early_exit"),
        "plain": SpeculativeEngine(model, tokenizer, drafter="none"),
        "mode": request.param,
    }


def prompt(seed: int, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(tokenizer) - 2, (6 + seed % 5,), generator=generator).tolist()


def json_constraint(engine: SpeculativeEngine) -> GrammarConstraint:
    return json_schema_constraint(
        engine.tokenizer, SCHEMA, vocab_size=engine.runner.vocab_size, eos_token_ids=engine.eos_token_ids
    )


def tools_constraint(engine: SpeculativeEngine, tool_name: str | None = None, *,
                     required: bool = True) -> GrammarConstraint:
    return tool_call_constraint(
        engine.tokenizer, TOOLS, tool_name=tool_name, vocab_size=engine.runner.vocab_size,
        eos_token_ids=engine.eos_token_ids, required=required,
    )


def decoded(engine: SpeculativeEngine, token_ids: list[int]) -> str:
    assert token_ids[-1] == EOS, "the constrained output must end with end-of-sequence"
    return engine.tokenizer.decode(token_ids[:-1])


# ---------------------------------------------------------------------------- JSON schema
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_output_is_always_valid(engines: dict[str, SpeculativeEngine], tokenizer: Any,
                                     temperature: float) -> None:
    engine = engines["speculative"]
    for seed in range(6):
        out = engine.generate_ids(prompt(seed, tokenizer), max_new_tokens=120, temperature=temperature,
                                  seed=seed, constraint=json_constraint(engine))
        assert out.finish_reason == "stop"
        value = json.loads(decoded(engine, out.token_ids))
        assert valid_for_schema(value), value


def test_speculative_equals_plain_under_json_constraint(engine_pair: dict[str, Any],
                                                        tokenizer: Any) -> None:
    spec_engine, plain_engine = engine_pair["speculative"], engine_pair["plain"]
    accepted = rejected = 0
    for seed in range(5):
        ids = prompt(seed, tokenizer)
        spec = spec_engine.generate_ids(ids, max_new_tokens=120, constraint=json_constraint(spec_engine))
        plain = plain_engine.generate_ids(ids, max_new_tokens=120, constraint=json_constraint(plain_engine))
        assert spec.token_ids == plain.token_ids
        assert spec.stats.num_drafted > 0
        accepted += spec.stats.num_accepted
        rejected += spec.stats.num_drafted - spec.stats.num_accepted
    # the path this model exercises ran under the constraint
    assert (accepted if engine_pair["mode"] == "accepting" else rejected) > 0


class ConstraintLogitsProcessor(LogitsProcessor):
    """transformers' view of the same constraint: advance on each new token, mask the logits."""

    def __init__(self, constraint: GrammarConstraint, prompt_length: int) -> None:
        self.constraint = constraint
        self.consumed = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.consumed :].tolist():
            self.constraint.advance(token)
        self.consumed = input_ids.shape[1]
        return apply_mask(scores, self.constraint.allowed_tokens())  # type: ignore[return-value]


def test_constrained_greedy_equals_transformers_generate(engines: dict[str, SpeculativeEngine],
                                                         model: Any, tokenizer: Any) -> None:
    engine = engines["speculative"]
    for seed in range(3):
        ids = prompt(seed, tokenizer)
        processor = ConstraintLogitsProcessor(json_constraint(engine), len(ids))
        reference = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=120, logits_processor=LogitsProcessorList([processor]), eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(ids):].tolist()
        out = engine.generate_ids(ids, max_new_tokens=120, constraint=json_constraint(engine))
        assert out.token_ids == reference


# ---------------------------------------------------------------------------- tool calls
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tool_call_is_always_well_formed(engines: dict[str, SpeculativeEngine], tokenizer: Any,
                                                temperature: float) -> None:
    engine = engines["speculative"]
    names = set()
    for seed in range(6):
        out = engine.generate_ids(prompt(seed, tokenizer), max_new_tokens=120, temperature=temperature,
                                  seed=seed, constraint=tools_constraint(engine))
        text = decoded(engine, out.token_ids)
        parsed = parse_tool_calls(text)
        assert parsed.content == "" and not parsed.invalid_tool_calls, text
        [call] = parsed.tool_calls
        assert valid_tool_call(call.name, call.arguments), text
        names.add(call.name)
    assert names


def test_forced_tool_name(engines: dict[str, SpeculativeEngine], tokenizer: Any) -> None:
    engine = engines["speculative"]
    for name in ("no_args", "magic_function"):
        out = engine.generate_ids(prompt(1, tokenizer), max_new_tokens=80, temperature=1.0, seed=3,
                                  constraint=tools_constraint(engine, name))
        [call] = parse_tool_calls(decoded(engine, out.token_ids)).tool_calls
        assert call.name == name and valid_tool_call(call.name, call.arguments)


def test_speculative_equals_plain_under_tool_constraint(engine_pair: dict[str, Any],
                                                        tokenizer: Any) -> None:
    spec_engine, plain_engine = engine_pair["speculative"], engine_pair["plain"]
    for seed in range(4):
        ids = prompt(seed, tokenizer)
        spec = spec_engine.generate_ids(ids, max_new_tokens=120, constraint=tools_constraint(spec_engine))
        plain = plain_engine.generate_ids(ids, max_new_tokens=120, constraint=tools_constraint(plain_engine))
        assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_optional_tool_calls_are_well_formed_when_made(engines: dict[str, SpeculativeEngine], tokenizer: Any,
                                                       temperature: float) -> None:
    engine = engines["speculative"]
    kinds = set()
    for seed in range(8):
        constraint = tools_constraint(engine, required=False)
        out = engine.generate_ids(prompt(seed, tokenizer), max_new_tokens=60, temperature=temperature,
                                  seed=seed, constraint=constraint)
        text = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text)
        assert not parsed.invalid_tool_calls, text
        assert all(valid_tool_call(c.name, c.arguments) for c in parsed.tool_calls), text
        if out.finish_reason == "stop" and parsed.tool_calls:
            assert text.rstrip().endswith("</tool_call>")
        kinds.add("call" if parsed.tool_calls else "text")
    if temperature:
        assert kinds == {"call", "text"}  # the model chose both ways


def test_optional_grammar_accepts_text_calls_and_nothing(tokenizer: Any) -> None:
    call = '<tool_call>{"name": "no_args", "arguments": {}}</tool_call>'
    for text in ["Plain words, no call.", call, "Let me see.\n" + call, call + "\n" + call]:
        assert accepts(tool_call_constraint(tokenizer, TOOLS, required=False), tokenizer, text), text
    assert tool_call_constraint(tokenizer, TOOLS, required=False).allowed_tokens()[EOS]  # empty answer
    assert not accepts(tool_call_constraint(tokenizer, TOOLS, required=False), tokenizer, call + " after")
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert not accepts(tool_call_constraint(tokenizer, TOOLS, required=False), tokenizer, bad)


def test_tool_tags_are_the_added_tokens(tokenizer: Any) -> None:
    grammar = tool_call_grammar(tokenizer, TOOLS)
    start, end = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert grammar.startswith(f"start: <[{start}]> (call_0 | call_1 | call_2) <[{end}]>")
    assert has_tool_call_tokens(tokenizer)


def test_tool_tags_spelled_out_without_added_tokens() -> None:
    plain = build_tokenizer(with_tool_tokens=False)
    assert not has_tool_call_tokens(plain)
    assert tool_call_grammar(plain, TOOLS).startswith('start: "<tool_call>" (call_0 | call_1 | call_2) "</tool_call>"')
    text = '<tool_call>{"name": "no_args", "arguments": {}}</tool_call>'
    assert accepts(tool_call_constraint(plain, TOOLS), plain, text)
    with pytest.raises(ValueError, match="single tokens"):
        tool_call_constraint(plain, TOOLS, required=False)


# ---------------------------------------------------------------------------- the protocol
def test_mask_covers_the_logits_vocabulary_and_allows_eos_at_the_end(engines: dict[str, SpeculativeEngine],
                                                                     tokenizer: Any) -> None:
    engine = engines["plain"]
    constraint = tools_constraint(engine, "no_args")
    mask = constraint.allowed_tokens()
    assert mask.dtype == torch.bool and mask.shape == (engine.runner.vocab_size,)
    assert not mask[len(tokenizer):].any()
    text = '<tool_call>{"name": "no_args", "arguments": {}}</tool_call>'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for token in ids:
        assert constraint.allowed_tokens()[token]
        constraint.advance(token)
    assert constraint.is_complete()
    assert constraint.allowed_tokens().nonzero().flatten().tolist() == [EOS]
    # drafts may run past the end: they are counted, and rolled back exactly
    constraint.advance(EOS)
    constraint.advance(EOS)
    assert constraint.allowed_tokens().nonzero().flatten().tolist() == [EOS]
    constraint.rollback(3)
    assert constraint.allowed_tokens().nonzero().flatten().tolist() == [ids[-1]]
    constraint.rollback(len(ids) - 1)
    assert constraint.allowed_tokens().nonzero().flatten().tolist() == [ids[0]]


def test_disallowed_token_raises(engines: dict[str, SpeculativeEngine]) -> None:
    constraint = json_constraint(engines["plain"])
    with pytest.raises(ValueError, match="not allowed"):
        constraint.advance(EOS)


def test_invalid_schemas_raise_value_error(tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        json_schema_constraint(tokenizer, {"type": "no-such-type"})
    with pytest.raises(ValueError, match="tool_name"):
        tool_call_constraint(tokenizer, TOOLS, tool_name="missing")
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_constraint(tokenizer, [])
    with pytest.raises(ValueError, match="object schema"):
        tool_call_constraint(tokenizer, [{"name": "f", "parameters": {"type": "string"}}])


def accepts(constraint: GrammarConstraint, tokenizer: Any, text: str) -> bool:
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not constraint.allowed_tokens()[token]:
            return False
        constraint.advance(token)
    return constraint.is_complete()


def test_schema_without_additional_properties_is_closed(tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert accepts(json_schema_constraint(tokenizer, schema), tokenizer, '{"a": 1}')
    assert not accepts(json_schema_constraint(tokenizer, schema), tokenizer, '{"b": 1}')
    opened = {**schema, "additionalProperties": True}
    assert accepts(json_schema_constraint(tokenizer, opened), tokenizer, '{"b": 1}')
    # the JSON layout is json.dumps's: no other whitespace
    assert not accepts(json_schema_constraint(tokenizer, schema), tokenizer, '{"a":1}')


def test_parallel_tool_calls_false_allows_at_most_one_call(tokenizer: Any) -> None:
    call = '<tool_call>{"name": "no_args", "arguments": {}}</tool_call>'
    for text in ["Plain words.", call, "Let me see.\n" + call]:
        assert accepts(tool_call_constraint(tokenizer, TOOLS, required=False, parallel=False), tokenizer, text)
    assert not accepts(tool_call_constraint(tokenizer, TOOLS, required=False, parallel=False), tokenizer,
                       call + "\n" + call)
    assert accepts(tool_call_constraint(tokenizer, TOOLS, required=False), tokenizer, call + "\n" + call)
    assert "calls: call\n" in tool_call_grammar(tokenizer, TOOLS, required=False, parallel=False)
