"""Batched speculation against serial decoding: throughput at 1, 4 and 16 concurrent requests.

python benchmarks/batch_bench.py            # writes benchmarks/results/batch_cpu.{json,md,png}
python benchmarks/batch_bench.py --quick    # a short smoke run into a temporary folder

One process, one model object shared by every engine, one torch thread. For each level of
concurrency ``N`` the same ``N`` requests (greedy, the built-in benchmark prompts) are run:

* ``serial``: one after another on an unbatched engine (calibrated early exit, adaptive);
* ``batched``: all at once, from ``N`` threads, on an engine with ``batching=True`` (same
  drafter and calibration);
* ``batched_plain``: all at once on a batching engine with ``drafter="none"`` (batched
  decoding without speculation, for reference).

Throughput is the total new tokens of the ``N`` requests divided by the wall time until the
last one finished; methods are interleaved and repeated, and the median is reported. Batched
outputs are compared with the serial ones: in float32 a batched kernel may round differently
from a single-row one, so a near-tie can flip a token; the count of identical outputs is
reported as measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from selfspec import SpeculativeEngine
from selfspec.prompts import PROMPT_SETS

RESULTS = Path(__file__).parent / "results"
CONCURRENCY = (1, 4, 16)
METHODS = ("serial", "batched", "batched_plain")


def prompts_in_round_robin() -> list[Any]:
    """The 16 benchmark prompts, alternating categories (the first N cover N categories).

    Plain continuation comes first: chat answers of the demo model are short, and a single
    request should decode long enough to measure decoding rather than its prefill.
    """
    sets = [PROMPT_SETS["continuation"]] + [s for name, s in PROMPT_SETS.items() if name != "continuation"]
    width = max(len(s) for s in sets)
    return [s[i] for i in range(width) for s in sets if i < len(s)]


def run_serial(engine: SpeculativeEngine, prompts: list[Any], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    outputs = [engine.generate(p, max_new_tokens=max_new_tokens).token_ids for p in prompts]
    return time.perf_counter() - started, outputs


def run_concurrent(engine: SpeculativeEngine, prompts: list[Any], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    outputs: list[list[int]] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts) + 1)

    def call(i: int) -> None:
        start.wait()
        outputs[i] = engine.generate(prompts[i], max_new_tokens=max_new_tokens).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, outputs


def measure(max_new_tokens: int, repeats: int, levels: tuple[int, ...]) -> dict[str, Any]:
    serial = SpeculativeEngine.from_pretrained("selfspec-demo")
    model, tokenizer, calibration = serial.model, serial.tokenizer, serial.calibration
    engines = {
        "serial": serial,
        "batched": SpeculativeEngine(model, tokenizer, calibration=calibration, batching=True, drafter="early_exit"),
        "batched_plain": SpeculativeEngine(model, tokenizer, calibration=calibration, drafter="none", batching=True),
    }
    all_prompts = prompts_in_round_robin()
    # warm up every path once (first calls allocate buffers and load kernels)
    for name, engine in engines.items():
        (run_serial if name == "serial" else run_concurrent)(engine, all_prompts[:2], 8)
    seconds: dict[tuple[int, str], list[float]] = {}
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    with tqdm(total=repeats * len(levels) * len(METHODS), desc="batch bench", unit="run") as bar:
        for _ in range(repeats):
            for level in levels:
                prompts = all_prompts[:level]
                for name in METHODS:
                    run = run_serial if name == "serial" else run_concurrent
                    elapsed, outs = run(engines[name], prompts, max_new_tokens)
                    seconds.setdefault((level, name), []).append(elapsed)
                    outputs.setdefault((level, name), outs)
                    bar.update(1)
    rows = []
    for level in levels:
        reference = outputs[(level, "serial")]
        serial_tps = None
        for name in METHODS:
            tokens = sum(len(o) for o in outputs[(level, name)])
            per_repeat = [tokens / s for s in seconds[(level, name)]]
            tps = statistics.median(per_repeat)
            serial_tps = tps if name == "serial" else serial_tps
            identical = sum(a == b for a, b in zip(outputs[(level, name)], reference, strict=True))
            rows.append(
                {
                    "concurrency": level,
                    "method": name,
                    "tokens": tokens,
                    "tokens_per_second": round(tps, 1),
                    "spread": [round(min(per_repeat), 1), round(max(per_repeat), 1)],
                    "speedup_vs_serial": round(tps / serial_tps, 2) if serial_tps else None,
                    "identical_to_serial": identical,
                    "requests": level,
                }
            )
    return {
        "meta": {
            "model": "selfspec-demo",
            "device": "cpu",
            "dtype": str(serial.runner.dtype),
            "threads": torch.get_num_threads(),
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "exit_layer": serial.exit_layer,
            "num_draft_tokens": serial.num_draft_tokens,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
        "results": rows,
    }


def write(result: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    meta = result["meta"]
    lines = [
        f"# Batched speculation: {meta['model']} on {meta['device']} ({meta['dtype']}, {meta['threads']} thread)",
        "",
        f"{meta['max_new_tokens']} new tokens per request, greedy, {meta['repeats']} interleaved repeats "
        f"(median); early exit at layer {meta['exit_layer']}, adaptive draft length; {meta['date']}.",
        "",
        "| concurrent requests | method | tok/s (all requests) | spread | vs serial | identical to serial |",
        "|---:|---|---:|---:|---:|:---:|",
    ]
    for row in result["results"]:
        lo, hi = row["spread"]
        lines.append(
            f"| {row['concurrency']} | {row['method']} | {row['tokens_per_second']} | {lo}-{hi} | "
            f"{row['speedup_vs_serial']:.2f}x | {row['identical_to_serial']}/{row['requests']} |"
        )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({row["concurrency"] for row in result["results"]})
    fig, ax = plt.subplots(figsize=(6.4, 4))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        values = [
            next(r["tokens_per_second"] for r in result["results"] if r["method"] == method and r["concurrency"] == lvl)
            for lvl in levels
        ]
        ax.bar([x + (i - 1) * width for x in range(len(levels))], values, width, label=method)
    ax.set_xticks(range(len(levels)), [str(lvl) for lvl in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total new tokens / s")
    ax.set_title(f"{meta['model']}, CPU, {meta['threads']} thread, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short smoke run into a temporary folder")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        result = measure(max_new_tokens=8, repeats=1, levels=(1, 4))
        write(result, Path(tempfile.mkdtemp()), "batch_cpu")
    else:
        result = measure(args.max_new_tokens, args.repeats, CONCURRENCY)
        write(result, RESULTS, "batch_cpu")
    for row in result["results"]:
        tqdm.write(json.dumps(row))


if __name__ == "__main__":
    main()
