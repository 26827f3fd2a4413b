"""Offline retrieval-augmented generation with LlamaIndex, decoded by self-speculation.

Three Austen-like notes go into a ``VectorStoreIndex``; a query engine retrieves them and the
bundled demo model answers through ``SpeculativeLLM``. Nothing is downloaded: the embeddings are
LlamaIndex's ``MockEmbedding`` and the model ships with selfspec.

Run::

    HF_HUB_OFFLINE=1 python examples/llamaindex_rag.py
    HF_HUB_OFFLINE=1 python examples/llamaindex_rag.py --question "Who owns Pemberley?" --compare

``--compare`` answers again with plain decoding (``drafter="none"``): the text is identical, only
the speed differs.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.core.bridge.pydantic import Field
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.selfspec import SpeculativeLLM

DOCUMENTS = [
    "Elizabeth Bennet lives at Longbourn, in Hertfordshire, with her parents and her four sisters. "
    "She is fond of long walks, and she laughs at follies whenever she can.",
    "Mr. Darcy is the master of Pemberley, a great estate in Derbyshire. He has ten thousand a year, "
    "and his pride offends the whole neighbourhood at the Meryton assembly.",
    "Mr. Collins, a clergyman and the cousin of Mr. Bennet, is to inherit Longbourn. "
    "He admires his patroness, Lady Catherine de Bourgh, above everyone.",
]


class LastResponse(BaseEventHandler):
    """Keeps the ``additional_kwargs`` of the last chat response (token counts and stats)."""

    info: dict[str, Any] = Field(default_factory=dict)

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.info = dict(event.response.additional_kwargs)


def answer(llm: SpeculativeLLM, index: VectorStoreIndex, question: str) -> str:
    # MockEmbedding scores every chunk alike, so retrieve them all: the notes are short
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=len(DOCUMENTS))
    return query_engine.query(question).response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="selfspec-demo", help="hub id, folder, or selfspec-demo")
    parser.add_argument("--question", default='Which sentence mentions "Pemberley"?')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--compare", action="store_true", help="also answer with plain decoding")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = SpeculativeLLM(model=args.model, max_tokens=args.max_new_tokens)
    Settings.llm = llm
    Settings.embed_model = MockEmbedding(embed_dim=64)
    # MockEmbedding scores every chunk alike and ties are broken by node id: fixed ids keep the context's order
    # (and so the answer) the same from run to run
    splitter = SentenceSplitter(id_func=lambda i, doc: f"{doc.doc_id}-{i}")
    documents = [Document(text=text, id_=f"note-{n}") for n, text in enumerate(DOCUMENTS)]
    index = VectorStoreIndex.from_documents(documents, transformations=[splitter])

    llm.complete("Hello", max_new_tokens=4)  # warm up (the first forward pass is slow)
    last = LastResponse()
    get_dispatcher().add_event_handler(last)
    print(f"Q: {args.question}")
    text = answer(llm, index, args.question)
    print(f"A: {text}")
    info = last.info
    print(
        f"\n{info['prompt_tokens']} prompt tokens, {info['completion_tokens']} new tokens, "
        f"{info['tokens_per_second']:.1f} tokens/s ({info['finish_reason']})"
    )
    print(
        f"speculation: {info['target_forwards']} target forwards, "
        f"{info['num_accepted']}/{info['num_drafted']} drafts accepted "
        f"(rate {info['acceptance_rate']:.2f}, mean accepted length {info['mean_accepted_length']:.2f}), "
        f"histogram {info['accepted_length_histogram']}"
    )

    if args.compare:
        plain = SpeculativeLLM(model=args.model, max_tokens=args.max_new_tokens, drafter="none")
        same = answer(plain, index, args.question) == text
        speed = last.info["tokens_per_second"]
        print(
            f"\nplain decoding: {speed:.1f} tokens/s "
            f"(self-speculation {info['tokens_per_second'] / speed:.2f}x); same text: {same}"
        )


if __name__ == "__main__":
    main()
