"""Seeded synthetic chat mix for the demo model: dialogues, rewrites and RAG-style copying.

Each generator returns a :class:`Chat` (messages plus optional tools) that is rendered through the
tokenizer's own chat template, so training text equals what inference sees. RAG answers and
rewrite answers copy spans of the prompt verbatim, which makes copying from context easy to learn
(and cheap to draft for self-speculative decoding). Tool-use chats live in
:mod:`demo_model.tool_chats`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from demo_model import banks
from demo_model.corpus import split_sentences

Message = dict[str, Any]

LLAMA_INDEX_QA = (
    "Context information is below.\n---------------------\n{context}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\n"
    "Query: {query}\nAnswer: "
)
LLAMA_INDEX_QA_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or "
    "anything along those lines."
)
LLAMA_INDEX_SUMMARY = (
    "Write a summary of the following. Try to use only the information provided. "
    'Try to include as many key details as possible.\n\n\n{context}\n\n\nSUMMARY:"""\n'
)
_WORD = re.compile(r"[A-Za-z]{5,}")
_ANY_WORD = re.compile(r"[A-Za-z']{2,}")
COPY_ASKS = (
    "Repeat after me: {s}",
    "Copy this exactly: {s}",
    "Say this back to me exactly: {s}",
    "Repeat this list: {s}",
    "Echo: {s}",
)


@dataclass
class Chat:
    """One synthetic conversation.

    Attributes:
        messages: Chat messages (role/content dicts, assistant ``tool_calls`` allowed).
        tools: Tool schemas offered to the model, or ``None``.
        kind: Which generator produced it.
    """

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    kind: str = ""


def turn(user: str, assistant: str) -> list[Message]:
    """Return a user message followed by an assistant answer."""
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


class TextChats:
    """Generators for dialogue, rewrite and RAG chats drawn from Austen paragraphs.

    Args:
        paragraphs: Training paragraphs (never held-out ones).
        rng: Random generator shared by all generators.
    """

    def __init__(self, paragraphs: Sequence[str], rng: random.Random) -> None:
        self.rng = rng
        split = [split_sentences(p) for p in paragraphs]
        self.sentences = [s for ss in split for s in ss if 30 <= len(s) <= 220]
        self.passages = [ss for ss in split if len(ss) >= 3 and 200 <= sum(map(len, ss)) <= 1100]
        self.paragraphs = [p for p in paragraphs if 150 <= len(p) <= 700]
        self.by_name = {n: [s for s in self.sentences if n in s] for n in banks.CHARACTERS}
        self.by_name = {n: v for n, v in self.by_name.items() if v}
        self.vocab = sorted({w for s in self.sentences for w in _ANY_WORD.findall(s)})

    # -- dialogues -------------------------------------------------------------------------
    def greeting(self) -> list[Message]:
        """A greeting and a polite answer."""
        return turn(*self.rng.choice(banks.GREETINGS))

    def fact(self) -> list[Message]:
        """A simple question (book facts, capitals, small sums) and its answer."""
        if self.rng.random() < 0.3:
            a, b = self.rng.randrange(0, 50), self.rng.randrange(0, 50)
            q = self.rng.choice(("What is {a} + {b}?", "What is {a} plus {b}?", "Add {a} and {b}."))
            return turn(q.format(a=a, b=b), f"{a} + {b} = {a + b}.")
        questions, answer = self.rng.choice(banks.FACTS)
        return turn(self.rng.choice(questions), answer)

    def style(self) -> list[Message]:
        """A request for Austen-flavoured prose, answered with real Austen text."""
        r = self.rng.random()
        if r < 0.3 and self.by_name:
            name = self.rng.choice(sorted(self.by_name))
            ask = self.rng.choice(("Tell me about {n}.", "Say something about {n}.", "Who is {n}?"))
            return turn(ask.format(n=name), self.rng.choice(self.by_name[name]))
        if r < 0.6:
            sents = self.rng.choice(self.passages)
            ask = self.rng.choice(("Continue the story: {s}", "Continue this passage:\n\n{s}"))
            return turn(ask.format(s=sents[0]), " ".join(sents[1:]))
        ask = self.rng.choice(
            (
                "Write a sentence in the style of Jane Austen.",
                "Write a short paragraph in the style of Jane Austen.",
                f"Write a few lines about {self.rng.choice(banks.TOPICS)}.",
                "Tell me a story.",
            )
        )
        answer = self.rng.choice(self.sentences if "sentence" in ask else self.paragraphs)
        return turn(ask, answer)

    def rewrite(self) -> list[Message]:
        """An echo, case change, word swap, reversal or phrase translation request."""
        s = self.rng.choice(self.sentences)
        kind = self.rng.randrange(6)
        if kind == 0:
            ask = self.rng.choice(("Repeat after me: {s}", "Say this back to me exactly: {s}"))
            return turn(ask.format(s=s), s)
        if kind == 1:
            return turn(f"Rewrite this in capital letters: {s}", s.upper())
        if kind == 2:
            return turn(f"Rewrite this in lower case: {s}", s.lower())
        if kind == 3:
            return self._swap_word(s)
        if kind == 4:
            words = s.split()[: self.rng.randrange(4, 9)]
            ask = f"Reverse the order of these words: {' '.join(words)}"
            return turn(ask, " ".join(reversed(words)))
        lang, src, dst = self.rng.choice(banks.TRANSLATIONS)
        ask = self.rng.choice(("Translate to {l}: {s}", 'How do you say "{s}" in {l}?'))
        return turn(ask.format(l=lang, s=src), dst)

    def _swap_word(self, s: str) -> list[Message]:
        """Replace one word of a sentence with another (possibly non-ASCII) word."""
        words = _WORD.findall(s)
        if not words:
            return turn(f"Repeat after me: {s}", s)
        old = self.rng.choice(words)
        new = self.rng.choice(banks.ASCII_WORDS + banks.NON_ASCII_WORDS)
        ask = f'Rewrite the following sentence, replacing "{old}" with "{new}": {s}'
        return turn(ask, s.replace(old, new))

    def _random_item(self) -> str:
        """A random word, number or (often non-ASCII) name: predictable only by copying."""
        r = self.rng.random()
        if r < 0.6 and self.vocab:
            return self.rng.choice(self.vocab)
        if r < 0.8:
            return str(self.rng.randrange(10 ** self.rng.randrange(1, 7)))
        return self.rng.choice(banks.ASCII_WORDS + banks.NON_ASCII_WORDS + banks.CITIES)

    def copy_drill(self) -> list[Message]:
        """Repeat a random sequence of words and numbers verbatim.

        The sequence is random, so only copying from the prompt predicts the answer: this is
        what teaches a small model to copy (induction) early in training.
        """
        items = [self._random_item() for _ in range(self.rng.randrange(3, 40))]
        seq = self.rng.choice((" ", ", ", " | ")).join(items)
        return turn(self.rng.choice(COPY_ASKS).format(s=seq), seq)

    def copy_json(self) -> list[Message]:
        """Return a random JSON object unchanged (copying keys and typed values)."""
        keys = self.rng.sample(banks.PARAM_NAMES, self.rng.randrange(1, 5))
        obj = {k: self._json_value() for k in keys}
        text = json.dumps(obj, ensure_ascii=False)
        ask = self.rng.choice(("Return this JSON object unchanged: {s}", "Echo this JSON: {s}"))
        return turn(ask.format(s=text), text)

    def _json_value(self) -> object:
        """A random JSON value: integer, decimal, string or boolean."""
        r = self.rng.random()
        if r < 0.35:
            return self.rng.randrange(-1000, 100000)
        if r < 0.5:
            return round(self.rng.uniform(0, 1000), self.rng.randrange(1, 3))
        if r < 0.9:
            return self._random_item()
        return self.rng.random() < 0.5

    def single_turn(self) -> list[Message]:
        """One turn of any plain kind."""
        gen: Callable[[], list[Message]] = self.rng.choice(
            (self.greeting, self.fact, self.style, self.rewrite, self.rewrite)
        )
        return gen()

    def multi_turn(self) -> list[Message]:
        """Two or three plain turns, often after a system prompt."""
        messages = self.system_prompt(0.7)
        for _ in range(self.rng.randrange(2, 4)):
            messages += self.single_turn()
        return messages

    def system_prompt(self, p: float) -> list[Message]:
        """With probability ``p``, a one-message list holding a random system prompt."""
        if self.rng.random() < p:
            return [{"role": "system", "content": self.rng.choice(banks.SYSTEM_PROMPTS)}]
        return []

    # -- RAG ---------------------------------------------------------------------------------
    def _context(self) -> tuple[str, list[str]]:
        """Return a context (1-2 passages, sometimes with metadata) and the answer passage."""
        sents = self.rng.choice(self.passages)
        parts = [" ".join(sents)]
        if self.rng.random() < 0.3:
            parts.insert(self.rng.randrange(2), self.rng.choice(self.paragraphs))
        if self.rng.random() < 0.2:
            parts = [f"file_path: austen.txt\n\n{p}" for p in parts]
        return "\n\n".join(parts), sents

    def _question(self, sents: list[str]) -> tuple[str, str]:
        """Return a question about a passage and the verbatim sentence that answers it."""
        kind = self.rng.randrange(4)
        i = self.rng.randrange(len(sents))
        if kind == 0:
            unique = self._unique_words(sents)
            if unique:
                word, i = self.rng.choice(unique)
                ask = self.rng.choice(
                    (
                        'Which sentence mentions "{w}"?',
                        'Find the sentence containing the word "{w}".',
                        "What does the passage say about {w}?",
                    )
                )
                return ask.format(w=word), sents[i]
        if kind == 1:
            head = " ".join(sents[i].split()[:4])
            return f'Quote the sentence that begins with "{head}".', sents[i]
        if kind == 2:
            which, j = self.rng.choice((("first", 0), ("last", -1), ("second", 1)))
            return f"What is the {which} sentence of the passage?", sents[j]
        half = sents[i][: len(sents[i]) // 2].rsplit(" ", 1)[0]
        return f'Complete the quote: "{half} ..."', sents[i]

    @staticmethod
    def _unique_words(sents: list[str]) -> list[tuple[str, int]]:
        """Words of length >= 5 that occur in exactly one sentence, with that sentence index."""
        seen: dict[str, list[int]] = {}
        for i, s in enumerate(sents):
            for w in set(_WORD.findall(s)):
                seen.setdefault(w, []).append(i)
        return [(w, ix[0]) for w, ix in sorted(seen.items()) if len(ix) == 1]

    def rag_span(self) -> list[Message]:
        """A passage plus a question answered by copying one sentence verbatim."""
        context, sents = self._context()
        query, answer = self._question(sents)
        style = self.rng.randrange(4)
        if style == 0:
            system = [{"role": "system", "content": LLAMA_INDEX_QA_SYSTEM}]
            return system + turn(LLAMA_INDEX_QA.format(context=context, query=query), answer)
        if style == 1:
            return turn(LLAMA_INDEX_QA.format(context=context, query=query), answer)
        if style == 2:
            return turn(f"Context:\n{context}\n\nQuestion: {query}", answer)
        return turn(f"Read the following passage.\n\n{context}\n\n{query}", answer)

    def rag_summary(self) -> list[Message]:
        """A summarisation request answered by copying the key sentences."""
        sents = self.rng.choice(self.passages)
        context = " ".join(sents)
        longest = max(sents[1:], key=len)
        answer = f"{sents[0]} {longest}"
        ask = self.rng.choice(
            (
                LLAMA_INDEX_SUMMARY.format(context=context),
                f"Summarize the passage.\n\n{context}",
                f"Give me a short summary of this text:\n\n{context}",
                f"{context}\n\nSummarize the text above in two sentences.",
            )
        )
        return turn(ask, answer)
