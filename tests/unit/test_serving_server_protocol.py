"""The OpenAI wire format's own checks (``serving/server/protocol.py``) and the logprobs formats: no model runs."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")

from selfspec.decoding.outputs import TokenLogprob
from selfspec.serving.server.logprobs import (
    LOWEST_LOGPROB,
    TextOffsets,
    chat_content,
    completion_logprobs,
    token_pieces,
)
from selfspec.serving.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT: dict[str, Any] = {"model": "m", "prompt": "hi"}


def refusal(model: Any, body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        model.model_validate(body).check_supported()
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("model, base", [(ChatCompletionRequest, CHAT), (CompletionRequest, TEXT)])
def test_temperature_above_two_is_refused(model: Any, base: dict[str, Any]) -> None:
    error = refusal(model, {**base, "temperature": 2.01})
    assert error.param == "temperature" and "between 0 and 2" in error.message
    for fine in (0, 1.5, 2, 2.0, None):
        model.model_validate({**base, "temperature": fine}).check_supported()


def test_chat_logprobs_bounds_and_engine_value() -> None:
    assert ChatCompletionRequest.model_validate(CHAT).engine_logprobs is None
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True}).engine_logprobs == 0
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 20}).engine_logprobs == 20
    assert (
        ChatCompletionRequest.model_validate({**CHAT, "logprobs": False, "top_logprobs": None}).engine_logprobs is None
    )
    assert refusal(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    assert refusal(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": -1}).param == "top_logprobs"
    assert "needs logprobs" in refusal(ChatCompletionRequest, {**CHAT, "top_logprobs": 3}).message


def test_completion_logprobs_bounds_and_engine_value() -> None:
    assert CompletionRequest.model_validate({**TEXT, "logprobs": 5}).engine_logprobs == 5
    assert CompletionRequest.model_validate({**TEXT, "logprobs": 0}).engine_logprobs == 0
    assert CompletionRequest.model_validate(TEXT).engine_logprobs is None
    assert refusal(CompletionRequest, {**TEXT, "logprobs": 6}).param == "logprobs"


def test_token_bytes_are_exact_for_byte_level_pieces() -> None:
    from tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    pieces = token_pieces(tokenizer)
    assert pieces.byte_level and token_pieces(tokenizer) is pieces
    text = "Café 東京 🙂 the end"
    ids = tokenizer(text)["input_ids"]
    assert b"".join(pieces.bytes_of(t) for t in ids) == text.encode("utf-8")
    partial = [t for t in ids if "\ufffd" in pieces.text_of(t)]  # byte tokens inside a character
    assert partial, "the tiny tokenizer splits some characters"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert pieces.bytes_of(im_end) == b"<|im_end|>"


def test_wire_formats() -> None:
    from tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    pieces = token_pieces(tokenizer)
    ids = tokenizer(" the end")["input_ids"]
    entries = [TokenLogprob(t, -0.5 * i, [t, 0], [-0.1, float("-inf")]) for i, t in enumerate(ids)]
    content = chat_content(pieces, entries)
    assert [c["token"] for c in content] == [pieces.text_of(t) for t in ids]
    assert content[0]["bytes"] == list(pieces.bytes_of(ids[0]))
    assert content[0]["top_logprobs"][1]["logprob"] == LOWEST_LOGPROB  # JSON has no -Infinity
    body = completion_logprobs(pieces, entries, TextOffsets(tokenizer), text_length=4)
    assert body["tokens"] == [pieces.text_of(t) for t in ids]
    assert body["token_logprobs"] == [-0.5 * i for i in range(len(ids))]
    assert body["text_offset"][0] == 0 and max(body["text_offset"]) <= 4  # capped at the text's end
    assert list(body["top_logprobs"][0].values())[-1] == LOWEST_LOGPROB


def test_legacy_functions_map_onto_tools() -> None:
    function = {"name": "f", "parameters": {"type": "object"}}
    body = ChatCompletionRequest.model_validate({**CHAT, "functions": [function], "function_call": {"name": "f"}})
    body.check_supported()
    assert body.legacy_functions and body.request_tools == [{"type": "function", "function": function}]
    assert body.request_tool_choice == {"type": "function", "function": {"name": "f"}}
    assert body.request_parallel_tool_calls is False  # one function_call per answer
    for choice in ("auto", "none", None):
        body = ChatCompletionRequest.model_validate({**CHAT, "functions": [function], "function_call": choice})
        assert body.request_tool_choice == choice
    plain = ChatCompletionRequest.model_validate({**CHAT, "tools": [{"type": "function", "function": function}]})
    assert not plain.legacy_functions and plain.request_tool_choice is None and plain.request_parallel_tool_calls
    assert refusal(ChatCompletionRequest, {**CHAT, "function_call": "auto"}).param == "function_call"
    assert refusal(ChatCompletionRequest, {**CHAT, "functions": [function], "tool_choice": "auto"}).param == "functions"
    assert refusal(ChatCompletionRequest, {**CHAT, "functions": [{"name": ""}]}).param == "functions[0]"
    assert (
        refusal(ChatCompletionRequest, {**CHAT, "functions": [function], "function_call": "f"}).param == "function_call"
    )


def test_legacy_messages_become_a_tool_call_and_its_answer() -> None:
    from selfspec.serving.server.protocol import engine_messages

    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"x": 1}'}},
        {"role": "function", "name": "f", "content": "2"},
    ]
    assert engine_messages(messages)[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "id": "call_legacy_1", "function": {"name": "f", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "call_legacy_1", "name": "f"},
    ]
    both = {**messages[1], "tool_calls": [{"id": "c", "function": {"name": "f"}}]}
    with pytest.raises(APIError, match="tool_calls or function_call, not both"):
        engine_messages([both])
    with pytest.raises(APIError, match="needs the 'name' of its function"):
        engine_messages([{"role": "function", "content": "2"}])
