"""Bounds on what a call turns into prompt text or a grammar, checked before any of that work.

A request's messages are not all of its prompt: a ``response_format`` schema is stated in the
prompt and compiled into a grammar, tools are rendered into the prompt (names, descriptions and
parameters, dictionary keys included) and compiled too, and an assistant's past tool calls are
rendered with their arguments. Tokenizing a 1.6 MB schema or compiling a grammar with 19,000
property names costs seconds of CPU; so before any of it runs:

- the schema of a ``response_format`` and the tools of a call are each bounded in size
  (:data:`MAX_SCHEMA_CHARS` characters, :data:`MAX_SCHEMA_ITEMS` keys and list items) and in number
  (:data:`MAX_TOOLS` tools, OpenAI's limit), :func:`check_schema_size` / :func:`check_tools_size`;
- every character that becomes prompt text (message content, tool definitions, stated schemas,
  past tool-call arguments, dictionary keys included) is counted by :func:`text_chars` and
  refused by :func:`check_prompt_chars` when the context window cannot hold that many
  (:class:`PromptTooLongError`, which ``selfspec serve`` answers as ``context_length_exceeded``).

The engine's grammar functions, the request planner (both adapters in local mode) and
``selfspec serve`` share these checks, so the same input gets the same error everywhere:
:class:`~selfspec.errors.InvalidSchemaError` for a schema or tools over the bounds,
:class:`~selfspec.errors.InvalidPromptError` for a prompt that cannot fit.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidPromptError, InvalidSchemaError

#: The most tools one call may offer (OpenAI's limit).
MAX_TOOLS = 128
#: The most characters of JSON a ``response_format`` schema, or a call's tools together, may hold.
MAX_SCHEMA_CHARS = 100_000
#: The most object keys plus list items a schema, or a call's tools together, may hold.
MAX_SCHEMA_ITEMS = 10_000
#: The deepest a schema, or a call's tools, may nest (as ``selfspec serve`` bounds request bodies).
MAX_SCHEMA_DEPTH = 64
#: Headroom for normalizers that shorten text (Unicode composition joins at most three characters).
NORMALIZER_SLACK = 4


class PromptTooLongError(InvalidPromptError):
    """More characters of prompt text than the context window can hold, found before tokenizing."""


@dataclass(frozen=True)
class JsonSize:
    """The size of a JSON value.

    Attributes:
        chars: characters of its keys and strings, plus one per number, bool, null and item
            (about the length of its JSON text, without quotes and escapes).
        items: object keys plus list items.
        depth: the deepest nesting of objects and lists (a scalar: 0).
    """

    chars: int
    items: int
    depth: int = 0


def json_size(value: Any, *, max_chars: int | None = None, max_items: int | None = None) -> JsonSize:
    """Count a JSON value's characters, items and depth (iteratively: no recursion to exhaust).

    Only containers are pushed on the walk's stack (strings and numbers are counted where they
    sit), so counting 20,000 strings allocates nothing. The walk stops early once ``max_chars`` or
    ``max_items`` is passed (the counts are then lower bounds).
    """
    if not isinstance(value, (dict, list, tuple)):
        return JsonSize(len(value) if isinstance(value, str) else 1, 0, 0)
    chars = items = deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        deepest = max(deepest, depth)
        items += len(container)
        if isinstance(container, dict):  # a key counts its text plus one (the key itself)
            chars += sum((len(key) if isinstance(key, str) else 0) + 1 for key in container)
            children = container.values()
        else:  # an element counts one
            chars += len(container)
            children = container
        for child in children:
            if isinstance(child, str):
                chars += len(child)
            elif isinstance(child, (dict, list, tuple)):
                stack.append((child, depth + 1))
            else:
                chars += 1
        if (max_chars is not None and chars > max_chars) or (max_items is not None and items > max_items):
            break
    return JsonSize(chars, items, deepest)


def text_chars(value: Any) -> int:
    """Characters of text in a prompt, messages, tools or schema: strings and dictionary keys alike."""
    if isinstance(value, str):
        return len(value)
    total = 0
    stack = [value]
    while stack:
        container = stack.pop()
        if isinstance(container, dict):
            for key, child in container.items():
                total += len(key) if isinstance(key, str) else 0
                if isinstance(child, str):
                    total += len(child)
                elif isinstance(child, (dict, list, tuple)):
                    stack.append(child)
        elif isinstance(container, (list, tuple)):
            for child in container:
                if isinstance(child, str):
                    total += len(child)
                elif isinstance(child, (dict, list, tuple)):
                    stack.append(child)
    return total


def _check_size(value: Any, what: str, hint: str) -> None:
    size = json_size(value, max_chars=MAX_SCHEMA_CHARS, max_items=MAX_SCHEMA_ITEMS)
    if size.chars > MAX_SCHEMA_CHARS or size.items > MAX_SCHEMA_ITEMS:
        raise InvalidSchemaError(
            f"{what} holds over {min(size.chars, MAX_SCHEMA_CHARS)} characters or over "
            f"{min(size.items, MAX_SCHEMA_ITEMS)} keys and items; at most {MAX_SCHEMA_CHARS} "
            f"characters and {MAX_SCHEMA_ITEMS} keys and items are accepted (every one becomes prompt text and "
            f"grammar): {hint}"
        )
    if size.depth > MAX_SCHEMA_DEPTH:
        raise InvalidSchemaError(f"{what} nests {size.depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted")


def check_schema_size(schema: Any, what: str = "the JSON schema") -> None:
    """Refuse a schema over :data:`MAX_SCHEMA_CHARS` characters or :data:`MAX_SCHEMA_ITEMS` items.

    Raises:
        InvalidSchemaError: naming both sizes and the bounds.
    """
    _check_size(schema, what, "use a smaller schema (e.g. a string field instead of a huge enum)")


def check_tools_size(tools: Any, what: str = "the tools") -> None:
    """Refuse more than :data:`MAX_TOOLS` tools, or tools over the size bounds together.

    Raises:
        InvalidSchemaError: naming the count or the sizes and the bounds.
    """
    if isinstance(tools, (list, tuple)) and len(tools) > MAX_TOOLS:
        raise InvalidSchemaError(f"{len(tools)} tools were offered; at most {MAX_TOOLS} are accepted")
    _check_size(tools, what, "offer fewer or smaller tools")


# ------------------------------------------------------------------------------- prompt length
_longest: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters any token of ``tokenizer`` spells (``None``: no vocabulary to read); cached."""
    try:
        return _longest[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound
        longest = None
    else:
        lengths = [len(token) for token in vocab if isinstance(token, str)]
        longest = max(lengths) if lengths else None
    try:
        _longest[tokenizer] = longest
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return longest


def max_prompt_chars(tokenizer: Any, context_window: int | None) -> int | None:
    """The most characters a prompt can have and still fit ``context_window`` tokens (``None``: unbounded).

    No token spells more than ``k`` characters (:func:`longest_token_chars`), so a text of
    ``n`` characters has at least ``n / k`` tokens; :data:`NORMALIZER_SLACK` covers normalizers
    that shorten text. The bound never refuses a prompt that fits.
    """
    if context_window is None or tokenizer is None:
        return None
    longest = longest_token_chars(tokenizer)
    return None if longest is None else context_window * longest * NORMALIZER_SLACK


def check_prompt_chars(chars: int, tokenizer: Any, context_window: int | None) -> None:
    """Refuse ``chars`` characters of prompt text that the context window cannot hold.

    Raises:
        PromptTooLongError: naming both numbers and ``truncate_prompt`` (an ``InvalidPromptError``).
    """
    limit = max_prompt_chars(tokenizer, context_window)
    if limit is not None and chars > limit:
        raise PromptTooLongError(
            f"the prompt has {chars} characters (messages, tools and schema together); this model's context "
            f"window of {context_window} tokens cannot hold more than {limit}: shorten it (or pass "
            "truncate_prompt=True to keep its end)"
        )
