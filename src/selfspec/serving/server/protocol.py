"""The OpenAI wire format: request bodies, message conversion, and error bodies.

This module only checks the wire format (types, ranges, unsupported options) and spells a request
in the planner's names (``request_options()``: a
:class:`~selfspec.serving.requests.RequestOptions`); what a request means (its budget, tools and
``tool_choice``, ``response_format``, constraint, repetition guard and usage) is the request
planner's, :mod:`selfspec.serving.requests`, shared with both adapters.

Unknown fields are ignored, as OpenAI-compatible servers do, but the known ones are typed
strictly: ``true`` is not a number, ``"5"`` and ``5.0`` are not integers, ``"yes"`` is not a
boolean (pydantic's strict mode). Options that would change the answer and that selfspec cannot
honour (``n > 1``, penalties, ``logit_bias``) are refused with a 400 rather than silently dropped;
OpenAI's own ranges are enforced here (``temperature`` at most 2, ``top_logprobs`` 0..20, the
completions' ``logprobs`` 0..5). Sampling values themselves are checked by the engine
(:mod:`selfspec.core.validation`), whose ``ValueError`` subclasses become 400 responses with the
engine's message.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, ConfigDict

from ...errors import InvalidPromptError
from ..requests import RequestOptions

#: Chat roles the server accepts (``developer`` is OpenAI's newer name for ``system``; ``function``
#: the deprecated function calling's ``tool``).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: OpenAI's largest ``temperature``.
MAX_TEMPERATURE = 2.0
#: OpenAI's largest chat ``top_logprobs``.
MAX_TOP_LOGPROBS = 20
#: OpenAI's largest completions ``logprobs``.
MAX_COMPLETION_LOGPROBS = 5


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``.

    Args:
        status: the HTTP status code.
        message: what went wrong and how to fix it.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if any.
        code: a machine-readable code (``model_not_found``, ``invalid_api_key``, ...).
        headers: extra response headers (``Retry-After`` on a 429, ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# the engine's messages start with the argument's name; map it to the request field
_ENGINE_PARAMS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_completion_tokens",
    "seed": "seed",
    "stop": "stop",
}


def engine_error_param(error: Exception, prompt_field: str) -> str | None:
    """The request field an engine ``ValueError`` is about.

    Prompt errors (empty, malformed, too long for the context window) are about
    ``prompt_field``; sampling errors name their argument first in the message.
    """
    if isinstance(error, InvalidPromptError):
        return prompt_field
    message = str(error)
    for name, field in _ENGINE_PARAMS.items():
        if message.startswith(name):
            return field
    return None


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    truncate_prompt: bool = False

    @property
    def token_limit(self) -> int | None:
        """The requested budget (``None``: the planner's default)."""
        return self.max_tokens

    @property
    def token_limit_field(self) -> str:
        """The request field :attr:`token_limit` comes from (errors name it)."""
        return "max_tokens"

    def check_supported(self) -> None:
        """Refuse options that would change the answer and that selfspec cannot honour, and out-of-range limits."""
        limit, field = self.token_limit, self.token_limit_field
        if limit is not None and limit < 1:
            raise APIError(400, f"{field} must be >= 1, got {limit}", param=field)
        if self.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        if self.temperature is not None and self.temperature > MAX_TEMPERATURE:
            raise APIError(
                400,
                f"temperature must be between 0 and {MAX_TEMPERATURE:g} (OpenAI's range), got {self.temperature!r}",
                param="temperature",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (leave it at 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    @property
    def engine_logprobs(self) -> int | None:
        """The engine's ``logprobs``: ``None`` (none), or the alternatives to report per token."""
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def request_options(self) -> RequestOptions:
        """The request in the planner's declaration (:class:`~selfspec.serving.requests.RequestOptions`).

        ``temperature`` defaults to 1, as in OpenAI's API; pass 0 for greedy decoding. A
        ``max_tokens`` that does not fit the context window is left for the engine to refuse
        (``fit_max_tokens=False``), as OpenAI's API does.
        """
        return RequestOptions(
            max_tokens=self.token_limit,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            truncate_prompt=self.truncate_prompt,
            logprobs=self.engine_logprobs,
            fit_max_tokens=False,
        )


class ChatCompletionRequest(_SamplingRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    #: ``true``: each content token's log-probability (``choices[i].logprobs.content``)
    logprobs: bool | None = None
    #: with ``logprobs``, the most likely alternatives per token (0 .. 20)
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    #: any spelling :func:`selfspec.serving.requests.normalize_tool_choice` reads: ``"auto"``,
    #: ``"none"``, ``"required"``/``"any"``/``true``, ``false``, a tool's name or a named function
    tool_choice: bool | str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    #: selfspec's own field: with tools and ``tool_choice="auto"``, generate the calls the model
    #: chooses to make under the tools' grammar (as the adapters' ``constrain_tool_calls``)
    constrain_tool_calls: bool = True
    #: ``False``: at most one tool call per answer (enforced by the grammar when calls are constrained)
    parallel_tool_calls: bool | None = None
    #: selfspec's own field: ``True`` encodes special-token strings in the messages and tools as
    #: plain text (``selfspec serve --escape-special-tokens`` does it for every request; a request
    #: cannot turn it off)
    escape_special_tokens: bool = False
    #: OpenAI's deprecated function calling, served as ``tools`` / ``tool_choice`` with at most one
    #: call, and answered in its own shape (``message.function_call``, ``finish_reason="function_call"``)
    functions: list[dict[str, Any]] | None = None
    #: ``"auto"``, ``"none"`` or ``{"name": ...}`` (needs ``functions``)
    function_call: str | dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def token_limit_field(self) -> str:  # noqa: D102 - documented in the base class
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def check_supported(self) -> None:  # noqa: D102 - documented in the base class
        super().check_supported()
        self._check_functions()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(
                    400,
                    f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                    param="top_logprobs",
                )
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")

    @property
    def engine_logprobs(self) -> int | None:  # noqa: D102 - documented in the base class
        return (self.top_logprobs or 0) if self.logprobs else None

    # -- OpenAI's deprecated function calling, mapped onto tools
    @property
    def legacy_functions(self) -> bool:
        """Whether the request uses ``functions`` (the answer then takes the legacy shape)."""
        return self.functions is not None

    def _check_functions(self) -> None:
        """Refuse ``functions`` / ``function_call`` mixed with ``tools``, or malformed."""
        if self.functions is None and self.function_call is None:
            return
        if self.tools is not None or self.tool_choice is not None:
            raise APIError(
                400,
                "functions / function_call are the deprecated spelling of tools / tool_choice: pass one pair, not both",
                param="functions" if self.functions is not None else "function_call",
            )
        if self.functions is None:
            raise APIError(400, "function_call needs functions", param="function_call")
        for i, function in enumerate(self.functions):
            if not isinstance(function.get("name"), str) or not function["name"]:
                raise APIError(400, f"functions[{i}] needs a 'name' (a string)", param=f"functions[{i}]")
        choice = self.function_call
        if isinstance(choice, str) and choice not in ("auto", "none"):
            raise APIError(
                400, f"function_call must be 'auto', 'none' or {{\"name\": ...}}, got {choice!r}", param="function_call"
            )
        if isinstance(choice, dict) and not isinstance(choice.get("name"), str):
            raise APIError(400, 'function_call must name a function: {"name": ...}', param="function_call")

    @property
    def request_tools(self) -> list[dict[str, Any]] | None:
        """``tools``, or ``functions`` as tools."""
        if self.functions is None:
            return self.tools
        return [{"type": "function", "function": function} for function in self.functions]

    @property
    def request_tool_choice(self) -> bool | str | dict[str, Any] | None:
        """``tool_choice``, or ``function_call`` as a tool choice (``{"name": f}`` forces ``f``)."""
        if self.functions is None:
            return self.tool_choice
        choice = self.function_call
        if isinstance(choice, dict):
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    @property
    def request_parallel_tool_calls(self) -> bool:
        """Whether an answer may hold several calls (never with ``functions``: one ``function_call``)."""
        return self.functions is None and self.parallel_tool_calls is not False

    def request_options(self) -> RequestOptions:  # noqa: D102 - documented in the base class
        return replace(
            super().request_options(),
            tools=self.request_tools,  # functions, when the request uses the deprecated spelling
            tool_choice=self.request_tool_choice,
            response_format=self.response_format,
            constrain_tool_calls=self.constrain_tool_calls,
            parallel_tool_calls=self.request_parallel_tool_calls,
            escape_special_tokens=self.escape_special_tokens,
        )


class CompletionRequest(_SamplingRequest):
    """The body of ``POST /v1/completions``."""

    #: OpenAI's forms: a string, a list of token ids, or a list of strings or of token-id lists
    #: (one prompt per item; this server serves one: :meth:`single_prompt`)
    prompt: str | list[str] | list[int] | list[list[int]]
    #: each token's log-probability and this many most likely alternatives (0 .. 5)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:  # noqa: D102 - documented in the base class
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(
                400,
                f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}",
                param="logprobs",
            )

    @property
    def engine_logprobs(self) -> int | None:  # noqa: D102 - documented in the base class
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The request's one prompt: its text, or its token ids.

        ``"text"``, ``[1, 2, 3]``, ``["text"]`` and ``[[1, 2, 3]]`` are one prompt each; a list of
        several is several prompts, which this server does not batch into one answer (send one
        request per prompt: concurrent requests are served together). Token ids are checked
        against the vocabulary by the engine.

        Raises:
            APIError: several prompts, or an empty one (400, ``param: prompt``).
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise APIError(
                    400,
                    f"only one prompt per request is served, got {len(prompt)}: send one request per prompt "
                    "(concurrent requests are served together)",
                    param="prompt",
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty; pass some text or token ids", param="prompt")
        return prompt  # type: ignore[return-value]  # a str, or a list of ints (the union's other members)

    @property
    def token_limit(self) -> int | None:
        """``max_tokens`` (OpenAI's completions default is 16; here ``serving.requests.DEFAULT_MAX_TOKENS``)."""
        return self.max_tokens


# ------------------------------------------------------------------------------- messages
def engine_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as chat-template messages.

    Text content parts are joined; ``developer`` becomes ``system``; an assistant's tool
    calls get their JSON-string arguments decoded (chat templates expect a dict); a ``tool``
    message gets the ``name`` of the call it answers when the request shows it. The deprecated
    function calling's messages become their tools form: an assistant's ``function_call`` one
    tool call (id ``call_legacy_<i>``), a ``function`` message a ``tool`` message answering it.

    Raises:
        APIError: a message that is not a dict, has an unknown role, or non-text content.
    """
    converted: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool-call id -> tool name
    legacy_ids: dict[str, str] = {}  # function name -> the id given to its last legacy function_call
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else None
            raise APIError(400, f"{param}: role must be one of {', '.join(ROLES)}, got {role!r}", param=param)
        role = {"developer": "system", "function": "tool"}.get(message["role"], message["role"])
        entry: dict[str, Any] = {"role": role, "content": _text(message.get("content"), param)}
        if role == "assistant" and message.get("tool_calls"):
            entry["tool_calls"] = [_template_call(call, names, param) for call in message["tool_calls"]]
        if role == "assistant" and message.get("function_call") is not None:  # the deprecated form of one call
            if message.get("tool_calls"):
                raise APIError(400, f"{param}: pass tool_calls or function_call, not both", param=param)
            call = {"id": f"call_legacy_{i}", "function": message["function_call"]}
            entry["tool_calls"] = [_template_call(call, names, f"{param}.function_call")]
            legacy_ids[entry["tool_calls"][0]["function"]["name"]] = f"call_legacy_{i}"
        if message["role"] == "function":  # a function's result: a tool message answering the last call of that name
            name = message.get("name")
            if not isinstance(name, str) or not name:
                raise APIError(400, f"{param}: a 'function' message needs the 'name' of its function", param=param)
            entry.update({"tool_call_id": legacy_ids.get(name), "name": name})
        elif role == "tool":
            call_id = message.get("tool_call_id")
            entry["tool_call_id"] = call_id
            name = message.get("name") or names.get(str(call_id))
            if name:
                entry["name"] = name
        converted.append(entry)
    return converted


def _text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{param}: only text content is supported, got a {kind!r} part", param=param)
        return "".join(parts)
    raise APIError(400, f"{param}: content must be a string or a list of text parts", param=param)


def _template_call(call: Any, names: dict[str, str], param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{param}: a tool call needs a 'function' with a 'name'", param=param)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            decoded = None
        arguments = decoded if isinstance(decoded, dict) else arguments
    if call.get("id"):
        names[str(call["id"])] = function["name"]
    return {"type": "function", "id": call.get("id"), "function": {"name": function["name"], "arguments": arguments}}
