"""Turning token ids into text as they arrive: incremental detokenization and stop strings.

Both work on streams: a multi-byte character split across tokens is held back until it is
complete, and text that could be the start of a stop string is held back until it is known
not to be one, so that a stop string spanning several tokens never reaches the caller.
"""

from __future__ import annotations

from typing import Any

from ..core.validation import check_stop

REPLACEMENT_CHAR = "\ufffd"


def normalize_stop(stop: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Validate stop strings: ``None``, one string, or a list of non-empty strings.

    Raises:
        SamplingError: anything else (``stop=5``, ``[""]``, a list holding a non-str).
    """
    return check_stop(stop)


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    It decodes a small window of recent tokens (``prefix_offset .. end``) and emits only the
    text beyond the window's already-emitted part, the approach of text-generation-inference,
    so the cost per token stays constant and byte-level pieces of one character are joined.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may start one.

    Args:
        stops: the stop strings (validated with :func:`normalize_stop`).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add text; return the part that is safe to emit. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = self._first_completed_stop()
        if cut is not None:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = self._held_suffix_length()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """Return the held text at the end of a generation that did not stop on a string."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _first_completed_stop(self) -> int | None:
        """Start of the stop string that completes first in ``pending`` (the longest on a tie).

        "First to complete" (smallest end), not "first to start", so the result does not
        depend on how the text was split into pushes.
        """
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self.stops:
            start = self.pending.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else best[1]

    def _held_suffix_length(self) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:length]):
                    best = length
                    break
        return best


#: A run of text counts as degenerate repetition when one piece of it (at most
#: :data:`REPETITION_MAX_UNIT` characters, no ``"``) repeats at least :data:`REPETITION_MIN_REPEATS`
#: times in a row and covers at least :data:`REPETITION_MIN_CHARS` characters: for SmolLM2's
#: loops (units of 4 to 60 characters) that is 100 to 150 tokens of loop.
REPETITION_MIN_REPEATS = 8
#: See :data:`REPETITION_MIN_REPEATS`.
REPETITION_MIN_CHARS = 400
#: See :data:`REPETITION_MIN_REPEATS`.
REPETITION_MAX_UNIT = 200


class RepetitionDetector:
    """Notices streamed JSON that has degenerated into a loop inside one string value.

    A small greedy model under a JSON grammar can fall into a loop inside a string value
    (``"cat_joke_fun_fun_fun..."``), which the grammar cannot end: the string goes on until
    ``max_tokens``. This sees the loop coming, so that the caller can stop early with a clear
    error instead of spending the whole budget. It is conservative: the string being written
    must end in one piece (1 to ``max_unit`` characters) repeated at least ``min_repeats``
    times in a row, over at least ``min_chars`` characters. Repeats across values (a list of
    equal items or rows) are never flagged, nor is text outside strings.

    Args:
        min_repeats: the fewest repeats of the piece.
        min_chars: the fewest characters the repeats cover.
        max_unit: the longest piece looked for.
    """

    def __init__(
        self,
        min_repeats: int = REPETITION_MIN_REPEATS,
        min_chars: int = REPETITION_MIN_CHARS,
        max_unit: int = REPETITION_MAX_UNIT,
    ) -> None:
        if min_repeats < 2 or min_chars < 1 or max_unit < 1:
            raise ValueError("min_repeats must be at least 2, min_chars and max_unit at least 1")
        self.min_repeats = min_repeats
        self.min_chars = min_chars
        self.max_unit = max_unit
        self._window = max(max_unit * min_repeats, min_chars + max_unit)
        self.text = ""  # the end of the string value being written (escapes as written)
        self._in_string = False
        self._escaped = False
        self.unit: str | None = None  # the repeated piece, once detected

    @property
    def detected(self) -> bool:
        """Whether the text has degenerated into repetition."""
        return self.unit is not None

    def push(self, text: str) -> bool:
        """Add streamed JSON text; return whether the string being written has become a loop."""
        if self.unit is not None or not text:
            return self.unit is not None
        for char in text:  # follow JSON's string state: only a string's own characters count
            if not self._in_string:
                if char == '"':
                    self._in_string, self.text = True, ""
            elif self._escaped:
                self._escaped = False
                self.text += char
            elif char == "\\":
                self._escaped = True
                self.text += char
            elif char == '"':
                self._in_string, self.text = False, ""
            else:
                self.text += char
        if not self._in_string:
            return False
        self.text = self.text[-self._window :]
        for size in range(1, min(self.max_unit, len(self.text) // self.min_repeats) + 1):
            unit = self.text[-size:]
            repeats = max(self.min_repeats, -(-self.min_chars // size))
            if size * repeats <= len(self.text) and self.text.endswith(unit * repeats):
                self.unit = unit
                return True
        return False
