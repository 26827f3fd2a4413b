"""Austen corpus handling and sequence packing for demo-model training.

The novels are split into paragraphs (line wraps removed). A seeded ~2% of paragraphs is held out
for evaluation; the rest are grouped into chapter documents. Training windows pack whole synthetic
chat documents and fill the rest with running Austen prose, all separated by ``<|endoftext|>``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

_PARA_SPLIT = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"\s+")
_SENT_SPLIT = re.compile(r"(?<=[.!?])[\"')]*\s+(?=[\"'(]?[A-Z])")
_ABBREV = re.compile(r"\b(Mr|Mrs|Dr|St|Col|Capt|Esq|Messrs)\.$")


@dataclass
class AustenSplit:
    """Austen paragraphs split into training chapters and held-out paragraphs.

    Attributes:
        train_docs: Training documents (chapters without their held-out paragraphs).
        train_paragraphs: All training paragraphs, in order.
        heldout_paragraphs: Held-out paragraphs for evaluation.
    """

    train_docs: list[str] = field(default_factory=list)
    train_paragraphs: list[str] = field(default_factory=list)
    heldout_paragraphs: list[str] = field(default_factory=list)


def read_paragraphs(text: str) -> list[str]:
    """Split raw text into paragraphs and undo hard line wrapping.

    Args:
        text: The raw corpus text.

    Returns:
        Non-empty paragraphs with internal newlines replaced by single spaces.
    """
    paragraphs = (_SPACES.sub(" ", p).strip() for p in _PARA_SPLIT.split(text))
    return [p for p in paragraphs if p]


def split_corpus(text: str, heldout_fraction: float = 0.02, seed: int = 0) -> AustenSplit:
    """Hold out a seeded fraction of paragraphs and group the rest into chapter documents.

    Args:
        text: The raw corpus text.
        heldout_fraction: Fraction of paragraphs to hold out for evaluation.
        seed: Random seed for the held-out choice.

    Returns:
        The split corpus.
    """
    paragraphs = read_paragraphs(text)
    rng = random.Random(seed)
    n_heldout = max(1, round(len(paragraphs) * heldout_fraction))
    heldout = set(rng.sample(range(len(paragraphs)), n_heldout))
    split = AustenSplit()
    chapter: list[str] = []
    for i, para in enumerate(paragraphs):
        if para.startswith("CHAPTER") and chapter:
            split.train_docs.append("\n\n".join(chapter))
            chapter = []
        if i in heldout:
            split.heldout_paragraphs.append(para)
        else:
            chapter.append(para)
            split.train_paragraphs.append(para)
    if chapter:
        split.train_docs.append("\n\n".join(chapter))
    return split


def split_sentences(paragraph: str) -> list[str]:
    """Split a paragraph into sentences, keeping abbreviations such as "Mr." intact.

    Args:
        paragraph: One paragraph of prose.

    Returns:
        The sentences, each stripped, whose concatenation with spaces gives back the paragraph.
    """
    pieces: list[str] = []
    start = 0
    for match in _SENT_SPLIT.finditer(paragraph):
        candidate = paragraph[start : match.end()]
        if _ABBREV.search(candidate.rstrip()):
            continue
        pieces.append(candidate.strip())
        start = match.end()
    pieces.append(paragraph[start:].strip())
    return [p for p in pieces if p]


class WindowPacker:
    """Pack token documents into fixed-length training windows.

    Synthetic documents are kept whole (when they fit); the rest of each window is filled with
    running prose, so that about ``prose_fraction`` of all tokens are prose. An epoch ends when the
    prose or the documents run out. ``prose_yielded`` and ``tokens_yielded`` count what was handed
    out so far.

    Args:
        prose: One long token stream of prose (documents already separated by ``sep_id``).
        docs: Synthetic documents as token lists (each without separators).
        length: Window length in tokens (sequence length + 1 for the shifted labels).
        sep_id: The ``<|endoftext|>`` token id.
        prose_fraction: Target fraction of prose tokens.
    """

    def __init__(
        self,
        prose: Sequence[int],
        docs: Sequence[Sequence[int]],
        length: int,
        sep_id: int,
        prose_fraction: float,
    ) -> None:
        self.prose = prose
        self.docs = docs
        self.length = length
        self.sep_id = sep_id
        self.prose_fraction = prose_fraction
        self.prose_yielded = 0
        self.tokens_yielded = 0

    def epoch(self, rng: random.Random) -> Iterator[list[int]]:
        """Yield the windows of one pass over the prose, in a seeded random order.

        Args:
            rng: Random generator (shuffles documents and windows).

        Yields:
            Windows of exactly ``length`` token ids.
        """
        order = list(range(len(self.docs)))
        rng.shuffle(order)
        windows = list(self._windows(order, rng))
        rng.shuffle(windows)
        for window, n_prose in windows:
            self.prose_yielded += n_prose
            self.tokens_yielded += len(window)
            yield window

    def _windows(self, order: list[int], rng: random.Random) -> Iterator[tuple[list[int], int]]:
        """Build the windows of one epoch, each with its number of prose tokens."""
        cursor, next_doc, synth, total = rng.randrange(self.length), 0, 0, 0
        while cursor + self.length <= len(self.prose) and (not order or next_doc < len(order)):
            parts: list[int] = []
            while order and synth < (1 - self.prose_fraction) * (total + self.length):
                doc = [*self.docs[order[next_doc % len(order)]], self.sep_id]
                if len(parts) + len(doc) > self.length and parts:
                    break
                parts.extend(doc)
                synth += len(doc)
                next_doc += 1
                if len(parts) >= self.length:
                    break
            fill = max(0, self.length - len(parts))
            filler = list(self.prose[cursor : cursor + fill])
            cursor += fill
            window = filler + parts if rng.random() < 0.5 else parts + filler
            total += self.length
            yield window[: self.length], min(fill, len(filler))
