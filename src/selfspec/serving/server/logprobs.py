"""Log-probabilities in OpenAI's wire formats, from the engine's :class:`~selfspec.decoding.outputs.TokenLogprob`.

- chat (``logprobs: true``, ``top_logprobs: N``): ``choices[i].logprobs.content`` is a list of
  ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}``;
- completions (``logprobs: N``): ``choices[i].logprobs`` is
  ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}``.

A token's ``bytes`` are its exact UTF-8 bytes (a byte-level BPE piece such as ``"Ġthe"`` is
mapped back through the GPT-2 byte alphabet, a sentencepiece byte-fallback ``<0xE2>`` is that
byte); its ``token`` is those bytes decoded, with U+FFFD where a token holds part of a character.
The values are the engine's: the target's ``log_softmax`` at the position that emitted the token,
before temperature, top-k, top-p and a grammar's mask (``docs/serving.md``). A value of ``-inf``
(a token the model rules out) is sent as ``-9999.0``, as OpenAI does, since JSON has no infinity.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ...decoding.outputs import TokenLogprob
from ...decoding.stopping import IncrementalDetokenizer

#: What OpenAI sends for a log-probability of minus infinity.
LOWEST_LOGPROB = -9999.0

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (``bytes_to_unicode`` inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


class TokenPieces:
    """Each token's exact bytes and text for one tokenizer (cached per token id).

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The UTF-8 bytes token ``token_id`` spells."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        """The token's text (U+FFFD where it holds part of a character)."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str):
            table = _byte_decoder()
            if self.byte_level and all(char in table for char in piece):
                return bytes(table[char] for char in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match is not None:
                return bytes([int(match.group(1), 16)])
            if "▁" in piece:  # sentencepiece's word boundary
                return piece.replace("▁", " ").encode("utf-8")
        text = self.tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return str(text).encode("utf-8")


_pieces: weakref.WeakKeyDictionary[Any, TokenPieces] = weakref.WeakKeyDictionary()


def token_pieces(tokenizer: Any) -> TokenPieces:
    """The :class:`TokenPieces` of ``tokenizer`` (one per tokenizer)."""
    try:
        return _pieces[tokenizer]
    except KeyError:
        pieces = _pieces[tokenizer] = TokenPieces(tokenizer)
        return pieces
    except TypeError:  # not weak-referenceable
        return TokenPieces(tokenizer)


def wire_logprob(value: float) -> float:
    """A log-probability fit for JSON: ``-inf`` (and NaN) as :data:`LOWEST_LOGPROB`."""
    return value if math.isfinite(value) else LOWEST_LOGPROB


# ------------------------------------------------------------------------------- chat
def _chat_token(pieces: TokenPieces, token_id: int, logprob: float) -> dict[str, Any]:
    raw = pieces.bytes_of(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": wire_logprob(logprob), "bytes": list(raw)}


def chat_content(pieces: TokenPieces, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries for ``entries``."""
    content = []
    for entry in entries:
        item = _chat_token(pieces, entry.token_id, entry.logprob)
        item["top_logprobs"] = [
            _chat_token(pieces, token, value)
            for token, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True)
        ]
        content.append(item)
    return content


# ------------------------------------------------------------------------------- completions
class TextOffsets:
    """Where each token starts in the completion's text (``text_offset``), token by token.

    A token that starts inside a character (a byte-level piece) gets the offset where that
    character starts; tokens past the text's end (an end-of-sequence token, a stop string's
    tokens) get the text's length.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._chars = 0

    def push(self, token_id: int) -> int:
        """The offset of ``token_id``, the next token."""
        offset = self._chars
        self._chars += len(self._detokenizer.push(int(token_id)))
        return offset


def completion_logprobs(
    pieces: TokenPieces, entries: Sequence[TokenLogprob], offsets: TextOffsets, text_length: int | None = None
) -> dict[str, Any]:
    """The completions' ``logprobs`` object for ``entries`` (``text_length``: cap offsets at the text's end)."""
    starts = [offsets.push(entry.token_id) for entry in entries]
    if text_length is not None:
        starts = [min(start, text_length) for start in starts]
    return {
        "tokens": [pieces.text_of(entry.token_id) for entry in entries],
        "token_logprobs": [wire_logprob(entry.logprob) for entry in entries],
        "top_logprobs": [_top_by_text(pieces, entry) for entry in entries],
        "text_offset": starts,
    }


def _top_by_text(pieces: TokenPieces, entry: TokenLogprob) -> dict[str, float]:
    """``{token text: logprob}``, most likely first (two tokens spelt alike keep the likelier's value)."""
    top: dict[str, float] = {}
    for token, value in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
        top.setdefault(pieces.text_of(token), wire_logprob(value))
    return top
