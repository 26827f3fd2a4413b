"""16 threads and 16 asyncio tasks share one engine through both adapters; each caller gets
exactly the text it would get alone, and nothing deadlocks."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from langchain_selfspec import ChatSpeculative
from llama_index.llms.selfspec import SpeculativeLLM

PROMPTS = ["Who is Mr. Darcy?", "Tell me about Bath.", "What is a good fortune?", "Hello! How are you?"]
MAX_TOKENS = 12
logger = logging.getLogger(__name__)


def test_threads_and_tasks_through_both_adapters() -> None:
    chat = ChatSpeculative(model="selfspec-demo", max_tokens=MAX_TOKENS)
    llm = SpeculativeLLM(model="selfspec-demo", max_new_tokens=MAX_TOKENS)
    alone_chat = {p: chat.invoke(p).content for p in PROMPTS}
    alone_llm = {p: llm.complete(p).text for p in PROMPTS}

    results_chat: dict[int, str] = {}
    results_llm: dict[int, str] = {}

    def thread_call(i: int) -> None:
        results_chat[i] = str(chat.invoke(PROMPTS[i % len(PROMPTS)]).content)

    async def task_call(i: int) -> None:
        results_llm[i] = (await llm.acomplete(PROMPTS[i % len(PROMPTS)])).text

    async def all_tasks() -> None:
        await asyncio.gather(*(task_call(i) for i in range(16)))

    started = time.perf_counter()
    threads = [threading.Thread(target=thread_call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    asyncio.run(asyncio.wait_for(all_tasks(), timeout=300))  # runs while the threads run
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a thread did not finish (deadlock?)"
    seconds = time.perf_counter() - started
    logger.info("32 concurrent calls in %.2f s (%.1f calls/s)", seconds, 32 / seconds)

    assert {i: results_chat[i] for i in range(16)} == {i: alone_chat[PROMPTS[i % 4]] for i in range(16)}
    assert {i: results_llm[i] for i in range(16)} == {i: alone_llm[PROMPTS[i % 4]] for i in range(16)}
