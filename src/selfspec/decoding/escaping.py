"""Keeping callers' text from becoming control tokens (``escape_special_tokens=True``).

A chat template joins the caller's text (message content, tool names, descriptions and
parameters, an assistant's past tool calls) with its own markup, and the tokenizer then reads
every special-token string in the result as the control token, wherever it came from: a user
who writes ``<|im_start|>system ...`` opens a system turn of their own. That is what
transformers' ``apply_chat_template`` and vLLM do by default, and selfspec's default too.

With ``escape_special_tokens=True`` only the template's own markup becomes control tokens:

1. every string the caller passes (dictionary keys included) has each added-token string
   (``tokenizer.get_added_vocab()``: ``<|im_start|>``, ``<tool_call>``, ...) replaced by a
   placeholder of plain ASCII letters that no input contains;
2. the template is rendered as usual;
3. the text is encoded piece by piece between placeholders, as usual, and each placeholder as
   its special-token string spelled out as plain text (``split_special_tokens=True``; an added
   token that is not special, such as ``<tool_call>``, is split after its first character).

Text without any added-token string encodes exactly as it does without the option.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecialTokenEscaper:
    """Replaces added-token strings in callers' text by placeholders, and encodes them back as text.

    Args:
        tokenizer: a transformers tokenizer.
    """

    tokenizer: Any
    found: list[str] = field(default_factory=list)  # the escaped strings, by placeholder index
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        get_added_vocab = getattr(self.tokenizer, "get_added_vocab", None)
        vocab = dict(get_added_vocab()) if callable(get_added_vocab) else {}
        self._added_ids = set(vocab.values())
        added = sorted(vocab, key=len, reverse=True)
        self._specials = re.compile("|".join(re.escape(token) for token in added)) if added else None
        self._placeholder = re.compile(f"selfspecesc{self.nonce}n(\\d+)e")

    def mark(self, value: Any) -> Any:
        """A copy of ``value`` (messages, tools) with every added-token string in its strings and keys replaced."""
        if isinstance(value, str):
            return self._mark_text(value)
        if isinstance(value, dict):
            return {self._mark_text(k) if isinstance(k, str) else k: self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mark(item) for item in value]
        return value

    def _mark_text(self, text: str) -> str:
        return text if self._specials is None else self._specials.sub(self._replace, text)

    def _replace(self, match: re.Match[str]) -> str:
        self.found.append(match.group())
        return f"selfspecesc{self.nonce}n{len(self.found) - 1}e"

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text: placeholders become their strings spelled out as plain text."""
        ids: list[int] = []
        start = 0
        for match in self._placeholder.finditer(text):
            ids += self._encode(text[start : match.start()], split=False)
            ids += self._spell(self.found[int(match.group(1))])
            start = match.end()
        return ids + self._encode(text[start:], split=False)

    def _spell(self, text: str) -> list[int]:
        """``text`` as plain-text tokens, never an added token.

        ``split_special_tokens`` spells out only special tokens, so a non-special added token such
        as ``<tool_call>`` is split after its first character.
        """
        ids = self._encode(text, split=True)
        if len(text) <= 1 or not any(token in self._added_ids for token in ids):
            return ids
        return self._encode(text[0], split=True) + self._spell(text[1:])

    def _encode(self, text: str, *, split: bool) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=split)["input_ids"])


def render_escaped(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of chat ``messages`` (and ``tools``) where callers' text never becomes control tokens."""
    escaper = SpecialTokenEscaper(tokenizer)
    while any(escaper.nonce in text for text in _strings([messages, tools])):  # a placeholder must be unique
        escaper = SpecialTokenEscaper(tokenizer)
    marked_messages = escaper.mark(messages)
    marked_tools = escaper.mark(tools) if tools else tools
    text = tokenizer.apply_chat_template(
        marked_messages, tools=marked_tools, add_generation_prompt=True, tokenize=False
    )
    return escaper.encode(text)


def _strings(value: Any) -> list[str]:
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):
            found.extend(k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found
