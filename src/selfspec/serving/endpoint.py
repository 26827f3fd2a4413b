"""Endpoint mode: the adapters talk to an OpenAI-compatible server instead of a local engine.

``ChatSpeculative(base_url=...)`` and ``SpeculativeLLM(base_url=...)`` send each call to
``selfspec serve``, or to vLLM or SGLang running their own speculative decoding, through the
official ``openai`` client. Both adapters share this module, so that they build requests and
read answers alike:

- :func:`chat_body` / :func:`text_body`: one request body from the request's options, the
  planner's :class:`~selfspec.serving.requests.RequestOptions` (``top_k``, ``truncate_prompt``
  and selfspec's own options in the extra body, usage asked for when streaming);
- :class:`EndpointClient`: sends a body, whole or streamed, sync or async, and returns an
  :class:`EndpointResult` (text, parsed tool calls, finish reason, token counts, the server's
  speculation statistics), streams yielding :class:`~selfspec.serving.tools.ContentDelta` and
  :class:`~selfspec.serving.tools.ToolCallChunk` events before it;
- :func:`translate_error`: the server's 400/404 answers become the errors a local engine
  raises for the same input (:class:`~selfspec.errors.SamplingError`,
  :class:`~selfspec.errors.InvalidPromptError`, :class:`~selfspec.errors.ModelNotFoundError`).

Closing a stream early closes its HTTP response; ``selfspec serve`` then cancels the
generation (vLLM and SGLang abort the request too).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..errors import InvalidPromptError, InvalidSchemaError, ModelNotFoundError, SamplingError
from .requests import RequestOptions, TokenUsage, offer_tools
from .tools import ContentDelta, InvalidToolCall, StreamEvent, ToolCall, ToolCallChunk, new_call_id


def _openai() -> Any:
    """The ``openai`` client library, imported on first use (it takes a while to import)."""
    try:
        import openai
    except ImportError as error:  # pragma: no cover - a dependency of both adapters
        raise ImportError(f"endpoint mode needs the openai client: pip install openai ({error})") from error
    return openai


#: Environment variables read, in this order, when no ``api_key`` is given.
API_KEY_ENV_VARS = ("SELFSPEC_API_KEY", "OPENAI_API_KEY")
#: The key sent to a server that needs none (the ``openai`` client refuses to send no key).
NO_KEY = "EMPTY"
#: Request fields whose refusal is a sampling error (as the local engine raises).
_SAMPLING_PARAMS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop", "seed"})


def resolve_api_key(api_key: str | None) -> str:
    """``api_key``, else ``$SELFSPEC_API_KEY``, else ``$OPENAI_API_KEY``, else ``"EMPTY"``."""
    if api_key:
        return api_key
    for name in API_KEY_ENV_VARS:
        if os.environ.get(name):
            return os.environ[name]
    return NO_KEY


@dataclass
class EndpointResult:
    """A finished answer from the server.

    Attributes:
        text: the answer's text (tool-call markup excluded).
        tool_calls: the well-formed tool calls.
        invalid_tool_calls: calls whose arguments are not a JSON object.
        finish_reason: the server's (``"stop"``, ``"length"``, ``"tool_calls"``), or
            ``None`` when a stream ended without one.
        model: the model id the server reported.
        prompt_tokens: the prompt's length, when the server reported usage.
        completion_tokens: the answer's length, when the server reported usage.
        stats: the speculation statistics ``selfspec serve`` sends under its ``selfspec``
            key (the names of :class:`~selfspec.decoding.outputs.GenerationStats`); empty for other
            servers.
    """

    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    model: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def has_usage(self) -> bool:
        """Whether the server reported token counts."""
        return self.prompt_tokens is not None and self.completion_tokens is not None

    @property
    def usage(self) -> TokenUsage | None:
        """The server's token counts as the planner's :class:`~selfspec.serving.requests.TokenUsage`."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return TokenUsage(self.prompt_tokens, self.completion_tokens)


# ------------------------------------------------------------------------------- request bodies
def openai_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat-template messages (what the adapters build) in OpenAI's wire form.

    Tool-call arguments become JSON strings; everything else is kept.
    """
    converted = []
    for message in messages:
        entry = dict(message)
        calls = entry.get("tool_calls")
        if calls:
            entry["tool_calls"] = [_wire_call(call) for call in calls]
            entry["content"] = entry.get("content") or None
        converted.append(entry)
    return converted


def _wire_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        function["arguments"] = json.dumps({} if arguments is None else arguments, ensure_ascii=False)
    return {"id": call.get("id") or new_call_id(), "type": "function", "function": function}


def _sampling(options: RequestOptions, model: str, stream: bool) -> dict[str, Any]:
    """The sampling fields of a body (chat or text), from the request's options."""
    body: dict[str, Any] = {"model": model, "temperature": options.temperature, "stream": stream}
    if options.max_tokens is not None:
        body["max_tokens"] = options.max_tokens
    if options.top_p is not None:
        body["top_p"] = options.top_p
    if options.seed is not None:
        body["seed"] = options.seed
    if options.stop is not None:
        body["stop"] = options.stop_list
    if stream:
        body["stream_options"] = {"include_usage": True}
    extra: dict[str, Any] = {}
    if options.top_k is not None:  # not in OpenAI's API; selfspec serve, vLLM and SGLang read it
        extra["top_k"] = options.top_k
    if options.truncate_prompt:  # selfspec serve's own option
        extra["truncate_prompt"] = True
    if extra:
        body["extra_body"] = extra
    return body


def chat_body(
    messages: Sequence[Mapping[str, Any]],
    options: RequestOptions | None = None,
    *,
    model: str,
    stream: bool = False,
    **keywords: Any,
) -> dict[str, Any]:
    """The keyword arguments of ``client.chat.completions.create`` for one call.

    The request's options are the planner's (:class:`~selfspec.serving.requests.RequestOptions`),
    in OpenAI's form: ``temperature`` always (OpenAI's default is 1); ``max_tokens``, ``top_p``,
    ``seed`` and ``stop`` when set; the tools and ``tool_choice`` read as the planner reads them
    (:func:`~selfspec.serving.requests.offer_tools`: none sent for ``tool_choice="none"``), with
    ``parallel_tool_calls=False`` when set; ``response_format`` (a ``json_schema`` as a
    ``json_schema`` format; a bare ``{"type": "json_schema", "schema": ...}`` put in OpenAI's
    wrapped form); ``top_k``, ``truncate_prompt``, ``constrain_tool_calls=False`` and
    ``escape_special_tokens`` in the extra body (``selfspec serve`` reads them, other servers
    ``top_k`` at most). ``logprobs``, ``fit_max_tokens`` and ``budget_name`` are the local
    planner's only.

    Args:
        messages: chat-template messages (tool-call arguments may be dicts).
        options: the request's options (``None``: the defaults; ``max_tokens=None`` leaves the
            budget to the server's default).
        model: the model id the server serves.
        stream: stream the answer (usage is then asked for in a last chunk).
        **keywords: :class:`~selfspec.serving.requests.RequestOptions` fields, replacing those of ``options``.

    Raises:
        TypeError: a keyword that is not a request option.
        RequestFieldError: bad tools or ``tool_choice`` (as the planner refuses them).
    """
    options = RequestOptions.of(options, keywords, "chat_body")
    body = _sampling(options, model, stream)
    body["messages"] = openai_messages(messages)
    offer = offer_tools(options.tools, options.tool_choice)  # read as plan_request reads them
    if offer.tools:
        body["tools"] = [dict(tool) for tool in offer.tools]
        body["tool_choice"] = offer.choice
        if not options.parallel_tool_calls:
            body["parallel_tool_calls"] = False
        if not options.constrain_tool_calls:
            body.setdefault("extra_body", {})["constrain_tool_calls"] = False
    response_format = options.response_format
    if options.json_schema is not None:
        response_format = {"type": "json_schema", "json_schema": {"name": "response", "schema": options.json_schema}}
    if response_format is not None:
        body["response_format"] = _wire_response_format(response_format)
    if options.escape_special_tokens:
        body.setdefault("extra_body", {})["escape_special_tokens"] = True
    return body


def text_body(
    prompt: str, options: RequestOptions | None = None, *, model: str, stream: bool = False, **keywords: Any
) -> dict[str, Any]:
    """The keyword arguments of ``client.completions.create`` (a raw prompt, no chat template).

    Only the sampling options of :func:`chat_body` are sent (a raw prompt offers no tools).
    """
    options = RequestOptions.of(options, keywords, "text_body")
    body = _sampling(options, model, stream)
    body["prompt"] = prompt
    return body


def _wire_response_format(response_format: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's wire form; JSON mode with a schema is sent as that schema (any server honours it)."""
    if response_format.get("type") in ("json_schema", "json_object") and "json_schema" not in response_format:
        schema = response_format.get("schema")
        if response_format.get("type") == "json_schema" or isinstance(schema, Mapping):
            return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    return dict(response_format)


# ------------------------------------------------------------------------------- reading answers
def parse_arguments(name: str | None, arguments: str | None, call_id: str | None) -> ToolCall | InvalidToolCall:
    """A call from the wire: its arguments must be a JSON object."""
    call_id = call_id or new_call_id()
    text = arguments or ""
    if not name:
        return InvalidToolCall(name=None, arguments=text, error="the tool call has no name", id=call_id)
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as error:
        return InvalidToolCall(name=name, arguments=text, error=f"arguments are not valid JSON: {error}", id=call_id)
    if not isinstance(value, dict):
        return InvalidToolCall(name=name, arguments=text, error="arguments are not a JSON object", id=call_id)
    return ToolCall(name=name, arguments=value, id=call_id)


def _add_call(result: EndpointResult, call: ToolCall | InvalidToolCall) -> None:
    if isinstance(call, ToolCall):
        result.tool_calls.append(call)
    else:
        result.invalid_tool_calls.append(call)


def _stats(body: Any) -> dict[str, Any]:
    extra = getattr(body, "model_extra", None) or {}
    stats = extra.get("selfspec")
    return dict(stats) if isinstance(stats, Mapping) else {}


def read_response(reply: Any) -> EndpointResult:
    """An :class:`EndpointResult` from a chat or text completion object of the ``openai`` client."""
    result = EndpointResult(model=str(getattr(reply, "model", "") or ""), stats=_stats(reply))
    if reply.choices:
        choice = reply.choices[0]
        result.finish_reason = choice.finish_reason
        message = getattr(choice, "message", None)
        if message is None:  # a text completion
            result.text = choice.text or ""
        else:
            result.text = message.content or ""
            for call in message.tool_calls or []:
                function = getattr(call, "function", None)
                _add_call(
                    result,
                    parse_arguments(getattr(function, "name", None), getattr(function, "arguments", None), call.id),
                )
    _read_usage(result, getattr(reply, "usage", None))
    return result


def _read_usage(result: EndpointResult, usage: Any) -> None:
    if usage is not None:
        result.prompt_tokens = int(usage.prompt_tokens)
        result.completion_tokens = int(usage.completion_tokens)


class _StreamReader:
    """Turns streamed chunks into events and, at the end, the :class:`EndpointResult`."""

    def __init__(self) -> None:
        self.result = EndpointResult()
        self._text: list[str] = []
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, argument pieces]

    def feed(self, chunk: Any) -> list[StreamEvent]:
        result = self.result
        result.model = result.model or str(getattr(chunk, "model", "") or "")
        result.stats = _stats(chunk) or result.stats
        _read_usage(result, getattr(chunk, "usage", None))
        events: list[StreamEvent] = []
        for choice in chunk.choices or []:
            if choice.finish_reason:
                result.finish_reason = choice.finish_reason
            delta = getattr(choice, "delta", None)
            text = choice.text if delta is None else delta.content
            if text:
                self._text.append(text)
                events.append(ContentDelta(text))
            for call in (delta.tool_calls if delta is not None else None) or []:
                function = call.function
                name = getattr(function, "name", None) or None
                arguments = getattr(function, "arguments", None) or ""
                state = self._calls.setdefault(call.index, [None, None, []])
                if call.id and state[0] is None:
                    state[0] = call.id
                if name and state[1] is None:
                    state[1] = name
                state[2].append(arguments)
                events.append(ToolCallChunk(index=call.index, name=name, arguments=arguments, id=call.id or None))
        return events

    def finish(self) -> EndpointResult:
        result = self.result
        result.text = "".join(self._text)
        for index in sorted(self._calls):
            call_id, name, pieces = self._calls[index]
            _add_call(result, parse_arguments(name, "".join(pieces), call_id))
        return result


# ------------------------------------------------------------------------------- errors
def translate_error(error: Exception, base_url: str) -> Exception:
    """The error a local engine raises for what the server refused (else ``error`` itself).

    A 400 about a sampling field becomes :class:`SamplingError`, one about the prompt or the
    messages :class:`InvalidPromptError`, one with code ``invalid_schema`` (a schema or tools
    over the bounds, invalid, admitting no value) :class:`InvalidSchemaError`, any other 400 a
    ``ValueError``; a 404 for the
    model becomes :class:`ModelNotFoundError`. The server's message is kept.
    """
    openai = _openai()
    if not isinstance(error, openai.APIStatusError):
        # an error event inside a stream (the grammar failed mid-generation): no status, the same body
        body = getattr(error, "body", None) if isinstance(error, openai.APIError) else None
        if isinstance(body, Mapping) and body.get("code") == "invalid_schema":
            return InvalidSchemaError(f"{body.get('message') or error} (from the server at {base_url})")
        return error
    body = error.body if isinstance(error.body, Mapping) else {}
    detail = body.get("error", body) if isinstance(body.get("error", body), Mapping) else {}
    message = str(detail.get("message") or error.message)
    param = str(detail.get("param") or "")
    where = f" (from the server at {base_url})"
    if isinstance(error, openai.NotFoundError):
        return ModelNotFoundError(message + where)
    if isinstance(error, (openai.BadRequestError, openai.UnprocessableEntityError)):
        if str(detail.get("code") or "") == "invalid_schema":
            return InvalidSchemaError(message + where)
        if param in _SAMPLING_PARAMS:
            return SamplingError(message + where)
        if param.startswith(("messages", "prompt")):
            return InvalidPromptError(message + where)
        return ValueError(message + where)
    return error


# ------------------------------------------------------------------------------- the client
class EndpointClient:
    """Sends requests to one OpenAI-compatible server with the official ``openai`` client.

    Args:
        base_url: the server's API root, e.g. ``"http://localhost:8000/v1"``.
        api_key: the bearer key (``None``: :func:`resolve_api_key`).
        timeout: seconds before a request fails (``None``: the client's default, 600 s).
        max_retries: retries of failed connections and 429/5xx answers.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None, max_retries: int = 2):
        self.base_url = base_url
        self.api_key = resolve_api_key(api_key)
        self.timeout = timeout
        self.max_retries = max_retries
        self._sync: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EndpointClient(base_url={self.base_url!r}, timeout={self.timeout!r})"

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"base_url": self.base_url, "api_key": self.api_key, "max_retries": self.max_retries}
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return options

    @property
    def sync_client(self) -> Any:
        """The ``openai.OpenAI`` client (created on first use, shared by threads)."""
        with self._lock:
            if self._sync is None:
                self._sync = _openai().OpenAI(**self._options())
            return self._sync

    def _async_client(self) -> Any:
        # one per call: an httpx async client belongs to the event loop that first used it
        return _openai().AsyncOpenAI(**self._options())

    @staticmethod
    def _resource(client: Any, body: Mapping[str, Any]) -> Any:
        return client.chat.completions if "messages" in body else client.completions

    def create(self, body: Mapping[str, Any]) -> EndpointResult:
        """Send a non-streamed request."""
        try:
            reply = self._resource(self.sync_client, body).create(**body)
        except _openai().APIStatusError as error:
            _reraise(error, self.base_url)
        return read_response(reply)

    def stream(self, body: Mapping[str, Any]) -> Generator[StreamEvent | EndpointResult, None, None]:
        """Stream a request: events while it is generated, then the :class:`EndpointResult`.

        Closing the iterator early closes the HTTP response (the server cancels the
        generation).
        """
        try:
            chunks = self._resource(self.sync_client, {**body, "stream": True}).create(**{**body, "stream": True})
        except _openai().APIStatusError as error:
            _reraise(error, self.base_url)
        reader = _StreamReader()
        try:
            for chunk in chunks:
                yield from reader.feed(chunk)
        except _openai().APIError as error:  # a status error, or an error event inside the stream
            _reraise(error, self.base_url)
        finally:
            chunks.close()
        yield reader.finish()

    async def acreate(self, body: Mapping[str, Any]) -> EndpointResult:
        """Async :meth:`create`."""
        async with self._async_client() as client:
            try:
                reply = await self._resource(client, body).create(**body)
            except _openai().APIStatusError as error:
                _reraise(error, self.base_url)
        return read_response(reply)

    async def astream(self, body: Mapping[str, Any]) -> AsyncGenerator[StreamEvent | EndpointResult, None]:
        """Async :meth:`stream`; closing (or cancelling) it closes the HTTP response."""
        async with self._async_client() as client:
            try:
                chunks = await self._resource(client, body).create(**{**body, "stream": True})
            except _openai().APIStatusError as error:
                _reraise(error, self.base_url)
            reader = _StreamReader()
            try:
                async for chunk in chunks:
                    for event in reader.feed(chunk):
                        yield event
            except _openai().APIError as error:  # a status error, or an error event inside the stream
                _reraise(error, self.base_url)
            finally:
                await chunks.close()
        yield reader.finish()


def _reraise(error: Exception, base_url: str) -> NoReturn:
    """Raise the translation of ``error`` (chained to it), or ``error`` itself."""
    translated = translate_error(error, base_url)
    if translated is error:
        raise error
    raise translated from error
