"""Grammar-constrained decoding with llguidance: JSON schemas and forced tool calls.

A constraint here is a :class:`~selfspec.core.constraints.TokenConstraint`: an llguidance
``LLMatcher`` that gives the allowed next tokens as a mask over the model's logits. The
engine applies the same masks to the draft and to the target, so constrained speculation
samples exactly the constrained distribution that plain decoding would.

llguidance (Microsoft, https://github.com/guidance-ai/llguidance) was chosen by measurement
(``FACTS.md``): one dependency-free wheel, a tokenizer built from a transformers fast tokenizer
in milliseconds, 0.01-0.1 ms per mask, and ``rollback`` for rejected drafts. It is imported on
first use only.

JSON is generated in the form of Python's ``json.dumps`` (``", "`` and ``": "``, no other
whitespace), the form chat templates' ``tojson`` renders in the prompt history, so the model
is asked for the text it has seen. Objects that declare ``properties`` accept only those
(as OpenAI's strict mode) unless the schema sets ``additionalProperties`` itself.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..core.bounds import check_schema_size, check_tools_size
from ..errors import InvalidSchemaError, one_line
from .tools import TOOL_CALL_END, TOOL_CALL_START, tool_schema

#: JSON layout options passed to llguidance (a schema's own ``x-guidance`` wins).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_MATCHER_CACHE_SIZE = 64
_MASK_CACHE_SIZE = 32
#: Tokens a new grammar is walked through before decoding (each the first it allows), so that a
#: schema whose very first value is too complex for the parser is refused up front.
PROBE_STEPS = 8

_lock = threading.Lock()
_ll_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()
_matchers: OrderedDict[tuple[int, str], Any] = OrderedDict()


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "constrained decoding (structured output, forced tool calls) needs llguidance: "
            "pip install 'llguidance>=1.0'"
        ) from error
    return llguidance


def _native_failure(error: BaseException) -> bool:
    """Whether ``error`` came from the grammar library (a Python error, or a Rust panic: a BaseException)."""
    return not isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError))


class GrammarConstraint:
    """A :class:`~selfspec.core.constraints.TokenConstraint` backed by an llguidance matcher.

    Once the grammar is complete only end-of-sequence tokens are allowed; tokens the engine
    advances past that point (drafts beyond the end) are counted but not fed to the matcher,
    so :meth:`rollback` stays exact.

    Args:
        matcher: a fresh ``llguidance.LLMatcher``.
        vocab_size: length of the masks: the model's logits vocabulary (tokens beyond the
            tokenizer's are never allowed).
        eos_token_ids: the end-of-sequence tokens allowed once the grammar is complete.
        tokenizer_vocab_size: the vocabulary of the matcher's llguidance tokenizer (default
            ``vocab_size``).
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        tokenizer_vocab_size: int | None = None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        words = ((tokenizer_vocab_size or vocab_size) + 31) // 32  # llguidance's mask: 32 tokens a word
        self._bitmask = torch.zeros((1, words), dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._eos_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self._eos_mask[[t for t in self.eos_token_ids if t < vocab_size]] = True
        self._fed: list[bool] = []  # per advanced token: whether the matcher consumed it
        self._tokens: list[int] = []  # the advanced tokens
        # masks by prefix: a round computes each position's mask while drafting, then again
        # while verifying; the second time is a lookup
        self._masks: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()

    def allowed_tokens(self) -> torch.Tensor:
        """A ``[vocab_size]`` bool mask of the tokens the grammar allows next."""
        key = tuple(self._tokens)
        cached = self._masks.get(key)
        if cached is None:
            cached = self._compute_mask()
            self._masks[key] = cached
            if len(self._masks) > _MASK_CACHE_SIZE:
                self._masks.popitem(last=False)
        return cached.clone()

    def _compute_mask(self) -> torch.Tensor:
        if self.matcher.is_stopped():
            return self._eos_mask.clone()
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        bits = ((self._bitmask[0].unsqueeze(1) >> self._shifts) & 1).view(-1).bool()  # [words * 32]
        if bits.shape[0] >= self.vocab_size:
            allowed = bits[: self.vocab_size]
        else:  # the model's vocabulary is padded beyond the tokenizer's
            allowed = torch.cat([bits, torch.zeros(self.vocab_size - bits.shape[0], dtype=torch.bool)])
        if self.matcher.is_error() or not bool(allowed.any()):  # no token can continue: nothing admitted here
            if not self.matcher.is_error() and self.matcher.is_accepting():
                return self._eos_mask.clone()
            error = self.matcher.get_error() if self.matcher.is_error() else ""
            raise InvalidSchemaError(
                "the schema or grammar admits no value here"
                + (f" ({one_line(error)})" if error else "")
                + ": check it for $ref cycles or contradictory constraints"
            )
        return allowed

    def advance(self, token_id: int) -> None:
        """Consume one allowed token.

        Raises:
            InvalidSchemaError: the grammar does not allow the token here, or is too complex to
                follow (llguidance's "too many items": e.g. a schema that requires itself).
        """
        if self.matcher.is_stopped():
            self._fed.append(False)
        elif self.matcher.consume_token(int(token_id)):
            self._fed.append(True)
        else:
            raise InvalidSchemaError(
                f"token {token_id} is not allowed by the grammar here: {one_line(self.matcher.get_error())}"
            )
        self._tokens.append(int(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advanced tokens."""
        if num_tokens <= 0:
            return
        if num_tokens > len(self._fed):
            raise ValueError(f"cannot roll back {num_tokens} tokens: only {len(self._fed)} were consumed")
        undone = self._fed[-num_tokens:]
        del self._fed[-num_tokens:]
        del self._tokens[-num_tokens:]
        fed = sum(undone)
        if fed and not self.matcher.rollback(fed):
            raise RuntimeError(f"grammar rollback failed: {self.matcher.get_error()}")

    def is_complete(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return bool(self.matcher.is_accepting())

    def __repr__(self) -> str:
        return f"GrammarConstraint(consumed={len(self._fed)}, complete={self.is_complete()})"


# ------------------------------------------------------------------------------- tokenizers
def llguidance_tokenizer(tokenizer: Any, eos_token_ids: Iterable[int] | None = None) -> Any:
    """The llguidance tokenizer for a transformers fast tokenizer, built once and cached.

    The first one built in a process also warms llguidance (its first matcher is slow).

    Args:
        tokenizer: a ``transformers.PreTrainedTokenizerFast``.
        eos_token_ids: the end-of-sequence tokens (default: the tokenizer's eos).
    """
    llguidance = _llguidance()
    eos = tuple(sorted(set(eos_token_ids))) if eos_token_ids else (int(tokenizer.eos_token_id),)
    with _lock:
        per_tokenizer = _ll_tokenizers.setdefault(tokenizer, {})
        ll_tokenizer = per_tokenizer.get(eos)
        if ll_tokenizer is None:
            ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos))
            per_tokenizer[eos] = ll_tokenizer
            _warm(ll_tokenizer)
    return ll_tokenizer


def _warm(ll_tokenizer: Any) -> None:
    llguidance = _llguidance()
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    matcher.compute_bitmask()


def _constraint(
    tokenizer: Any, grammar: str, vocab_size: int | None, eos_token_ids: Iterable[int] | None
) -> GrammarConstraint:
    """A fresh constraint for an llguidance grammar (compiled once per tokenizer and grammar)."""
    llguidance = _llguidance()
    ll_tokenizer = llguidance_tokenizer(tokenizer, eos_token_ids)
    key = (id(ll_tokenizer), grammar)
    with _lock:
        template = _matchers.get(key)
        if template is not None:
            _matchers.move_to_end(key)
    if template is None:
        template = _compile(llguidance, ll_tokenizer, grammar)
        _probe(
            template,
            int(vocab_size or ll_tokenizer.vocab_size),
            list(ll_tokenizer.eos_tokens),
            int(ll_tokenizer.vocab_size),
        )
        with _lock:
            _matchers[key] = template
            while len(_matchers) > _MATCHER_CACHE_SIZE:
                _matchers.popitem(last=False)
    tokenizer_vocab = int(ll_tokenizer.vocab_size)
    return GrammarConstraint(
        template.deep_copy(),
        int(vocab_size or tokenizer_vocab),
        list(ll_tokenizer.eos_tokens),
        tokenizer_vocab_size=tokenizer_vocab,
    )


def _compile(llguidance: Any, ll_tokenizer: Any, grammar: str) -> Any:
    """A matcher for ``grammar``; every failure, a native panic included, is one :class:`InvalidSchemaError` line."""
    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tokenizer)
        if is_error:
            raise InvalidSchemaError(f"invalid schema or grammar: {one_line(messages[0] if messages else '')}")
        template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    except InvalidSchemaError:
        raise
    except BaseException as error:
        if not _native_failure(error):
            raise
        raise InvalidSchemaError(f"invalid schema or grammar: {one_line(str(error))}") from None
    if template.is_error():
        raise InvalidSchemaError(f"invalid schema or grammar: {one_line(template.get_error())}")
    return template


def _probe(template: Any, vocab_size: int, eos_token_ids: list[int], tokenizer_vocab_size: int) -> None:
    """Walk a copy of a new grammar a few tokens in, refusing one that admits no value or cannot be followed.

    A schema that admits no JSON value (``{"$ref": "#"}``, two ``$ref`` s naming each other)
    allows no first token; one that requires itself (a required property whose schema is the
    object's own) makes the parser give up ("too many items") within its first tokens. Both are
    refused here, before any decoding, instead of ending in an empty answer or a failure
    mid-generation.

    Raises:
        InvalidSchemaError: saying which of the two it is.
    """
    probe = GrammarConstraint(
        template.deep_copy(), vocab_size, eos_token_ids, tokenizer_vocab_size=tokenizer_vocab_size
    )
    eos = set(eos_token_ids)
    for step in range(PROBE_STEPS):
        try:
            allowed = probe.allowed_tokens()
        except InvalidSchemaError as error:
            if step:
                raise
            raise InvalidSchemaError(
                "the schema admits no JSON value (no first token is allowed): check it for $ref cycles such as "
                '{"$ref": "#"} or contradictory constraints'
            ) from error
        if probe.matcher.is_stopped() or probe.is_complete():
            return
        token = next((int(t) for t in allowed.nonzero().flatten().tolist() if int(t) not in eos), None)
        if token is None:
            return
        try:
            probe.advance(token)
        except InvalidSchemaError as error:
            raise InvalidSchemaError(
                f"the schema cannot be decoded ({str(error).split(': ', 1)[-1]}); a required property whose schema "
                "requires itself (a recursive $ref with no way to end) admits no finite value"
            ) from None


# ------------------------------------------------------------------------------- schemas
def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose objects with ``properties`` allow no other properties.

    An explicit ``additionalProperties`` (or ``patternProperties``) is kept as it is.
    """
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: closed_schema(value) for key, value in schema.items()}
    if (
        isinstance(schema.get("properties"), Mapping)
        and "additionalProperties" not in schema
        and "patternProperties" not in schema
    ):
        closed["additionalProperties"] = False
    return closed


def _with_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema, closed, with our JSON layout unless it sets its own ``x-guidance``."""
    if not isinstance(schema, Mapping):
        raise InvalidSchemaError(f"a JSON schema must be a dict, got {type(schema).__name__}")
    closed = closed_schema(schema)
    closed["x-guidance"] = {**JSON_OPTIONS, **dict(schema.get("x-guidance") or {})}
    return closed


def json_schema_constraint(
    tokenizer: Any,
    schema: Mapping[str, Any],
    *,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> GrammarConstraint:
    """Constrain the output to one JSON value valid for ``schema``, then end-of-sequence.

    Args:
        tokenizer: the model's transformers fast tokenizer.
        schema: a JSON schema (``{"type": "object"}`` for any JSON object).
        vocab_size: the model's logits vocabulary (may exceed ``len(tokenizer)``).
        eos_token_ids: the end-of-sequence tokens (default: the tokenizer's eos); pass the
            engine's ``eos_token_ids`` so that any of them may end the output.

    Returns:
        A fresh constraint for one generation.

    Raises:
        InvalidSchemaError: the schema is over the size bounds (:mod:`selfspec.bounds`), invalid,
            uses something llguidance does not support, admits no value, or cannot be decoded
            (a ``ValueError``).
        ImportError: llguidance is not installed.
    """
    check_schema_size(schema)
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_with_options(schema))
    except InvalidSchemaError:
        raise
    except BaseException as error:
        if not _native_failure(error):
            raise
        raise InvalidSchemaError(f"invalid JSON schema: {one_line(str(error))}") from None
    return _constraint(tokenizer, grammar, vocab_size, eos_token_ids)


def tool_call_constraint(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_name: str | None = None,
    vocab_size: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
    required: bool = True,
    parallel: bool = True,
) -> GrammarConstraint:
    """Constrain the output to exactly one Hermes-style tool call, then end-of-sequence.

    The output is ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` where NAME is
    one of the tools (or ``tool_name``) and ARGS is valid for that tool's parameters schema.
    It is an llguidance Lark grammar with one alternative per tool, each embedding the
    tool's parameters as ``%json``. Where the tokenizer has ``<tool_call>`` and
    ``</tool_call>`` as single added tokens (Hermes, Qwen, the demo model) the grammar
    names those tokens; otherwise it spells the tags out.

    With ``required=False`` the model may also answer in free text (unconstrained, except
    that special tokens other than the tags and end-of-sequence are not allowed), or write
    some text and then one or more calls, one per line: a call the model chooses to make is
    still well formed. This needs the tags to be single tokens (so that text cannot spell
    them out). With ``parallel=False`` at most one call is allowed.

    Args:
        tokenizer: the model's transformers fast tokenizer.
        tools: tool descriptions (any form :func:`selfspec.serving.tools.tool_schema` reads).
        tool_name: force this tool; by default any of ``tools``.
        vocab_size: the model's logits vocabulary (may exceed ``len(tokenizer)``).
        eos_token_ids: the end-of-sequence tokens (default: the tokenizer's eos).
        required: whether a tool call is required (default) or optional.
        parallel: with ``required=False``, whether several calls may follow (default) or at
            most one.

    Returns:
        A fresh constraint for one generation.

    Raises:
        ValueError: no tools, an unknown ``tool_name``, an invalid parameters schema, or
            ``required=False`` with tags that are not single tokens.
        ImportError: llguidance is not installed.
    """
    check_tools_size(list(tools))
    grammar = tool_call_grammar(tokenizer, tools, tool_name=tool_name, required=required, parallel=parallel)
    llguidance = _llguidance()
    try:
        compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    except BaseException as error:
        if not _native_failure(error):
            raise
        raise InvalidSchemaError(f"invalid tool parameters: {one_line(str(error))}") from None
    return _constraint(tokenizer, compiled, vocab_size, eos_token_ids)


def has_tool_call_tokens(tokenizer: Any) -> bool:
    """Whether ``<tool_call>`` and ``</tool_call>`` are single added tokens of ``tokenizer``."""
    added = _added_vocab(tokenizer)
    return TOOL_CALL_START in added and TOOL_CALL_END in added


def tool_call_grammar(
    tokenizer: Any,
    tools: Sequence[Mapping[str, Any]],
    *,
    tool_name: str | None = None,
    required: bool = True,
    parallel: bool = True,
) -> str:
    """The Lark grammar of :func:`tool_call_constraint` (for inspection and tests)."""
    functions = [tool_schema(tool)["function"] for tool in tools]
    if not functions:
        raise ValueError("a tool-call grammar needs at least one tool")
    if tool_name is not None:
        functions = [f for f in functions if f["name"] == tool_name]
        if not functions:
            raise ValueError(f"tool_name {tool_name!r} is not one of the tools")
    rules = []
    alternatives = []
    for i, function in enumerate(functions):
        head = json.dumps(f'{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": ')
        schema = json.dumps(_with_options(function["parameters"]), ensure_ascii=False)
        rules.append(f'call_{i}: {head} args_{i} "}}"\nargs_{i}: %json {schema}')
        alternatives.append(f"call_{i}")
    start, end = _tag(tokenizer, TOOL_CALL_START), _tag(tokenizer, TOOL_CALL_END)
    call = f"{start} ({' | '.join(alternatives)}) {end}"
    if required:
        head_rules = f"start: {call}\n"
    elif has_tool_call_tokens(tokenizer):
        # nothing, free text (any bytes: the tags are single tokens, which text cannot
        # spell), or optional text then calls, one per line
        calls = 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"
        head_rules = f"start: TEXT? calls?\n{calls}call: {call}\nTEXT: /(?s:.+)/\n"
    else:
        raise ValueError("an optional tool call needs <tool_call> and </tool_call> as single tokens of the tokenizer")
    return head_rules + "\n".join(rules) + "\n"


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    get_added_vocab = getattr(tokenizer, "get_added_vocab", None)
    return dict(get_added_vocab()) if callable(get_added_vocab) else {}


def _tag(tokenizer: Any, text: str) -> str:
    """A tag as a Lark item: the single added token ``<[id]>`` if there is one, else the text."""
    added = _added_vocab(tokenizer)
    if text in added:
        return f"<[{int(added[text])}]>"
    return json.dumps(text)
