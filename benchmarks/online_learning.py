"""``learn_online=True`` on SmolLM2-135M-Instruct (issue 43, item 3): does the shipped EAGLE head learn a domain?

One process, one torch thread for the requests (the learner thread uses its own one), float32, the
EAGLE head shipped for the model, 3 fixed drafts (no calibration: no cost gate), greedy:

1. ``tau_before``: tokens per verify on held-out requests of one domain with the shipped head.
2. ``N`` requests of that domain, each served twice, interleaved (the order alternating): by an
   engine with ``learn_online=True`` (its learner thread training in the background) and by one
   without (the learner paused during those, so it does not slow them). Latencies of both; their
   texts compared token by token; the process's RSS before and after.
   RSS is read after both engines served a request (their caches allocated), so its growth is the
   learner's: the buffer, the trained copy, AdamW's moments, published heads.
3. ``tau_after``: the same held-out requests with the head the learner serves at the end (and with
   its newest trained copy).

Prompts come from templates over topics; held-out requests use topics the stream never saw.

    PYTHONPATH=src python benchmarks/online_learning.py --requests 60
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from result_files import write_result  # beside this file

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.online import OnlineSettings, clone_head

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
TEMPLATES = [
    "How do I cook {topic} at home? Give me simple steps.",
    "Write a short recipe for {topic}.",
    "What ingredients do I need for {topic}, and how long does it take?",
    "Explain how to make {topic} for a beginner.",
    "Give me three tips for making great {topic}.",
]
TOPICS = [
    "pancakes", "tomato soup", "fried rice", "banana bread", "guacamole", "omelette", "lentil curry",
    "apple pie", "mashed potatoes", "pasta carbonara", "chicken noodle soup", "pizza dough", "hummus",
    "french toast", "vegetable stir fry", "chocolate chip cookies", "beef stew", "caesar salad",
    "garlic bread", "risotto", "scrambled eggs", "pumpkin soup", "tacos", "lemonade", "granola",
]  # fmt: skip
HELD_OUT_TOPICS = ["carrot cake", "minestrone", "waffles", "potato salad", "falafel", "rice pudding"]


def prompts(topics: list[str], count: int) -> list[list[dict[str, str]]]:
    """``count`` chat requests: every template over every topic, in a fixed interleaved order."""
    pairs = [(t, topic) for topic in topics for t in TEMPLATES]
    ordered = [pairs[(i * 7) % len(pairs)] for i in range(len(pairs))]  # templates and topics interleaved
    chosen = [ordered[i % len(ordered)] for i in range(count)]
    return [[{"role": "user", "content": t.format(topic=topic)}] for t, topic in chosen]


def rss_mb() -> float:
    """This process's resident set size in MB (``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tau(engine: SpeculativeEngine, requests: list[Any], max_new_tokens: int) -> float:
    """Tokens per verify step (bonus included) over ``requests``, weighted by their verify steps."""
    steps = tokens = 0.0
    for messages in requests:
        stats = engine.generate(messages, max_new_tokens=max_new_tokens).stats
        rounds = max(stats.target_forwards - 1, 1)
        steps += rounds
        tokens += stats.mean_accepted_length * rounds
    return tokens / steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    loaded = SpeculativeEngine.from_pretrained(MODEL, dtype="float32", device="cpu", drafter="none", calibrate=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    fixed = {"drafter": "eagle", "num_draft_tokens": 3, "calibration": {}}
    off = SpeculativeEngine(model, tokenizer, **fixed)
    settings = OnlineSettings(save=False, step_interval=args.step_interval, lr=args.lr)
    on = SpeculativeEngine(model, tokenizer, learn_online=True, drafter_options={"online": settings}, **fixed)
    learner = on.drafter.learner
    held_out = prompts(HELD_OUT_TOPICS, args.held_out)
    stream = prompts(TOPICS, args.requests)
    with learner.paused():
        tau_before = tau(off, held_out, args.max_new_tokens)
        warmup = [{"role": "user", "content": "Say hello."}]
        on.generate(warmup, max_new_tokens=args.max_new_tokens)  # both engines' caches allocated: RSS from here
    rss_start = rss_mb()
    latencies: dict[str, list[float]] = {"on": [], "off": []}
    identical = True
    rss_after_warmup = None
    rss_trace: dict[str, float] = {}
    started = time.perf_counter()
    for i, messages in enumerate(stream):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        texts = {}
        for arm in order:
            engine = on if arm == "on" else off
            if arm == "off":
                with learner.paused():
                    begin = time.perf_counter()
                    out = off.generate(messages, max_new_tokens=args.max_new_tokens)
            else:
                begin = time.perf_counter()
                out = engine.generate(messages, max_new_tokens=args.max_new_tokens)
            latencies[arm].append(time.perf_counter() - begin)
            texts[arm] = out.token_ids
        identical &= texts["on"] == texts["off"]
        if i == min(9, len(stream) - 1):
            rss_after_warmup = rss_mb()
        if (i + 1) % 10 == 0:
            print(f"{i + 1}/{len(stream)} requests, {learner!r}, RSS {rss_mb():.0f} MB", flush=True)
        if (i + 1) % 50 == 0:
            rss_trace[str(i + 1)] = round(rss_mb(), 1)
    stream_seconds = time.perf_counter() - started
    rss_end = rss_mb()
    with learner.paused():
        served = learner.head_for_generation()
        newest = clone_head(learner._trainee).to(dtype=served.fc.weight.dtype).eval() if learner._trainee else served
        tau_served = tau(SpeculativeEngine(model, tokenizer, eagle_head=served, **fixed), held_out, args.max_new_tokens)
        tau_newest = tau(SpeculativeEngine(model, tokenizer, eagle_head=newest, **fixed), held_out, args.max_new_tokens)
    learner.close()
    median_on, median_off = statistics.median(latencies["on"]), statistics.median(latencies["off"])
    return {
        "model": MODEL,
        "dtype": "float32",
        "request_threads": 1,
        "learner_threads": settings.threads,
        "requests": args.requests,
        "held_out_requests": args.held_out,
        "max_new_tokens": args.max_new_tokens,
        "num_draft_tokens": 3,
        "settings": {k: getattr(settings, k) for k in settings.__dataclass_fields__},
        "tau_before": round(tau_before, 3),
        "tau_after_served_head": round(tau_served, 3),
        "tau_after_newest_copy": round(tau_newest, 3),
        "tau_ratio_served": round(tau_served / tau_before, 3),
        "tau_ratio_newest": round(tau_newest / tau_before, 3),
        "median_latency_s": {"learning_on": round(median_on, 3), "learning_off": round(median_off, 3)},
        "latency_ratio_on_off": round(median_on / median_off, 3),
        "greedy_identical_on_vs_off": identical,
        "rss_mb": {
            "start_of_stream": round(rss_start, 1),
            "after_10_requests": round(rss_after_warmup or float("nan"), 1),
            "end": round(rss_end, 1),
            "every_50_requests": rss_trace,
        },
        "rss_growth_mb": round(rss_end - rss_start, 1),
        "learner": {
            "steps": learner.steps,
            "swaps": learner.swaps,
            "rollbacks": learner.guard.rollbacks,
            "memory_releases": learner.trims,
            "memory_release_seconds": round(learner.trim_seconds, 3),
            "target_gradient_mb": round(
                sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None) / 2**20,
                1,
            ),
            "buffer_positions": learner.buffer.positions,
            "frozen_tau_ema": learner.guard.frozen_tau,
            "learned_tau_ema": learner.guard.learned_tau,
            "last_losses": list(learner.losses)[-5:],
        },
        "stream_seconds": round(stream_seconds, 1),
        "load_average_1m_end": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def markdown(result: dict[str, Any]) -> str:
    """The result as a short Markdown table."""
    latency = result["median_latency_s"]
    rows = [
        ("requests (stream) / held out", f"{result['requests']} / {result['held_out_requests']}"),
        ("tau before (shipped head)", result["tau_before"]),
        ("tau after (head served at the end)", f"{result['tau_after_served_head']} (x{result['tau_ratio_served']})"),
        ("tau after (newest trained copy)", f"{result['tau_after_newest_copy']} (x{result['tau_ratio_newest']})"),
        ("median latency on / off (s)", f"{latency['learning_on']} / {latency['learning_off']} "
         f"(x{result['latency_ratio_on_off']})"),
        ("greedy identical on vs off", result["greedy_identical_on_vs_off"]),
        ("RSS growth (MB)", result["rss_growth_mb"]),
        ("learner steps / swaps / rollbacks", f"{result['learner']['steps']} / {result['learner']['swaps']} / "
         f"{result['learner']['rollbacks']}"),
        ("load average (1 min) at the end", result["load_average_1m_end"]),
    ]  # fmt: skip
    lines = [
        "# Online learning: SmolLM2-135M-Instruct, shipped EAGLE head, float32, 1 request thread + 1 learner thread",
        "",
        f"{result['when']}; {result['max_new_tokens']} new tokens per request, 3 fixed drafts, greedy; "
        "produced by `benchmarks/online_learning.py`.",
        "",
        "| figure | value |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--held-out", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--step-interval", type=float, default=OnlineSettings.step_interval)
    parser.add_argument("--lr", type=float, default=OnlineSettings.lr)
    parser.add_argument("--out", default=str(RESULTS / "online_learning_cpu"))
    args = parser.parse_args()
    result = run(args)
    write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
