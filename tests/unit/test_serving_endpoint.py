"""``selfspec.serving.endpoint`` without a server: request bodies, reading answers, error translation, keys.

The adapters' endpoint mode against a real ``selfspec serve`` is tested in each adapter's
package; these tests pin the wire format both adapters share.
"""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from selfspec.errors import InvalidPromptError, ModelNotFoundError, SamplingError  # noqa: E402
from selfspec.serving.endpoint import (  # noqa: E402
    EndpointClient,
    _StreamReader,
    chat_body,
    parse_arguments,
    read_response,
    resolve_api_key,
    text_body,
    translate_error,
)
from selfspec.serving.tools import ContentDelta, InvalidToolCall, ToolCall, ToolCallChunk, tool_schema  # noqa: E402

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def test_chat_body_is_openai_form_with_selfspec_extras_in_the_extra_body() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "id": "call_1", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "call_1", "name": "f"},
    ]
    body = chat_body(
        messages,
        model="m",
        max_tokens=5,
        temperature=0.0,
        top_k=3,
        seed=1,
        stop="x",
        tools=[TOOL],
        tool_choice="required",
        truncate_prompt=True,
        stream=True,
        constrain_tool_calls=False,
        response_format={"type": "json_schema", "schema": {"type": "object"}},
    )
    assert body["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    }
    assert body["messages"][2] == messages[2]
    assert (body["model"], body["max_tokens"], body["temperature"], body["seed"], body["stop"]) == (
        "m",
        5,
        0.0,
        1,
        ["x"],
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # the tools read as the planner reads them (normalised: an empty description added)
    assert body["tools"] == [tool_schema(TOOL)] and body["tool_choice"] == "required"
    assert body["extra_body"] == {"top_k": 3, "truncate_prompt": True, "constrain_tool_calls": False}
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"type": "object"}},
    }
    plain = chat_body([{"role": "user", "content": "hi"}], model="m")
    assert plain == {"model": "m", "temperature": 0.0, "stream": False, "messages": [{"role": "user", "content": "hi"}]}
    assert text_body(
        "abc",
        model="m",
        max_tokens=2,
        temperature=0.5,
        top_p=None,
        top_k=None,
        seed=None,
        stop=None,
        truncate_prompt=False,
        stream=False,
    ) == {"model": "m", "temperature": 0.5, "stream": False, "max_tokens": 2, "prompt": "abc"}


def test_tool_call_arguments_must_be_a_json_object() -> None:
    assert parse_arguments("f", '{"x": 1}', "call_1") == ToolCall(name="f", arguments={"x": 1}, id="call_1")
    assert parse_arguments("f", "", "call_2").arguments == {}
    for name, arguments, error in (
        ("f", '{"x": ', "not valid JSON"),
        ("f", "[1]", "not a JSON object"),
        (None, "{}", "no name"),
    ):
        call = parse_arguments(name, arguments, None)
        assert isinstance(call, InvalidToolCall) and error in call.error and call.arguments == arguments
        assert call.id.startswith("call_")


def test_read_response_and_stream_reader() -> None:
    reply = ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                            {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": '{"x"'}},
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            "selfspec": {"target_forwards": 2},
        }
    )
    result = read_response(reply)
    assert (result.text, result.finish_reason, result.model) == ("", "tool_calls", "m")
    assert [c.name for c in result.tool_calls] == ["f"] and [c.id for c in result.invalid_tool_calls] == ["call_b"]
    assert (result.prompt_tokens, result.completion_tokens, result.stats) == (3, 4, {"target_forwards": 2})

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> ChatCompletionChunk:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return ChatCompletionChunk.model_validate(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": choices,
                "usage": usage,
            }
        )

    reader = _StreamReader()
    events = []
    for piece in (
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hi"}),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_c", "type": "function", "function": {"name": "f", "arguments": ""}}
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}),
        chunk({}, "tool_calls"),
        chunk(None, usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
    ):
        events += reader.feed(piece)
    assert events[0] == ContentDelta("Hi")
    assert events[1] == ToolCallChunk(index=0, name="f", arguments="", id="call_c")
    assert "".join(e.arguments for e in events[1:] if isinstance(e, ToolCallChunk)) == '{"x": 2}'
    result = reader.finish()
    assert result.text == "Hi" and result.finish_reason == "tool_calls"
    assert result.tool_calls == [ToolCall(name="f", arguments={"x": 2}, id="call_c")]
    assert (result.prompt_tokens, result.completion_tokens) == (1, 2)


def _status_error(cls: type, status: int, param: str | None) -> Exception:
    request = httpx.Request("POST", "http://server/v1/chat/completions")
    body = {"message": "it is wrong", "type": "invalid_request_error", "param": param, "code": None}
    response = httpx.Response(status, request=request, content=json.dumps({"error": body}).encode())
    return cls("it is wrong", response=response, body=body)


@pytest.mark.parametrize(
    ("cls", "status", "param", "expected"),
    [
        ("BadRequestError", 400, "temperature", SamplingError),
        ("BadRequestError", 400, "max_tokens", SamplingError),
        ("BadRequestError", 400, "stop", SamplingError),
        ("BadRequestError", 400, "messages", InvalidPromptError),
        ("BadRequestError", 400, "messages[0]", InvalidPromptError),
        ("BadRequestError", 400, "prompt", InvalidPromptError),
        ("BadRequestError", 400, "tools", ValueError),
        ("NotFoundError", 404, "model", ModelNotFoundError),
    ],
)
def test_server_refusals_become_the_engines_errors(cls: str, status: int, param: str, expected: type) -> None:
    translated = translate_error(_status_error(getattr(openai, cls), status, param), "http://server/v1")
    assert type(translated) is expected
    assert str(translated) == "it is wrong (from the server at http://server/v1)"


def test_other_errors_pass_through() -> None:
    error = _status_error(openai.AuthenticationError, 401, None)
    assert translate_error(error, "x") is error
    other = RuntimeError("boom")
    assert translate_error(other, "x") is other


def test_api_key_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SELFSPEC_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert resolve_api_key(None) == "EMPTY"
    monkeypatch.setenv("OPENAI_API_KEY", "openai")
    assert resolve_api_key(None) == "openai"
    monkeypatch.setenv("SELFSPEC_API_KEY", "selfspec")
    assert resolve_api_key(None) == "selfspec"
    assert resolve_api_key("given") == "given"
    client = EndpointClient("http://server/v1", "given", timeout=3.0, max_retries=0)
    assert "given" not in repr(client)
    assert client.sync_client.api_key == "given" and client.sync_client.max_retries == 0


def test_invalid_schema_refusals_become_invalid_schema_errors() -> None:
    """Issue 29: the server's 400 ``invalid_schema`` (and the same error as a stream's error event)."""
    from selfspec.errors import InvalidSchemaError

    request = httpx.Request("POST", "http://server/v1/chat/completions")
    body = {"message": "the schema admits no JSON value", "type": "invalid_request_error",
            "param": "response_format", "code": "invalid_schema"}  # fmt: skip
    response = httpx.Response(400, request=request, content=json.dumps({"error": body}).encode())
    refused = translate_error(openai.BadRequestError("x", response=response, body=body), "http://server/v1")
    assert type(refused) is InvalidSchemaError and "admits no JSON value" in str(refused)
    in_stream = translate_error(openai.APIError("x", request, body=body), "http://server/v1")
    assert type(in_stream) is InvalidSchemaError
    other = openai.APIError("x", request, body={"code": "internal_error"})
    assert translate_error(other, "x") is other
