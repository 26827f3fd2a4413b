"""One request planner for every front door: ``selfspec serve``, ``ChatSpeculative``, ``SpeculativeLLM``.

A call to the model, whichever door it comes through, is planned here, once:

- **its options** (:class:`RequestOptions`): declared once; each front door translates its own
  names into it (a call's keywords over an adapter's fields, an OpenAI request body), and the
  planner and the endpoint body (:func:`selfspec.serving.endpoint.chat_body`) read it;
- **token budget** (:func:`token_budget`): ``max_tokens`` when given, else the one default
  :data:`DEFAULT_MAX_TOKENS`, never past the end of the context window;
- **tools and their choice** (:func:`normalize_tool_choice`, :func:`forced_tool`): which tool
  calls are offered, forced, or not offered at all; a bad ``tool_choice`` is a ``ValueError``;
- **the prompt** (:func:`encode_request`): chat messages through the tokenizer's template; when
  the template drops the tools (SmolLM2's, for one) they are rendered into the first user message
  in the Llama 3.1 way, and past tool calls into the assistant's text, so that the model reads
  the schemas (names, descriptions, parameters) it is asked to fill; a JSON schema asked for as
  structured output is stated in the last user message (:func:`schema_instruction`);
- **the constraint** (:class:`ConstraintPlan`): a forced tool call, an answer in JSON valid for
  a schema (``json_mode`` with a schema is constrained to that schema), or the calls the model
  chooses to make under ``tool_choice="auto"``; at most one call with
  ``parallel_tool_calls=False``, enforced by the grammar;
- **reading the answer** (:meth:`RequestPlan.parse`): tool calls from the model's own format
  (:func:`selfspec.serving.tools.parse_tool_calls`, or the tokenizer's own ``parse_response``);
- **the repetition guard** (:meth:`RequestPlan.stream`): a call constrained to JSON (a forced
  tool call, a schema) stops with finish reason ``"repetition"`` when a string loops;
- **token usage** (:class:`TokenUsage`): counted here once, from the engine's output or from a
  server's reported counts, and spelt in each front door's own names;
- **the sync→async bridge** (:func:`agenerate`, :func:`aiterate`): the engine runs in a worker
  thread and the event loop stays free; cancelling the awaiting task stops the generation at
  the end of the round in progress (the stream is closed, which frees its KV cache or its row
  of a batching engine).

The framework packages only translate their messages, options and responses to and from this;
``selfspec serve`` only checks the wire format (types, ranges) and hands the request here. A bad
request field is a :class:`RequestFieldError` (a ``ValueError``) naming the field at fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import difflib
import functools
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from ..core.bounds import check_prompt_chars, check_schema_size, check_tools_size, text_chars
from ..decoding.options import check_drafter_name, drafter_settings_of, refuse_unknown_keywords
from ..errors import InvalidPromptError, InvalidSchemaError
from .tools import ParsedOutput, parse_tool_calls, tool_schema

if TYPE_CHECKING:
    from ..core.constraints import TokenConstraint
    from ..decoding.engine import GenerationStream, SpeculativeEngine
    from ..decoding.outputs import GenerationOutput

#: New tokens per answer when a call sets no limit: the same in ``selfspec serve`` (no
#: ``max_tokens``), ``ChatSpeculative`` (``max_tokens=None``) and ``SpeculativeLLM``
#: (``max_new_tokens``' default). Never past the end of the context window.
DEFAULT_MAX_TOKENS = 256

#: How a JSON schema asked for as structured output is stated to the model.
SCHEMA_INSTRUCTION = "Answer with one JSON object that matches this JSON schema: "

#: How tools are stated to a model whose chat template does not render them (Llama 3.1's
#: words, with the Hermes envelope the grammar and the parser use).
TOOLS_INSTRUCTION = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format <tool_call>{"name": function name, "arguments": dictionary of argument '
    "name and its value}</tool_call>. Do not use variables.\n\n"
)

ToolChoice = Literal["auto", "none", "required"] | dict[str, Any]
_T = TypeVar("_T")


class RequestFieldError(ValueError):
    """A request field the planner refuses (``tools``, ``tool_choice``, ``response_format``).

    Attributes:
        field: the OpenAI request field at fault (the server answers 400 with it as ``param``).
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class OversizeFieldError(InvalidSchemaError):
    """Tools or a schema over :mod:`selfspec.core.bounds`' limits, naming the request field.

    Attributes:
        field: ``"tools"`` or ``"response_format"`` (the server answers 400 ``invalid_schema``
            with it as ``param``).
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TokenUsage:
    """A call's token counts, computed once for every front door.

    Attributes:
        prompt_tokens: the prompt's tokens.
        completion_tokens: the tokens generated.
    """

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion."""
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, output: GenerationOutput) -> TokenUsage:
        """The usage of a finished generation."""
        return cls(int(output.prompt_tokens), len(output.token_ids))

    def openai(self) -> dict[str, int]:
        """OpenAI's names (``selfspec serve``'s ``usage``, LlamaIndex's ``raw["usage"]``)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }

    def langchain(self) -> dict[str, int]:
        """LangChain's ``usage_metadata`` names."""
        return {
            "input_tokens": self.prompt_tokens,
            "output_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


# ------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class RequestOptions:
    """A request's options, declared once for every front door.

    The planner (:func:`plan_request`), the endpoint body (:func:`selfspec.serving.endpoint.chat_body`),
    both adapters (local and endpoint mode) and ``selfspec serve``'s two routes read this one
    declaration; each front door translates its own framework's names into it once (a call's
    keyword arguments over the adapter's fields, an OpenAI request body).

    Attributes:
        max_tokens: the budget (``None``: :data:`DEFAULT_MAX_TOKENS`, never past the context window).
        temperature: 0 for greedy decoding.
        top_p: nucleus sampling.
        top_k: top-k sampling.
        seed: sampling seed.
        stop: stop strings.
        tools: tools in any form :func:`selfspec.serving.tools.tool_schema` reads.
        tool_choice: see :func:`normalize_tool_choice`.
        response_format: an OpenAI-style ``response_format`` (see :func:`response_schema`).
        json_schema: a JSON schema for the answer (instead of ``response_format``).
        truncate_prompt: keep only the end of a prompt that does not fit.
        constrain_tool_calls: constrain the calls the model chooses to make.
        parallel_tool_calls: ``False``: at most one call (by the grammar).
        escape_special_tokens: encode special-token strings in the messages and tools as plain
            text for this call (the engine's own setting applies as well).
        logprobs: report each token's log-probability and this many most likely alternatives
            (``None``: none; see :meth:`SpeculativeEngine.generate`).
        fit_max_tokens: cut a ``max_tokens`` that does not fit to the context window (the
            adapters); ``False`` leaves it for the engine to refuse (``selfspec serve``).
        budget_name: what the caller called ``max_tokens`` (``SpeculativeLLM``'s ``max_new_tokens``
            alias): a bad budget's error names it.
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    tools: Sequence[Any] | None = None
    tool_choice: Any = None
    response_format: Mapping[str, Any] | None = None
    json_schema: Mapping[str, Any] | None = None
    truncate_prompt: bool = False
    constrain_tool_calls: bool = True
    parallel_tool_calls: bool = True
    escape_special_tokens: bool = False
    logprobs: int | None = None
    fit_max_tokens: bool = True
    budget_name: str = "max_tokens"

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name, in declaration order."""
        return [declared.name for declared in fields(cls)]

    @classmethod
    def of(
        cls,
        options: RequestOptions | None = None,
        keywords: Mapping[str, Any] | None = None,
        caller: str = "RequestOptions",
    ) -> RequestOptions:
        """``options`` (default: the defaults) with ``keywords`` replacing its fields.

        Raises:
            TypeError: an unknown keyword, naming the closest option (as Python does for a bad keyword).
        """
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"{caller}() options must be a RequestOptions, got {type(base).__name__}")
        keywords = keywords or {}
        refuse_unknown_keywords(caller, keywords, cls.names())
        return replace(base, **keywords) if keywords else base

    @classmethod
    def of_fields(cls, adapter: Any, **call: Any) -> RequestOptions:
        """An adapter's options: its pydantic fields named like an option, then ``call`` over them.

        Args:
            adapter: a framework model whose fields hold the defaults (``ChatSpeculative``,
                ``SpeculativeLLM``: ``temperature``, ``stop``, ``truncate_prompt``, ...).
            **call: one call's options, already in this declaration's names.
        """
        declared = getattr(type(adapter), "model_fields", {})
        values = {name: getattr(adapter, name) for name in cls.names() if name in declared}
        return cls.of(None, {**values, **call}, type(adapter).__name__)

    @property
    def stop_list(self) -> list[str] | None:
        """The stop strings as a list (``None``: none)."""
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ------------------------------------------------------------------------------- budget
def token_budget(
    max_tokens: int | None,
    prompt_length: int,
    context_window: int | None,
    *,
    truncate_prompt: bool = False,
    fit_max_tokens: bool = True,
) -> int:
    """New tokens a call may generate.

    ``max_tokens`` when given, else :data:`DEFAULT_MAX_TOKENS`; never past the end of the
    context window. With ``truncate_prompt`` the engine cuts the prompt instead, so the budget
    is kept (a prompt that fills the window leaves ``min(DEFAULT_MAX_TOKENS, window // 2)``).
    With ``fit_max_tokens=False`` (``selfspec serve``, as OpenAI's API does) a ``max_tokens``
    given that does not fit is kept, for the engine to refuse; the default still fits.

    Args:
        max_tokens: the caller's limit, or ``None``. An invalid value (not a positive int) is
            returned as it is, for the engine to refuse with an error naming ``max_new_tokens``.
        prompt_length: the prompt's tokens.
        context_window: the model's window, or ``None`` when it declares none.
        truncate_prompt: whether the engine keeps only the end of a prompt that does not fit.
        fit_max_tokens: cut a ``max_tokens`` that does not fit (``False``: leave it for the engine to refuse).

    Raises:
        InvalidPromptError: the prompt fills the window (and ``truncate_prompt`` is off).
    """
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        return max_tokens  # the engine refuses it with a SamplingError naming max_new_tokens
    requested = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if context_window is None:
        return requested
    room = context_window - prompt_length
    if truncate_prompt:
        if max_tokens is not None:
            return max_tokens
        return min(requested, room if room >= 1 else context_window // 2)
    if max_tokens is not None and not fit_max_tokens:
        return max_tokens  # the engine refuses it, naming the context window
    if room < 1:
        raise InvalidPromptError(
            f"the prompt ({prompt_length} tokens) fills the model's context window of {context_window} tokens "
            "(or pass truncate_prompt=True to keep only its end)"
        )
    return min(requested, room)


# ------------------------------------------------------------------------------- arguments
def check_arguments(owner: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Refuse unknown argument names, naming the closest known one.

    Raises:
        ValueError: e.g. ``SpeculativeLLM got an unknown argument 'temprature' (did you mean
            'temperature'?)``.
    """
    names = sorted(set(known))
    unknown = sorted(set(given) - set(names))
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(unknown) > 1 else ""
    raise ValueError(f"{owner} got {'an ' if not plural else ''}unknown argument{plural} {', '.join(hints)}")


def check_adapter_drafter(kwargs: Mapping[str, Any]) -> None:
    """An adapter constructor's first check: its ``drafter``, in local mode, before any field is set.

    Endpoint mode (a ``base_url``) ignores the drafter. Imports no torch.

    Raises:
        ConfigurationError: an unknown drafter name (``"eagle3"``), with the valid names and the
            closest one; a custom drafter is accepted once ``register_drafter`` registered it.
    """
    if kwargs.get("base_url") is None:
        check_drafter_name(kwargs.get("drafter", "auto"))


def adapter_arguments(
    owner: str, values: dict[str, Any], fields: Mapping[str, Any], also_known: Iterable[str] = ()
) -> dict[str, Any]:
    """An adapter constructor's keywords, checked (what ``ChatSpeculative`` and ``SpeculativeLLM`` share).

    ``model_name`` (ChatOpenAI's name) becomes ``model``; the options of drafters registered after
    the adapter's class was made move to ``drafter_settings``; any other name the class does not
    know is refused, naming the closest one (:func:`check_arguments`).

    Args:
        owner: the adapter's class name, for the messages.
        values: the keywords given.
        fields: the class's pydantic ``model_fields`` (their aliases count as known).
        also_known: other names the class accepts.

    Raises:
        ValueError: ``model`` and ``model_name`` both given and different, or an unknown argument.
    """
    values = dict(values)
    if "model_name" in values:
        if "model" in values and values["model"] != values["model_name"]:
            raise ValueError("pass either model or its alias model_name, not both")
        values["model"] = values.pop("model_name")
    values = drafter_settings_of(values, fields)
    known = set(fields) | {f.alias for f in fields.values() if f.alias} | set(also_known)
    check_arguments(owner, values, known)
    return values


# ------------------------------------------------------------------------------- tools
def normalize_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """Tools as ``{"type": "function", "function": {...}}`` (see :func:`selfspec.serving.tools.tool_schema`)."""
    return [tool_schema(tool) for tool in tools or []]


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> ToolChoice:
    """A ``tool_choice`` in OpenAI's form: ``"auto"``, ``"none"``, ``"required"`` or a named function.

    The one normaliser of every front door (``selfspec serve``, both adapters, local and
    endpoint). Accepted: ``None``/``"auto"``/``False`` (the model decides), ``"none"``,
    ``"any"``/``"required"``/``True`` (some tool must be called), a tool's name, or
    ``{"type": "function", "function": {"name": ...}}`` (also ``{"name": ...}``); a dict whose
    ``type`` is not ``"function"`` is refused, as OpenAI refuses it.

    Raises:
        ValueError: a forced choice without tools, an unknown name or an unknown value.
    """
    if choice is None or choice is False or choice == "auto":
        return "auto"
    if choice == "none":
        return "none"
    if isinstance(choice, Mapping):
        if choice.get("type", "function") != "function":
            raise ValueError(f"tool_choice type {choice.get('type')!r} is not supported (only 'function')")
        function = choice.get("function") if isinstance(choice.get("function"), Mapping) else choice
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise ValueError(f"tool_choice {dict(choice)!r} names no function")
        choice = name
    if not isinstance(choice, (str, bool)):
        raise ValueError(
            f"tool_choice must be 'auto', 'none', 'any', 'required', a tool name or a dict, got {choice!r}"
        )
    if not names:
        raise ValueError(f"tool_choice={choice!r} needs at least one tool")
    if choice is True or choice in ("any", "required"):
        return "required"
    if choice in names:
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"tool_choice {choice!r} is not one of the tools ({', '.join(names)}) nor auto/any/required/none")


@dataclass(frozen=True)
class ToolOffer:
    """The tools a call offers and its choice among them, read once for local and endpoint mode.

    Attributes:
        tools: the tools offered, normalised (empty when none are, or ``tool_choice="none"``).
        choice: the normalised ``tool_choice`` (``None`` when no tool is offered).
    """

    tools: list[dict[str, Any]]
    choice: ToolChoice | None

    @property
    def forced(self) -> str | None:
        """``None`` when nothing is forced, ``""`` when any tool must be called, else the tool's name."""
        return forced_tool(self.choice, self.tools) if self.choice is not None else None


def offer_tools(tools: Sequence[Any] | None, tool_choice: Any) -> ToolOffer:
    """Read ``tools`` and ``tool_choice`` (:func:`normalize_tools`, :func:`normalize_tool_choice`).

    Raises:
        RequestFieldError: a bad tool (``tools``) or a bad ``tool_choice``.
    """
    with _field("tools"):
        normalized = normalize_tools(tools)
    with _field("tool_choice"):
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in normalized])
    if choice == "none" or not normalized:
        return ToolOffer([], None)
    return ToolOffer(normalized, choice)


def forced_tool(choice: ToolChoice, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """``None`` when nothing is forced, ``""`` when any tool must be called, else the tool's name."""
    if not tools or choice in ("auto", "none"):
        return None
    if choice == "required":
        return ""
    if isinstance(choice, Mapping):
        return str(choice["function"]["name"])
    raise ValueError(f"unknown tool_choice {choice!r}")


def response_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema an OpenAI-style ``response_format`` asks for (``None``: plain text).

    ``{"type": "json_object"}`` is any JSON object, unless it carries a ``schema`` (as
    LangChain's ``json_mode`` does when given one): then that schema.

    Raises:
        ValueError: an unknown format, or ``json_schema`` without a schema.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise ValueError(f"response_format must be a dict, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    schema = response_format.get("schema")
    if schema is None and isinstance(response_format.get("json_schema"), Mapping):
        schema = response_format["json_schema"].get("schema")
    if kind == "json_object":
        return dict(schema) if isinstance(schema, Mapping) else {"type": "object"}
    if kind == "json_schema" and isinstance(schema, Mapping):
        return dict(schema)
    raise ValueError(
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{'schema': {{...}}}}}}, got {dict(response_format)!r}"
    )


def check_request_bounds(
    engine: SpeculativeEngine,
    prompt: str | Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    schema: Mapping[str, Any] | None,
    *,
    truncate_prompt: bool = False,
) -> None:
    """Refuse, before rendering, tokenizing or compiling anything, what is too large (:mod:`selfspec.bounds`).

    The tools and the schema are bounded in size; the characters of everything that becomes
    prompt (messages, tool-call arguments, tools and schema, dictionary keys included) must fit
    the context window unless ``truncate_prompt``. The one place every front door checks these
    (``selfspec serve`` too: its answers name the field, ``invalid_schema`` or
    ``context_length_exceeded``).

    Raises:
        OversizeFieldError: tools or a schema over the bounds (an ``InvalidSchemaError`` naming
            ``tools`` or ``response_format``).
        PromptTooLongError: more characters than the context window can hold (an ``InvalidPromptError``).
    """
    try:
        if tools:
            check_tools_size(list(tools))
    except InvalidSchemaError as error:
        raise OversizeFieldError(str(error), "tools") from None
    try:
        if schema is not None:
            check_schema_size(schema)
    except InvalidSchemaError as error:
        raise OversizeFieldError(str(error), "response_format") from None
    if not truncate_prompt and engine.tokenizer is not None:
        chars = text_chars(prompt) + text_chars(list(tools)) + (text_chars(schema) if schema is not None else 0)
        check_prompt_chars(chars, engine.tokenizer, engine.context_window)


# ------------------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class ConstraintPlan:
    """Which grammar constrains a call (built fresh per generation by :meth:`build`).

    Attributes:
        kind: ``"tool_call"`` or ``"json_schema"``.
        tools: the tools (``"tool_call"``).
        tool_name: the forced tool, or ``None`` for any of them.
        required: whether a call is required (else free text or calls).
        parallel: whether several calls may follow each other (``required=False`` only).
        schema: the JSON schema (``"json_schema"``).
    """

    kind: Literal["tool_call", "json_schema"]
    tools: tuple[Any, ...] = ()
    tool_name: str | None = None
    required: bool = True
    parallel: bool = True
    schema: Mapping[str, Any] | None = None

    def build(self, engine: SpeculativeEngine) -> TokenConstraint:
        """A fresh constraint for one generation on ``engine`` (llguidance is imported here)."""
        from . import grammar

        common: dict[str, Any] = {"vocab_size": logits_vocab_size(engine), "eos_token_ids": engine.eos_token_ids}
        if self.kind == "json_schema":
            assert self.schema is not None
            return grammar.json_schema_constraint(engine.tokenizer, self.schema, **common)
        return grammar.tool_call_constraint(
            engine.tokenizer,
            list(self.tools),
            tool_name=self.tool_name,
            required=self.required,
            parallel=self.parallel,
            **common,
        )


def logits_vocab_size(engine: SpeculativeEngine) -> int | None:
    """The length of the engine's logits (it may exceed the tokenizer's vocabulary)."""
    for name in ("runner", "adapter"):
        part = getattr(engine, name, None)
        size = getattr(part, "vocab_size", None)
        if isinstance(size, int):
            return size
    size = getattr(getattr(engine.model, "config", None), "vocab_size", None)
    return int(size) if size is not None else None


def plan_constraint(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    forced: str | None,
    schema: Mapping[str, Any] | None,
    *,
    constrain_tool_calls: bool = True,
    parallel_tool_calls: bool = True,
) -> ConstraintPlan | None:
    """The grammar of a call, or ``None`` for free text.

    A forced tool call wins; then a JSON schema; then, with tools offered and
    ``constrain_tool_calls``, the calls the model chooses to make (when ``<tool_call>`` is a
    single token, so that free text cannot spell it; else calls are only parsed).

    Raises:
        ValueError: a forced tool call together with a JSON schema.
    """
    if forced is not None:
        if schema is not None:
            raise ValueError("a forced tool_choice and a response_format cannot be combined")
        return ConstraintPlan("tool_call", tuple(tools), tool_name=forced or None)
    if schema is not None:
        return ConstraintPlan("json_schema", schema=schema)
    if tools and constrain_tool_calls and _can_constrain_calls(tokenizer):
        return ConstraintPlan("tool_call", tuple(tools), required=False, parallel=parallel_tool_calls)
    return None


def _can_constrain_calls(tokenizer: Any) -> bool:
    import importlib.util

    if importlib.util.find_spec("llguidance") is None:
        return False
    from .grammar import has_tool_call_tokens

    return has_tool_call_tokens(tokenizer)


# ------------------------------------------------------------------------------- prompts
def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows offered tools to the model."""
    return _template_support(tokenizer)[0]


def template_renders_tool_calls(tokenizer: Any) -> bool:
    """Whether the chat template shows an assistant's past tool calls to the model."""
    return _template_support(tokenizer)[1]


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "selfspec_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"selfspec_probe_arg": {"type": "string"}}},
    },
}


@functools.lru_cache(maxsize=32)
def _template_support_cached(tokenizer_id: int, template: str) -> tuple[bool, bool]:
    tokenizer = _PROBED[tokenizer_id]
    user = [{"role": "user", "content": "hi"}]
    try:
        with_tools = tokenizer.apply_chat_template(
            user, tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        with_tools = ""
    call = {"type": "function", "id": "call_0", "function": {"name": "selfspec_probe_tool", "arguments": {}}}
    history = [*user, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        with_calls = tokenizer.apply_chat_template(history, tools=[_PROBE_TOOL], tokenize=False)
    except Exception:  # noqa: BLE001
        with_calls = ""
    return "selfspec_probe_arg" in with_tools, with_calls.count("selfspec_probe_tool") > with_tools.count(
        "selfspec_probe_tool"
    )


_PROBED: dict[int, Any] = {}


def _template_support(tokenizer: Any) -> tuple[bool, bool]:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return True, True  # no template (or several): nothing to add
    _PROBED[id(tokenizer)] = tokenizer
    return _template_support_cached(id(tokenizer), template)


def tools_message_text(tools: Sequence[Mapping[str, Any]], user_text: str) -> str:
    """A user message that states ``tools`` before ``user_text`` (Llama 3.1's layout)."""
    listed = "\n\n".join(json.dumps(dict(tool), indent=4, ensure_ascii=False) for tool in tools)
    return f"{TOOLS_INSTRUCTION}{listed}\n\n{user_text}"


def schema_instruction(schema: Mapping[str, Any]) -> str:
    """The sentence that states a structured-output schema to the model.

    The titles Pydantic generates for properties (``"title": "Setup"`` for ``setup``) are left
    out: they repeat the key, and without them a Pydantic class and its JSON schema are stated
    alike (with them, SmolLM2-135M's greedy decoding looped inside a string for LangChain's
    JSON-mode prompt, and answered in 40 tokens without).
    """
    return SCHEMA_INSTRUCTION + json.dumps(without_generated_titles(schema), ensure_ascii=False)


def without_generated_titles(schema: Any) -> Any:
    """A copy of ``schema`` without the property titles Pydantic derives from their keys."""
    if isinstance(schema, list):
        return [without_generated_titles(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    copy = {key: without_generated_titles(value) for key, value in schema.items()}
    properties = copy.get("properties")
    if isinstance(properties, dict):
        for key, value in properties.items():
            if isinstance(value, dict) and value.get("title") == key.replace("_", " ").title():
                properties[key] = {k: v for k, v in value.items() if k != "title"}
    return copy


def forced_call_instruction(tools: Sequence[Mapping[str, Any]], forced: str) -> str:
    """The sentence that states a forced tool choice (``forced=""``: any of the tools).

    It names the tool only: its schema is in the tool listing already (:func:`tools_message_text`).
    Stating the schema a second time, compact, after the request made SmolLM2-135M's greedy
    decoding copy from it and loop inside a string (LangChain's optional-parameter prompt);
    stated once, every structured-output prompt of the standard suite ends its call.
    """
    if forced and not any(t["function"]["name"] == forced for t in tools):
        raise ValueError(f"tool_choice {forced!r} is not one of the tools")
    return f"Call {forced}." if forced else "Call one of the functions."


def prepare_messages(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    schema: Mapping[str, Any] | None = None,
    forced: str | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to hand to the chat template.

    Where the template drops the tools, they are written into the first user message (and the
    template gets none), with a forced choice named at the end of the last user message
    (its schema is in the listing); where it drops past tool calls, they are
    written into the assistant's text in the ``<tool_call>`` form the model is asked to use. A
    ``schema`` (structured output) is stated at the end of the last user message.

    Returns:
        ``(messages, tools)``: new message dicts, and the tools for ``apply_chat_template``
        (``None`` when there are none or they were written into the messages).
    """
    prepared = [dict(message) for message in messages]
    renders_tools, renders_calls = _template_support(tokenizer)
    if not renders_calls:
        for message in prepared:
            if message.get("role") == "assistant" and message.get("tool_calls"):
                blocks = [_call_text(call) for call in message.pop("tool_calls")]
                message["content"] = "".join([str(message.get("content") or ""), *blocks])
    template_tools: list[dict[str, Any]] | None = [dict(t) for t in tools] or None
    if tools and not renders_tools:
        first_user = next((m for m in prepared if m.get("role") == "user"), None)
        if first_user is None:
            prepared.append(first_user := {"role": "user", "content": ""})
        first_user["content"] = tools_message_text(tools, str(first_user.get("content") or ""))
        template_tools = None
        if forced is not None:
            _append_to_last_user(prepared, forced_call_instruction(tools, forced))
    if schema is not None:
        _append_to_last_user(prepared, schema_instruction(schema))
    return prepared, template_tools


def _append_to_last_user(messages: list[dict[str, Any]], text: str) -> None:
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if last_user is None:
        messages.append(last_user := {"role": "user", "content": ""})
    last_user["content"] = f"{last_user.get('content') or ''}\n\n{text}".strip()


def _call_text(call: Mapping[str, Any]) -> str:
    function: Mapping[str, Any] = call["function"] if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def encode_request(
    engine: SpeculativeEngine,
    prompt: str | Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] = (),
    schema: Mapping[str, Any] | None = None,
    forced: str | None = None,
    *,
    escape_special_tokens: bool = False,
) -> list[int]:
    """The prompt's token ids (see :func:`prepare_messages`); a ``str`` is encoded as it is.

    With ``escape_special_tokens`` (or the engine's own setting), special-token strings in the
    messages, tools and schema are encoded as plain text (:mod:`selfspec.escaping`).
    """
    escape = {"escape_special_tokens": True} if escape_special_tokens else {}
    if isinstance(prompt, str):
        return engine.encode_prompt(prompt)
    if getattr(engine.tokenizer, "chat_template", None) is None:
        return engine.encode_prompt([dict(m) for m in prompt], tools=[dict(t) for t in tools] or None, **escape)
    messages, template_tools = prepare_messages(engine.tokenizer, prompt, tools, schema, forced)
    return engine.encode_prompt(messages, tools=template_tools, **escape)


# ------------------------------------------------------------------------------- the plan
@dataclass
class RequestPlan:
    """One call, planned: prompt ids, budget, sampling, constraint and how to read the answer.

    Attributes:
        engine: the engine that runs it.
        prompt_ids: the encoded prompt.
        max_new_tokens: the budget (:func:`token_budget`).
        sampling: ``temperature``, ``top_p``, ``top_k``, ``stop``, ``seed``.
        truncate_prompt: whether the engine keeps only the end of a prompt that does not fit.
        constraint: the grammar, or ``None``.
        parse_tools: whether tool calls are read from the answer.
        repetition: the repeated piece of text, once the call was stopped because its JSON
            degenerated into repetition (:class:`selfspec.decoding.stopping.RepetitionDetector`).
        logprobs: ``None``, or report each token's log-probability and this many alternatives.
    """

    engine: SpeculativeEngine
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    truncate_prompt: bool = False
    constraint: ConstraintPlan | None = None
    parse_tools: bool = False
    repetition: str | None = None
    logprobs: int | None = None

    @property
    def guards_repetition(self) -> bool:
        """Whether the call stops early on a loop inside a JSON string (required JSON only)."""
        return self.constraint is not None and self.constraint.required

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``engine.generate_ids`` / ``stream_ids`` (with a fresh constraint)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            **self.sampling,
            "truncate_prompt": self.truncate_prompt,
            "constraint": self.constraint.build(self.engine) if self.constraint is not None else None,
            "logprobs": self.logprobs,
        }

    def generate(self) -> GenerationOutput:
        """Run the call to the end (blocking)."""
        if not self.guards_repetition:
            return self.engine.generate_ids(self.prompt_ids, **self.options())
        stream = self.stream()
        try:
            for _ in stream:
                pass
        finally:
            stream.close()
        assert stream.output is not None
        return stream.output

    def stream(self) -> GenerationStream:
        """Stream the call's text deltas (close the stream to stop).

        A call constrained to JSON (a forced tool call, a JSON schema) is watched for
        degenerate repetition: when a string value turns into a loop, the stream stops there,
        :attr:`repetition` is set and :meth:`finish_reason` says ``"repetition"``.
        """
        stream = self.engine.stream_ids(self.prompt_ids, **self.options())
        if not self.guards_repetition:
            return stream
        return cast("GenerationStream", _RepetitionGuard(stream, self))

    def finish_reason(self, output: GenerationOutput) -> str:
        """The answer's finish reason: the engine's, or ``"repetition"`` when the call was stopped on a loop."""
        return "repetition" if self.repetition is not None else output.finish_reason

    def parse(self, text: str) -> ParsedOutput:
        """The answer split into content and tool calls (no calls unless tools were offered)."""
        if not self.parse_tools:
            return ParsedOutput(content=text)
        return parse_tool_calls(text, tokenizer=self.engine.tokenizer)

    def cut_message(self, output: GenerationOutput, what: str) -> str | None:
        """A clear message when ``what`` (a tool call, JSON) was cut (budget, repetition), else ``None``."""
        reason = self.finish_reason(output)
        if reason not in INCOMPLETE_REASONS or self.constraint is None:
            return None
        return cut_off_message(what, self.max_new_tokens, len(output.token_ids), reason)


#: The finish reasons of an answer that stopped before its JSON was complete.
INCOMPLETE_REASONS = ("length", "repetition")


def cut_off_message(
    what: str, max_tokens: int | None, used: int | None, finish_reason: str = "length", *, name: str = "max_tokens"
) -> str:
    """The error text for structured output or a tool call cut off by the budget or by repetition.

    Args:
        what: what was cut (``"Joke tool call"``, ``"JSON answer"``).
        max_tokens: the budget.
        used: the tokens generated.
        finish_reason: ``"length"`` (the budget ran out) or ``"repetition"`` (stopped on a loop).
        name: what the caller called the budget (``SpeculativeLLM``'s alias ``max_new_tokens``).
    """
    if finish_reason == "repetition":
        return (
            f"the {what} degenerated into repetition (one piece of text repeated over and over inside a JSON "
            f"string) and was stopped after {used} tokens used ({name}={max_tokens}) before it was "
            "complete; the model loops on this prompt: state the fields' meaning in the prompt, rephrase it, "
            "or sample (temperature > 0)"
        )
    return (
        f"the {what} was cut off at {name}={max_tokens} ({used} tokens used) before it was complete; "
        f"raise {name} (docs/langchain.md and docs/llamaindex.md say how many tokens a schema needs)"
    )


class _RepetitionGuard(Iterator[str]):
    """A :class:`GenerationStream` that stops when its JSON degenerates into repetition.

    The deltas are the engine's, unchanged (greedy stays greedy); the guard only ends the
    stream early, closing the engine's stream (which frees its KV cache), and records the
    repeated piece on the plan.
    """

    def __init__(self, stream: GenerationStream, plan: RequestPlan) -> None:
        from ..decoding.stopping import RepetitionDetector

        self._stream = stream
        self._plan = plan
        self._detector = RepetitionDetector()

    def __iter__(self) -> _RepetitionGuard:
        return self

    def __next__(self) -> str:
        if self._detector.detected:
            raise StopIteration
        delta = next(self._stream)
        if self._detector.push(delta):
            self._plan.repetition = self._detector.unit
            self._stream.close()
        return delta

    def close(self) -> None:
        """Stop generating (see :meth:`GenerationStream.close`)."""
        self._stream.close()

    @property
    def output(self) -> GenerationOutput | None:
        """The engine's output once the stream is over."""
        return self._stream.output

    @property
    def stats(self) -> Any:
        """The engine's statistics once the stream is over."""
        return self._stream.stats

    @property
    def logprobs(self) -> Any:
        """The engine's log-probabilities of the tokens so far (``None`` unless asked for)."""
        return self._stream.logprobs

    @property
    def finish_reason(self) -> str | None:
        """``"repetition"`` when stopped on a loop, else the engine's finish reason."""
        if self._stream.output is None:
            return None
        return self._plan.finish_reason(self._stream.output)

    def __enter__(self) -> _RepetitionGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_request(
    engine: SpeculativeEngine,
    prompt: str | Sequence[Mapping[str, Any]] | Sequence[int],
    options: RequestOptions | None = None,
    **keywords: Any,
) -> RequestPlan:
    """Plan one call on ``engine``: everything but the framework's own types.

    Args:
        engine: the engine.
        prompt: a raw string (no template, no tools), chat messages, or token ids.
        options: the call's options (:class:`RequestOptions`; ``None``: the defaults).
        **keywords: :class:`RequestOptions` fields, replacing those of ``options``
            (``plan_request(engine, prompt, max_tokens=8)``).

    Raises:
        TypeError: a keyword that is not a :class:`RequestOptions` field.
        SamplingError: ``max_tokens`` is not an int >= 1 (before the prompt is encoded).
        RequestFieldError: bad tools, ``tool_choice`` or ``response_format`` (a ``ValueError``
            naming the field).
        InvalidSchemaError: tools or a schema over the bounds.
        InvalidPromptError: an empty prompt or one that fills the context window.
    """
    options = RequestOptions.of(options, keywords, "plan_request")
    max_tokens = options.max_tokens
    if max_tokens is not None:
        from ..core.validation import check_max_new_tokens  # torch: a local engine is loaded already

        max_tokens = check_max_new_tokens(max_tokens, name=options.budget_name)
    offer = offer_tools(options.tools, options.tool_choice)
    normalized, forced = offer.tools, offer.forced
    with _field("response_format"):
        json_schema = options.json_schema
        schema = dict(json_schema) if json_schema is not None else response_schema(options.response_format)
    token_ids = [int(token) for token in cast("Sequence[int]", prompt)] if _is_token_ids(prompt) else None
    text = cast("str | Sequence[Mapping[str, Any]]", prompt)
    if token_ids is None:
        check_request_bounds(engine, text, normalized, schema, truncate_prompt=options.truncate_prompt)
    with _field("tool_choice"):
        constraint = plan_constraint(
            engine.tokenizer,
            normalized,
            forced,
            schema,
            constrain_tool_calls=options.constrain_tool_calls,
            parallel_tool_calls=options.parallel_tool_calls,
        )
    stated_schema = schema if schema is not None and schema != {"type": "object"} else None
    if token_ids is not None:
        prompt_ids = token_ids
    else:
        prompt_ids = encode_request(
            engine, text, normalized, stated_schema, forced, escape_special_tokens=options.escape_special_tokens
        )
    budget = token_budget(
        max_tokens,
        len(prompt_ids),
        engine.context_window,
        truncate_prompt=options.truncate_prompt,
        fit_max_tokens=options.fit_max_tokens,
    )
    sampling: dict[str, Any] = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "seed": options.seed,
        "stop": options.stop_list or None,
    }
    return RequestPlan(
        engine=engine,
        prompt_ids=prompt_ids,
        max_new_tokens=budget,
        sampling=sampling,
        truncate_prompt=options.truncate_prompt,
        constraint=constraint,
        parse_tools=bool(normalized) and schema is None,
        logprobs=options.logprobs,
    )


def _is_token_ids(prompt: Any) -> bool:
    """Whether ``prompt`` is already token ids (``selfspec serve``'s ``/v1/completions`` takes them)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


@contextlib.contextmanager
def _field(name: str) -> Iterator[None]:
    """Turn a ``ValueError`` into a :class:`RequestFieldError` naming the request field ``name``."""
    try:
        yield
    except RequestFieldError:
        raise
    except ValueError as error:
        if type(error) is not ValueError:  # a typed error (InvalidSchemaError, ...) keeps its type
            raise
        raise RequestFieldError(str(error), name) from error


# ------------------------------------------------------------------------------- sync -> async
_DONE = object()


async def agenerate(make_stream: Callable[[], GenerationStream]) -> GenerationOutput:
    """Run a generation in a worker thread; cancelling the caller stops it within a round.

    The worker iterates the stream and checks a cancel flag between deltas; when the awaiting
    task is cancelled the flag is set and the worker closes the stream after the round in
    progress (freeing its KV cache, or its row of a batching engine).

    Args:
        make_stream: builds the stream (called in the worker: encoding and grammars take time).

    Returns:
        The finished generation's output.
    """
    loop = asyncio.get_running_loop()
    cancel = threading.Event()

    def work() -> GenerationOutput:
        if cancel.is_set():
            raise asyncio.CancelledError
        stream = make_stream()
        try:
            for _ in stream:
                if cancel.is_set():
                    break
        finally:
            stream.close()
        assert stream.output is not None
        return stream.output

    future = loop.run_in_executor(None, contextvars.copy_context().run, work)
    try:
        return await future
    except asyncio.CancelledError:
        cancel.set()
        raise


async def aiterate(make_iterator: Callable[[], Iterator[_T]]) -> AsyncIterator[_T]:
    """Yield a blocking iterator's items from a worker thread, without blocking the event loop.

    One thread owns the iterator from creation to close. When the consumer stops early (or is
    cancelled), the worker stops after the item in progress and closes the iterator, which
    closes the engine's stream (the generation stops within a round).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    stopped = threading.Event()

    def put(item: Any, error: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the loop is closed: nobody is listening
            stopped.set()

    def work() -> None:
        try:
            if stopped.is_set():
                put(_DONE)
                return
            iterator = make_iterator()
            try:
                for item in iterator:
                    if stopped.is_set():
                        break
                    put(item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            put(_DONE, error)
        else:
            put(_DONE)

    worker = loop.run_in_executor(None, contextvars.copy_context().run, work)
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                if error is not None:
                    raise error
                break
            yield item
    finally:
        stopped.set()
        await asyncio.shield(worker)
