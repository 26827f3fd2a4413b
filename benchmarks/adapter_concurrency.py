"""Throughput of one shared engine called by 16 threads and 16 asyncio tasks through both adapters.

For each adapter (LangChain ``ChatSpeculative``, LlamaIndex ``SpeculativeLLM``) and each mode
(local engine, endpoint mode against ``selfspec serve`` on loopback), the same 32 calls run once
one after another and once together (16 threads and 16 asyncio tasks at the same time). Every
concurrent answer is checked against the same call made alone. The engine serialises calls round
by round, so together is not expected to be faster; the numbers show what sharing costs. The
"local, batching" mode gives the adapters ``batching=True``: concurrent calls share rounds.

python benchmarks/adapter_concurrency.py    # writes benchmarks/results/adapter_concurrency_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

RESULTS = Path(__file__).parent / "results"
PROMPTS = [f"Tell me about {topic}." for topic in ("Bath", "Longbourn", "Mr. Darcy", "the sea")]
CALLS = 16  # threads, and as many asyncio tasks


def measure(call: Callable[[str], str], acall: Callable[[str], Awaitable[str]]) -> dict[str, Any]:
    """The same 32 calls one after another, then 16 threads + 16 tasks together."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(2 * CALLS)]
    started = time.perf_counter()
    alone = [call(p) for p in prompts[:CALLS]] + [asyncio.run(acall(p)) for p in prompts[CALLS:]]
    sequential = time.perf_counter() - started

    together: dict[int, str] = {}

    def thread_call(i: int) -> None:
        together[i] = call(prompts[i])

    async def tasks() -> None:
        async def one(i: int) -> None:
            together[i] = await acall(prompts[i])

        await asyncio.gather(*(one(i) for i in range(CALLS, 2 * CALLS)))

    started = time.perf_counter()
    threads = [threading.Thread(target=thread_call, args=(i,)) for i in range(CALLS)]
    for thread in threads:
        thread.start()
    asyncio.run(tasks())
    for thread in threads:
        thread.join()
    concurrent = time.perf_counter() - started
    identical = [together[i] for i in range(2 * CALLS)] == alone
    if not identical:
        raise AssertionError("a concurrent answer differs from the same call made alone")
    return {
        "calls": 2 * CALLS,
        "sequential_seconds": round(sequential, 3),
        "concurrent_seconds": round(concurrent, 3),
        "sequential_calls_per_second": round(2 * CALLS / sequential, 2),
        "concurrent_calls_per_second": round(2 * CALLS / concurrent, 2),
        "identical_to_alone": identical,
    }


def langchain_calls(fields: dict[str, Any], max_tokens: int) -> tuple[Callable[[str], str], Any]:
    from langchain_selfspec import ChatSpeculative

    llm = ChatSpeculative(model="selfspec-demo", max_tokens=max_tokens, **fields)

    async def astream(prompt: str) -> str:
        return "".join([chunk.text async for chunk in llm.astream(prompt)])

    return lambda prompt: str(llm.invoke(prompt).content), astream


def llamaindex_calls(fields: dict[str, Any], max_tokens: int) -> tuple[Callable[[str], str], Any]:
    from llama_index.llms.selfspec import SpeculativeLLM

    llm = SpeculativeLLM(model="selfspec-demo", max_tokens=max_tokens, **fields)

    async def astream(prompt: str) -> str:
        stream = await llm.astream_complete(prompt)
        return "".join([response.delta or "" async for response in stream])

    return lambda prompt: llm.complete(prompt).text, astream


def main(argv: list[str] | None = None) -> int:
    """Run every adapter and mode and write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "adapter_concurrency_cpu.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from selfspec import get_engine
    from selfspec.serving.server import serve_in_background

    engine = get_engine("selfspec-demo")
    engine.generate("Warm up.", max_new_tokens=4)
    runs = []
    with serve_in_background(engine, model_id="selfspec-demo") as root:
        base_url = f"{root}/v1"
        modes = (("local", {}), ("local, batching", {"batching": True}), ("endpoint", {"base_url": base_url}))
        for mode, fields in modes:
            for adapter, make in (("langchain", langchain_calls), ("llamaindex", llamaindex_calls)):
                call, acall = make(fields, args.max_tokens)
                result = {"adapter": adapter, "mode": mode, **measure(call, acall)}
                runs.append(result)
                print(json.dumps(result))
    report = {
        "what": "32 calls (16 threads + 16 asyncio tasks) on one shared demo engine, vs the same calls one by one",
        "model": "selfspec-demo",
        "max_tokens": args.max_tokens,
        "torch_threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
