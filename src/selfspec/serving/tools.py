"""Tool calls in the model's own words: parse them, stream them, normalise tool schemas.

Two output formats are understood, both emitted by open chat models:

- Hermes / Qwen (and the bundled demo model): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, possibly after some text.
- Llama 3.1 JSON: the whole message is ``{"name": ..., "parameters": {...}}`` (or with
  ``"arguments"``), optionally after ``<|python_tag|>``.

Where a transformers tokenizer declares how its own template's answers are read (a
``response_template``, read by ``tokenizer.parse_response``), :func:`parse_tool_calls` uses that
first and these two formats are the fallback.

Parsing never raises: a block whose JSON is malformed, or which has no name, becomes an
:class:`InvalidToolCall` so that the caller can show the model its mistake. Framework adapters
(LangChain, LlamaIndex) share these functions so that every adapter reads tool calls alike.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: The Hermes/Qwen tool-call tags.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
#: The marker Llama 3.1 puts before a JSON tool call (decoded with special tokens kept).
PYTHON_TAG = "<|python_tag|>"

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# the head of a call whose arguments can be streamed: {"name": "...", "arguments": <args>}
_HEAD_RE = re.compile(r'\A\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ENVELOPE_START_RE = re.compile(r'\A\s*\{\s*"name"\s*:')
_ARG_KEYS = ("arguments", "parameters")
_LLAMA_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})
_TOOL_NAME_RE = re.compile(r"\A[A-Za-z0-9_.\-]{1,64}\Z")


def new_call_id() -> str:
    """A fresh tool-call id, ``call_<32 hex digits>``."""
    return f"call_{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """A well-formed tool call.

    Attributes:
        name: the tool's name.
        arguments: the arguments, a JSON object.
        id: a unique id (``call_<hex>``), for matching the tool's result to the call.
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)


@dataclass
class InvalidToolCall:
    """A tool call the model formatted badly.

    Attributes:
        name: the tool's name when it could be read, else ``None``.
        arguments: the raw text of the arguments only (the whole call's text only when the
            arguments cannot be located in it).
        error: what was wrong.
        id: a unique id (``call_<hex>``).
    """

    name: str | None
    arguments: str
    error: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    """A model message split into text and tool calls.

    Attributes:
        content: the text outside the tool calls, stripped.
        tool_calls: the well-formed calls, in order.
        invalid_tool_calls: the malformed ones, in order.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


# ------------------------------------------------------------------------------- parsing
def parse_tool_calls(text: str, *, tokenizer: Any = None) -> ParsedOutput:
    """Split a complete model message into content and tool calls.

    With a ``tokenizer`` that has a ``response_template``, its ``parse_response`` reads the
    message first (the template's own schema); when it has none, or cannot read the text,
    the parser below does. Hermes/Qwen ``<tool_call>`` blocks are looked for first (several are allowed, and a last
    block left unclosed at the end of the text is read too); without any, a message that is
    entirely one Llama 3.1 JSON call (or a JSON list of them) is read as tool calls. Any
    other text is plain content.

    Args:
        text: the decoded model output.
        tokenizer: the model's transformers tokenizer (optional).

    Returns:
        The content and the valid and invalid tool calls. Never raises.
    """
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        parsed = _parse_with_tokenizer(tokenizer, text)
        if parsed is not None:
            return parsed
    if TOOL_CALL_START in text:
        parsed = ParsedOutput(content="")
        for match in _BLOCK_RE.finditer(text):
            _add_call(parsed, _read_call(match.group(1)))
        parsed.content = _BLOCK_RE.sub("", text).strip()
        return parsed
    calls = _read_llama_json(text)
    if calls is None:
        return ParsedOutput(content=text.strip())
    parsed = ParsedOutput(content="")
    for call in calls:
        _add_call(parsed, call)
    return parsed


def _parse_with_tokenizer(tokenizer: Any, text: str) -> ParsedOutput | None:
    """The message read by ``tokenizer.parse_response`` (``None`` when it cannot read it)."""
    try:
        message = tokenizer.parse_response(text, prefix="")
    except Exception:  # noqa: BLE001 - any failure falls back to the built-in parser
        return None
    if not isinstance(message, Mapping):
        return None
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        return None
    parsed = ParsedOutput(content=str(message.get("content") or "").strip())
    for value in calls:
        _add_call(parsed, _call_from_value(value, json.dumps(value, ensure_ascii=False, default=str)))
    return parsed


def _add_call(parsed: ParsedOutput, call: ToolCall | InvalidToolCall) -> None:
    if isinstance(call, ToolCall):
        parsed.tool_calls.append(call)
    else:
        parsed.invalid_tool_calls.append(call)


def _read_call(body: str) -> ToolCall | InvalidToolCall:
    """Read the JSON of one call: ``{"name": ..., "arguments": {...}}``."""
    try:
        value = json.loads(body)
    except ValueError as error:
        head = _HEAD_RE.match(body)
        if head is not None:  # the envelope is readable: keep only the arguments' text
            rest = body[head.end() :]
            try:
                arguments = rest[: json.JSONDecoder().raw_decode(rest)[1]]  # complete arguments, broken envelope
            except ValueError:
                arguments = _without_outer_close(rest)
            return InvalidToolCall(
                name=_unescape(head.group(1)),
                arguments=arguments.strip(),
                error=f"the tool call's arguments are not valid JSON: {error}",
            )
        name = _NAME_RE.search(body)
        envelope = _ENVELOPE_START_RE.match(body) is not None and '"arguments"' not in body
        return InvalidToolCall(
            name=_unescape(name.group(1)) if name else None,
            arguments="" if envelope else body.strip(),  # cut before its arguments: there are none
            error=f"the tool call is not valid JSON: {error}",
        )
    return _call_from_value(value, body)


def _call_from_value(value: Any, raw: str) -> ToolCall | InvalidToolCall:
    """A :class:`ToolCall` from decoded JSON, or an :class:`InvalidToolCall` saying what is wrong."""
    if not isinstance(value, dict):
        return InvalidToolCall(None, raw.strip(), "a tool call must be a JSON object with a name")
    if isinstance(value.get("function"), dict):  # OpenAI form {"type": "function", "function": {...}}
        value = value["function"]
    name = value.get("name")
    arguments: Any = next((value[key] for key in _ARG_KEYS if key in value), {})
    raw_arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if not isinstance(name, str) or not name:
        return InvalidToolCall(None, raw_arguments, "the tool call has no name")
    if isinstance(arguments, str):  # some models encode the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            return InvalidToolCall(name, raw_arguments, f"the arguments are not valid JSON: {error}")
    if not isinstance(arguments, dict):
        return InvalidToolCall(name, raw_arguments, "the arguments must be a JSON object")
    return ToolCall(name=name, arguments=arguments)


def _read_llama_json(text: str) -> list[ToolCall | InvalidToolCall] | None:
    """Llama 3.1's JSON calls, or ``None`` when the text is not one."""
    stripped = text.strip()
    tagged = stripped.startswith(PYTHON_TAG)
    if tagged:
        stripped = stripped[len(PYTHON_TAG) :].strip()
    if not stripped.startswith(("{", "[")):
        if not tagged:
            return None
        return [InvalidToolCall(None, stripped, "expected a JSON tool call after <|python_tag|>")]
    try:
        value = json.loads(stripped)
    except ValueError as error:
        if tagged:
            name = _NAME_RE.search(stripped)
            return [
                InvalidToolCall(
                    _unescape(name.group(1)) if name else None, stripped, f"the tool call is not valid JSON: {error}"
                )
            ]
        return None
    values = value if isinstance(value, list) else [value]
    if not values or not all(_looks_like_call(v) for v in values):
        if tagged:
            return [_call_from_value(v, json.dumps(v, ensure_ascii=False)) for v in values] or [
                InvalidToolCall(None, stripped, "empty tool call list")
            ]
        return None  # a JSON answer, not a tool call
    return [_call_from_value(v, json.dumps(v, ensure_ascii=False)) for v in values]


def _looks_like_call(value: Any) -> bool:
    """Whether a JSON value has the shape of a Llama tool call (not some other JSON answer)."""
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and any(key in value for key in _ARG_KEYS)
        and set(value) <= _LLAMA_KEYS
    )


def _unescape(json_string_body: str) -> str:
    try:
        return str(json.loads(f'"{json_string_body}"'))
    except ValueError:
        return json_string_body


# ------------------------------------------------------------------------------- streaming
@dataclass
class ToolCallChunk:
    """A piece of a tool call while streaming (OpenAI/LangChain ``tool_call_chunks`` style).

    The first chunk of a call carries its ``name`` and ``id``; later chunks of the same
    ``index`` carry only more ``arguments`` text. Concatenating the ``arguments`` of one
    index gives the call's arguments JSON.

    Attributes:
        index: which call of the message (0, 1, ...).
        name: the tool's name (first chunk only), else ``None``.
        arguments: a fragment of the arguments JSON (may be empty).
        id: the call id (first chunk only), else ``None``.
    """

    index: int
    name: str | None
    arguments: str
    id: str | None


@dataclass
class ContentDelta:
    """A piece of plain text (never containing tool-call markup)."""

    text: str


StreamEvent = ContentDelta | ToolCallChunk


class ToolCallStreamParser:
    """Turns streamed text deltas into content deltas and tool-call chunks.

    Text that might be the start of ``<tool_call>`` is held back until it is known not to
    be one. Inside a block of the form ``{"name": ..., "arguments": ...}`` the name is sent
    as soon as it is complete and the arguments as they arrive (holding back only a trailing
    ``}`` that may close the outer object); blocks of another shape are sent whole when they
    close. With ``llama_json=True`` a message that starts with ``{``, ``[`` or
    ``<|python_tag|>`` is held back to the end and then read with :func:`parse_tool_calls`.

    Example:
        >>> parser = ToolCallStreamParser()
        >>> events = parser.feed('Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}')
        >>> events += parser.feed("</tool_call>") + parser.finish()
        >>> "".join(e.arguments for e in events if isinstance(e, ToolCallChunk))
        '{"a": 1}'

    Args:
        llama_json: also recognise Llama 3.1's whole-message JSON calls.
    """

    def __init__(self, *, llama_json: bool = True) -> None:
        self.llama_json = llama_json
        self.text = ""  #: everything fed so far
        self._pending = ""  # held-back text outside blocks (a possible start of <tool_call>)
        self._block: str | None = None  # body of the open block, when inside one
        self._block_sent = 0  # how much of the block's arguments text has been sent
        self._args_start: int | None = None  # where the arguments start in the block body
        self._index = -1  # index of the current (last) tool call
        self._content_started = False  # whether non-space content has been sent
        self._space = ""  # trailing whitespace of the content, sent once more content follows
        self._whole: bool | None = None  # holding the whole message (Llama JSON candidate)
        self._finished = False

    def feed(self, delta: str) -> list[StreamEvent]:
        """Consume a text delta; return the events it completes."""
        if self._finished:
            raise RuntimeError("this parser has finished; create a new one")
        self.text += delta
        if self._whole is None:
            if not self.llama_json:
                self._whole = False
                return self._scan(delta)
            stripped = self.text.lstrip()
            if not stripped or (len(stripped) < len(PYTHON_TAG) and PYTHON_TAG.startswith(stripped)):
                return []  # undecided: nothing yet, or maybe the start of <|python_tag|>
            self._whole = stripped.startswith(("{", "[", PYTHON_TAG))
            return [] if self._whole else self._scan(self.text)
        return [] if self._whole else self._scan(delta)

    def finish(self) -> list[StreamEvent]:
        """Flush everything held back (call once, after the last delta)."""
        if self._finished:
            return []
        self._finished = True
        if self._whole is None:
            return [ContentDelta(self.text)] if self.text else []
        if self._whole:
            return self._events_from_parsed(parse_tool_calls(self.text))
        events: list[StreamEvent] = []
        if self._block is not None:
            events += self._close_block()
        events += self._content(self._pending)
        self._pending = ""
        return events  # trailing whitespace is dropped, as parse_tool_calls strips it

    def _content(self, text: str) -> list[StreamEvent]:
        """Content events, stripped at both ends of the message like :func:`parse_tool_calls`."""
        text = self._space + text
        if not self._content_started:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if not body:
            return []
        self._content_started = True
        return [ContentDelta(body)]

    # -- internals
    def _scan(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        rest = delta
        while rest:
            if self._block is None:
                text, rest = self._pending + rest, ""
                start = text.find(TOOL_CALL_START)
                if start >= 0:
                    events += self._content(text[:start])
                    self._pending = ""
                    self._block, self._block_sent, self._args_start = "", 0, None
                    self._index += 1
                    rest = text[start + len(TOOL_CALL_START) :]
                    continue
                keep = _partial_suffix(text, TOOL_CALL_START)
                out, self._pending = text[: len(text) - keep], text[len(text) - keep :]
                events += self._content(out)
            else:
                body, rest = self._block + rest, ""
                end = body.find(TOOL_CALL_END)
                if end >= 0:
                    self._block = body[:end]
                    events += self._close_block()
                    rest = body[end + len(TOOL_CALL_END) :]
                    continue
                # keep a possible start of </tool_call> out of the arguments
                keep = _partial_suffix(body, TOOL_CALL_END)
                self._block = body
                events += self._stream_block(body[: len(body) - keep])
        return events

    def _stream_block(self, body: str) -> list[StreamEvent]:
        """Send what is safe of an open block once its head ``{"name": ..., "arguments": `` is known."""
        events: list[StreamEvent] = []
        if self._args_start is None:
            head = _HEAD_RE.match(body)
            if head is None or head.end() == len(body):
                return []  # not (yet) in the streamable shape: the close of the block decides
            self._args_start = head.end()
            events.append(ToolCallChunk(self._index, _unescape(head.group(1)), "", new_call_id()))
        safe = _without_outer_close(body[self._args_start :])
        fragment = safe[self._block_sent :]
        self._block_sent = max(self._block_sent, len(safe))
        if fragment:
            events.append(ToolCallChunk(self._index, None, fragment, None))
        return events

    def _close_block(self) -> list[StreamEvent]:
        body = self._block or ""
        self._block = None
        events = self._stream_block(body)
        if self._args_start is not None:
            return events
        call = _read_call(body)
        if isinstance(call, ToolCall):
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            return [ToolCallChunk(self._index, call.name, arguments, call.id)]
        return [ToolCallChunk(self._index, call.name, call.arguments, call.id)]

    def _events_from_parsed(self, parsed: ParsedOutput) -> list[StreamEvent]:
        if not parsed.tool_calls and not parsed.invalid_tool_calls:
            return [ContentDelta(self.text)] if self.text else []
        events: list[StreamEvent] = [ContentDelta(parsed.content)] if parsed.content else []
        for call in parsed.tool_calls:
            self._index += 1
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            events.append(ToolCallChunk(self._index, call.name, arguments, call.id))
        for bad in parsed.invalid_tool_calls:
            self._index += 1
            events.append(ToolCallChunk(self._index, bad.name, bad.arguments, bad.id))
        return events


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


_OUTER_CLOSE_RE = re.compile(r"\s*\}?\s*\Z")


def _without_outer_close(args: str) -> str:
    """Arguments text without a trailing ``}`` that may close the outer call object.

    While a block grows, its last ``}`` may be the outer object's, so it is held back; at
    the close of the block it is dropped.
    """
    match = _OUTER_CLOSE_RE.search(args)
    return args[: match.start()] if match else args


# ------------------------------------------------------------------------------- schemas
def tool_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise one tool description to ``{"type": "function", "function": {...}}``.

    Accepted forms: OpenAI tools (``{"type": "function", "function": {...}}``), bare OpenAI
    functions (``{"name", "description", "parameters"}``), Anthropic tools (with
    ``input_schema``), and a JSON schema with a ``title`` (the title names the tool).

    Args:
        tool: the tool description.

    Returns:
        A new dict ``{"type": "function", "function": {"name", "description",
        "parameters"}}`` whose ``parameters`` is an object schema.

    Raises:
        ValueError: the description is not one of these forms, the name is missing or not
            a valid tool name, or the parameters are not a JSON object schema.
    """
    if not isinstance(tool, Mapping):
        raise ValueError(f"a tool must be a dict (an OpenAI function or a JSON schema), got {type(tool).__name__}")
    if tool.get("type") == "function" or "function" in tool:
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"an OpenAI tool needs a 'function' dict, got {tool!r}")
    elif "name" in tool:
        function = tool
    elif "title" in tool and ("properties" in tool or tool.get("type") == "object"):
        parameters = {k: v for k, v in tool.items() if k not in ("title", "description")}
        function = {"name": tool["title"], "description": tool.get("description", ""), "parameters": parameters}
    else:
        raise ValueError(
            "cannot read this tool: expected {'type': 'function', 'function': {...}}, "
            f"{{'name', 'description', 'parameters'}}, or a JSON schema with a 'title'; got {tool!r}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME_RE.match(name):
        raise ValueError(f"invalid tool name {name!r}: use 1-64 letters, digits, '_', '-' or '.'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"the description of tool {name!r} must be a string")
    parameters = _object_schema(name, function.get("parameters", function.get("input_schema")))
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def _object_schema(name: str, parameters: Any) -> dict[str, Any]:
    if parameters is None:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ValueError(f"the parameters of tool {name!r} must be a JSON schema dict, got {parameters!r}")
    schema = dict(parameters)
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ValueError(f"the parameters of tool {name!r} must be an object schema, got type {kind!r}")
    properties = schema.setdefault("properties", {})
    if not isinstance(properties, Mapping) or not all(isinstance(v, Mapping) for v in properties.values()):
        raise ValueError(f"'properties' of tool {name!r} must map names to schemas, got {properties!r}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"'required' of tool {name!r} must be a list of property names, got {required!r}")
    missing = [r for r in required if r not in properties]
    if missing:
        raise ValueError(f"tool {name!r} requires undeclared properties: {', '.join(missing)}")
    return schema


def tool_names(tools: Iterable[Mapping[str, Any]]) -> list[str]:
    """The names of normalised tools (see :func:`tool_schema`)."""
    return [tool_schema(t)["function"]["name"] for t in tools]
