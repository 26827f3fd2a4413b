"""Time to first token on a long RAG prompt: selfspec's prefill against transformers' ``generate``.

SmolLM2-135M-Instruct, one thread, a ~1.4k-token RAG prompt (articles and passages from the
built-in prompt banks, then a question), greedy, one new token. These ways, interleaved, medians
of ``--repeats``:

- ``transformers``: ``model.generate(max_new_tokens=1)``;
- ``selfspec``: ``SpeculativeEngine(drafter="none").generate_ids(max_new_tokens=1)`` (prefill with
  ``is_causal``, as ``generate`` does);
- ``ChatHuggingFace`` and ``ChatSpeculative`` (when ``langchain-huggingface`` is installed): the
  same messages through LangChain, ``ChatHuggingFace`` over a transformers ``text-generation``
  pipeline of the same loaded model, ``ChatSpeculative`` with its defaults (``drafter="auto"``,
  ``calibrate=False``), ``max_tokens=1``: the time to first token a LangChain app sees;
- ``selfspec_mask`` (``--mask``): the engine with the explicit ``[q, kv]`` prefill mask selfspec
  used before (the before/after comparison; ~37 s a run in bfloat16).

Writes ``benchmarks/results/prefill_cpu.{json,md}`` with the load average before and after.

    PYTHONPATH=src python benchmarks/prefill_bench.py [--dtypes float32 bfloat16] [--repeats 3] [--mask]

``langchain-huggingface`` pins ``huggingface-hub<2``; install it beside the venv without its
dependencies (``pip install --no-deps --target /tmp/lhf langchain-huggingface``, then
``PYTHONPATH=src:/tmp/lhf``): its pipeline wrapper runs with the installed hub.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from selfspec import SpeculativeEngine
from selfspec.modeling.loading import load_model_and_tokenizer
from selfspec.modeling.realmodels import fetch_model
from selfspec.prompts import ARTICLES, PASSAGES

RESULTS = Path(__file__).parent / "results"


def rag_messages(tokenizer: Any, target_tokens: int) -> list[dict[str, str]]:
    """A RAG prompt of about ``target_tokens`` tokens: passages until long enough, then a question."""
    passages: list[str] = []
    texts = [*ARTICLES, *PASSAGES]
    while len(tokenizer("\n\n".join(passages)).input_ids) < target_tokens - 60:
        passages.append(texts[len(passages) % len(texts)])
    question = "Question: when will the city library reopen, and where can books be returned meanwhile?"
    return [{"role": "user", "content": "Context:\n" + "\n\n".join(passages) + "\n\n" + question}]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def chat_methods(model: Any, tokenizer: Any, dtype: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """``ChatHuggingFace`` and ``ChatSpeculative`` answering ``messages`` with one token (``{}`` without them)."""
    try:
        from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    except ImportError:
        print("langchain-huggingface is not installed: no ChatHuggingFace comparison")
        return {}
    from langchain_selfspec import ChatSpeculative
    from transformers import pipeline

    text_generation = pipeline(
        "text-generation", model=model, tokenizer=tokenizer, max_new_tokens=1, do_sample=False, return_full_text=False
    )
    hf = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=text_generation, model_id=str(fetch_model())),
                         tokenizer=tokenizer)  # fmt: skip
    speculative = ChatSpeculative(model=str(fetch_model()), dtype=dtype, calibrate=False, max_tokens=1)
    roles = {"user": "human", "assistant": "ai", "system": "system"}
    chat = [(roles[m["role"]], m["content"]) for m in messages]
    return {
        "ChatHuggingFace": lambda: hf.invoke(chat).content,
        "ChatSpeculative": lambda: speculative.invoke(chat).content,
    }


def measure(dtype: str, target_tokens: int, repeats: int, mask: bool) -> dict[str, Any]:
    model, tokenizer, _ = load_model_and_tokenizer(fetch_model(), dtype=dtype, device="cpu")
    engine = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
    messages = rag_messages(tokenizer, target_tokens)
    ids = engine.encode_prompt(messages)
    input_ids = torch.tensor([ids])

    def transformers_first() -> int:
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=1,
            pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        return int(out[0, -1])

    methods: dict[str, Any] = {
        "transformers": transformers_first,
        "selfspec": lambda: engine.generate_ids(ids, max_new_tokens=1).token_ids[0],
    }
    if mask:
        masked = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
        masked.runner._prefill_plans = masked.runner._chain_plans  # type: ignore[method-assign]
        methods["selfspec_mask"] = lambda: masked.generate_ids(ids, max_new_tokens=1).token_ids[0]
    chats = chat_methods(model, tokenizer, dtype, messages)
    methods.update(chats)
    times: dict[str, list[float]] = {name: [] for name in methods}
    first: dict[str, Any] = {}
    with torch.inference_mode():
        for name, run in methods.items():  # warm up each path once (ChatSpeculative loads its engine here)
            first[name] = run()
        names = list(methods)
        for turn in range(repeats):  # the order rotates: whoever runs first pays the allocator's first touches
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                started = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    pairs = [("selfspec", "transformers")] + ([("ChatSpeculative", "ChatHuggingFace")] if chats else [])
    pairs += [("selfspec_mask", "transformers")] if mask else []
    ratios = {f"{a}_vs_{b}": ratio(times[a], times[b]) for a, b in pairs}
    return {
        "dtype": dtype,
        "prompt_tokens": len(ids),
        "seconds": {name: [round(t, 3) for t in values] for name, values in times.items()},
        "median_seconds": {name: round(t, 3) for name, t in medians.items()},
        "ratios": ratios,
        "same_first_token": len({v for k, v in first.items() if k not in chats}) == 1,
        "same_chat_text": len({first[k] for k in chats}) <= 1,
    }


def ratio(mine: list[float], theirs: list[float]) -> dict[str, float]:
    """The median ratio of the interleaved turns' times, and its spread (lowest and highest turn)."""
    turns = [a / b for a, b in zip(mine, theirs, strict=True)]
    return {"median": round(statistics.median(turns), 3), "min": round(min(turns), 3), "max": round(max(turns), 3)}


LABELS = {"transformers": "transformers `generate`", "selfspec_mask": "selfspec, explicit mask (before)"}


def write(report: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_cpu.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        "# Time to first token on a long RAG prompt (CPU)",
        "",
        f"SmolLM2-135M-Instruct, {report['threads']} thread, greedy, `max_new_tokens=1`, medians of "
        f"{report['repeats']} interleaved runs (the order rotating) after one warm-up; "
        f"{report['started']} - {report['finished']} UTC, "
        f"load average {report['load_before']} before, {report['load_after']} after "
        "(2 cores shared with other jobs: read ratios, not absolute times).",
        "",
        "| dtype | prompt tokens | way | median time to first token | ratio (median, lowest-highest turn) |",
        "|---|---|---|---|---|",
    ]
    baselines = {"selfspec": "transformers", "selfspec_mask": "transformers", "ChatSpeculative": "ChatHuggingFace"}
    for row in report["runs"]:
        for name, seconds in row["median_seconds"].items():
            key = f"{name}_vs_{baselines.get(name)}"
            r = row["ratios"].get(key)
            shown = f"{r['median']:.2f}x of {baselines[name]} ({r['min']:.2f}-{r['max']:.2f})" if r else "baseline"
            label = {"transformers": "transformers `generate`", "selfspec_mask": "selfspec, explicit mask (before)"}
            lines.append(
                f"| {row['dtype']} | {row['prompt_tokens']} | {label.get(name, name)} | {seconds:.2f} s | {shown} |"
            )
    lines += [
        "",
        "Same first token (engine and `generate`): "
        + ", ".join(f"{row['dtype']} {row['same_first_token']}" for row in report["runs"])
        + "; same text from both chat models: "
        + ", ".join(f"{row['dtype']} {row['same_chat_text']}" for row in report["runs"])
        + ".",
    ]
    lines += ["", "Made by `benchmarks/prefill_bench.py`.", ""]
    (RESULTS / "prefill_cpu.md").write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=1400, help="approximate prompt length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mask", action="store_true", help="also time the explicit-mask prefill (slow in bf16)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "threads": 1,
        "repeats": args.repeats,
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_before": load_average(),
        "runs": [],
    }
    for dtype in args.dtypes:
        report["runs"].append(measure(dtype, args.tokens, args.repeats, args.mask))
        report["load_after"] = load_average()
        report["finished"] = time.strftime("%H:%M", time.gmtime())
        write(report)  # rewritten after each dtype


if __name__ == "__main__":
    main()
