"""Tool-call parsers on real-format strings, the streaming parser, and tool-schema normalisation."""

from __future__ import annotations

import json
import random

import pytest

from selfspec.serving.tools import (
    ContentDelta,
    InvalidToolCall,
    ToolCall,
    ToolCallChunk,
    ToolCallStreamParser,
    parse_tool_calls,
    tool_schema,
)

HERMES_ONE = '<tool_call>{"name": "magic_function", "arguments": {"input": 3}}</tool_call>'
# Qwen2.5 writes a newline around the JSON and may say something first
QWEN_TWO = (
    "Let me check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"location": "東京"}}\n</tool_call>'
)
LLAMA_31 = '{"name": "get_weather", "parameters": {"location": "San Francisco, CA"}}'
LLAMA_31_TAGGED = '<|python_tag|>{"name": "search", "arguments": {"query": "llguidance"}}'


def test_hermes_single_call() -> None:
    parsed = parse_tool_calls(HERMES_ONE)
    assert parsed.content == "" and not parsed.invalid_tool_calls
    [call] = parsed.tool_calls
    assert (call.name, call.arguments) == ("magic_function", {"input": 3})
    assert call.id.startswith("call_") and len(call.id) == 5 + 32


def test_several_calls_with_content_and_non_ascii() -> None:
    parsed = parse_tool_calls(QWEN_TWO)
    assert parsed.content == "Let me check both cities."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", {"location": "Paris"}),
        ("get_weather", {"location": "東京"}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_llama_31_json_forms() -> None:
    [call] = parse_tool_calls(LLAMA_31).tool_calls
    assert (call.name, call.arguments) == ("get_weather", {"location": "San Francisco, CA"})
    parsed = parse_tool_calls(LLAMA_31_TAGGED)
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", {"query": "llguidance"})]
    # a JSON list of calls
    both = parse_tool_calls(f"[{LLAMA_31}, {LLAMA_31}]")
    assert len(both.tool_calls) == 2


def test_json_answers_are_content_not_calls() -> None:
    for text in ('{"setup": "Why?", "punchline": "Because."}', '{"name": "Ann", "city": "Bath"}', "[1, 2]"):
        parsed = parse_tool_calls(text)
        assert parsed.content == text and not parsed.tool_calls and not parsed.invalid_tool_calls


def test_plain_text() -> None:
    assert parse_tool_calls("  Hello there!\n") == parse_tool_calls("Hello there!")
    assert parse_tool_calls("Hello there!").content == "Hello there!"


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "add", "not valid JSON"),
        ('<tool_call>{"arguments": {"a": 1}}</tool_call>', None, "no name"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "add", "JSON object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "add", "not valid JSON"),
        ("<tool_call>not json at all</tool_call>", None, "not valid JSON"),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1}', "add", "not valid JSON"),
    ],
)
def test_malformed_calls_become_invalid(text: str, name: str | None, error: str) -> None:
    parsed = parse_tool_calls(text)
    assert not parsed.tool_calls
    [bad] = parsed.invalid_tool_calls
    assert isinstance(bad, InvalidToolCall)
    assert bad.name == name and error in bad.error and bad.id.startswith("call_")
    assert isinstance(bad.arguments, str) and bad.arguments


def test_mixed_valid_and_invalid_and_unclosed() -> None:
    text = HERMES_ONE + '\n<tool_call>{"name": "add", "arguments": {"a": 1'
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.tool_calls] == ["magic_function"]
    assert [c.name for c in parsed.invalid_tool_calls] == ["add"]
    # an unclosed but complete last block (generation ended before </tool_call>) is still read
    assert parse_tool_calls(HERMES_ONE[: -len("</tool_call>")]).tool_calls[0].arguments == {"input": 3}


def test_arguments_given_as_a_json_string_and_openai_form() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse_tool_calls(text).tool_calls[0].arguments == {"a": 1}
    text = '<tool_call>{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}</tool_call>'
    assert parse_tool_calls(text).tool_calls[0].arguments == {"a": 2}


# ---------------------------------------------------------------------------- streaming
def stream(text: str, pieces: list[str] | None = None, **kwargs: bool) -> tuple[str, dict[int, dict]]:
    parser = ToolCallStreamParser(**kwargs)
    events = []
    for piece in pieces if pieces is not None else list(text):
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, dict] = {}
    for event in events:
        if isinstance(event, ToolCallChunk):
            call = calls.setdefault(event.index, {"name": None, "arguments": "", "id": None, "chunks": 0})
            if event.name is not None:
                assert call["name"] is None, "the name comes once"
                call["name"] = event.name
            if event.id is not None:
                assert call["id"] is None, "the id comes once"
                call["id"] = event.id
            call["arguments"] += event.arguments
            call["chunks"] += 1
    for event in events:
        if isinstance(event, ContentDelta):
            assert "<tool_call>" not in event.text and "</tool_call>" not in event.text
    return content, calls


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(1, 7)
        pieces.append(text[i : i + size])
        i += size
    return pieces


@pytest.mark.parametrize(
    "text",
    [
        HERMES_ONE,
        QWEN_TWO,
        "Just text, no tools.",
        LLAMA_31,
        LLAMA_31_TAGGED,
        "Before " + HERMES_ONE + " after",
        '<tool_call>{"name": "x", "arguments": {}}',
    ],
)
def test_streamed_chunks_reassemble_to_the_parse(text: str) -> None:
    expected = parse_tool_calls(text)
    for pieces in (list(text), [text], *(random_pieces(text, seed) for seed in range(5))):
        content, calls = stream(text, pieces)
        assert content == expected.content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.name, c.arguments) for c in expected.tool_calls
        ]
        assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())


def test_arguments_stream_incrementally() -> None:
    args = '{"text": "' + "long " * 20 + '"}'
    text = f'<tool_call>{{"name": "echo", "arguments": {args}}}</tool_call>'
    parser = ToolCallStreamParser()
    head = text[: text.index(args) + len(args)]

    def sent(piece: str) -> str:
        return "".join(e.arguments for e in parser.feed(piece) if isinstance(e, ToolCallChunk))

    seen = "".join(sent(ch) for ch in head)
    assert seen == args[:-1]  # all but a "}" that might close the outer object
    seen += sent("}")
    assert seen == args  # now the outer "}" is held instead
    _, calls = stream(text)
    assert calls[0]["arguments"] == args and calls[0]["chunks"] > 10


def test_malformed_block_streams_as_one_chunk_with_raw_arguments() -> None:
    text = "<tool_call>not json</tool_call>"
    content, calls = stream(text)
    assert content == "" and calls[0]["name"] is None and calls[0]["arguments"] == "not json"


def test_partial_tag_that_is_not_a_tag_is_content() -> None:
    content, calls = stream("a <tool and <b> c")
    assert content == "a <tool and <b> c" and not calls


def test_llama_json_detection_can_be_disabled() -> None:
    content, calls = stream(LLAMA_31, llama_json=False)
    assert content == LLAMA_31 and not calls


def test_json_answer_is_content_when_streamed() -> None:
    text = '{"setup": "Why?", "punchline": "Because."}'
    assert stream(text) == (text, {})


# ---------------------------------------------------------------------------- schemas
def test_tool_schema_forms() -> None:
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    expected = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": parameters}}
    assert tool_schema(expected) == expected
    assert tool_schema({"name": "add", "description": "Add.", "parameters": parameters}) == expected
    assert tool_schema({"name": "add", "description": "Add.", "input_schema": parameters}) == expected
    assert tool_schema({"title": "add", "description": "Add.", **parameters}) == expected
    bare = tool_schema({"name": "ping"})
    assert bare["function"] == {"name": "ping", "description": "", "parameters": {"type": "object", "properties": {}}}
    # missing "type" is filled in, the input is not modified
    given = {"name": "f", "parameters": {"properties": {}}}
    assert tool_schema(given)["function"]["parameters"]["type"] == "object"
    assert "type" not in given["parameters"]


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        ("add", "must be a dict"),
        ({"description": "no name"}, "cannot read this tool"),
        ({"type": "function", "function": "add"}, "'function' dict"),
        ({"name": "has space"}, "invalid tool name"),
        ({"name": ""}, "invalid tool name"),
        ({"name": "f", "parameters": {"type": "array"}}, "object schema"),
        ({"name": "f", "parameters": []}, "JSON schema dict"),
        ({"name": "f", "parameters": {"properties": {"a": 1}}}, "'properties'"),
        ({"name": "f", "parameters": {"properties": {}, "required": ["a"]}}, "undeclared"),
        ({"name": "f", "parameters": {"properties": {}, "required": "a"}}, "'required'"),
        ({"name": "f", "description": 3}, "description"),
    ],
)
def test_tool_schema_rejects_invalid(tool: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tool_schema(tool)  # type: ignore[arg-type]


def test_tool_call_dataclasses_have_fresh_ids() -> None:
    assert ToolCall("a", {}).id != ToolCall("a", {}).id


def test_invalid_calls_carry_the_arguments_only() -> None:
    """A call cut off by max_tokens: the arguments' text, not the whole envelope."""
    [bad] = parse_tool_calls('<tool_call>{"name": "Person", "arguments": {"name": "An').invalid_tool_calls
    assert bad.name == "Person" and bad.arguments == '{"name": "An'
    [bad] = parse_tool_calls('<tool_call>{"name": "Person", "arguments": {"age": 3}').invalid_tool_calls
    assert bad.arguments == '{"age": 3}'
    [bad] = parse_tool_calls('<tool_call>{"name": "Pers').invalid_tool_calls  # cut before the arguments
    assert bad.name is None and bad.arguments == ""


#: A response template for transformers' ``parse_response``, in a format the built-in parser does not read.
CALL_TEMPLATE = {
    "version": 1,
    "start_anchor_pattern": r"\A",
    "fields": {
        "content": {},
        "tool_calls": {"open": "<call>", "close": "</call>", "content": "json", "repeats": True},
    },
}


def test_the_tokenizers_own_parser_is_used_when_it_has_one() -> None:
    import copy

    from transformers import AutoTokenizer

    from selfspec import demo_model_path

    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(demo_model_path()))
    text = 'Let me add. <call>{"name": "add", "arguments": {"a": 1, "b": 2}}</call>'
    assert parse_tool_calls(text, tokenizer=tokenizer).tool_calls == []  # no template: the built-in parser
    tokenizer.response_template = CALL_TEMPLATE
    parsed = parse_tool_calls(text, tokenizer=tokenizer)
    assert parsed.content == "Let me add."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2})]
    # what the template cannot read falls back to the built-in parser
    fallback = parse_tool_calls(
        '<call>{oops</call><tool_call>{"name": "x", "arguments": {}}</tool_call>', tokenizer=tokenizer
    )
    assert [c.name for c in fallback.tool_calls] == ["x"]
