"""A first load's GGUF conversion with one parse of the file against one parse per reader, side by side.

Converts SmolLM2-135M-Instruct's Q4_1 GGUF file (``python -m selfspec.modeling.realmodels`` fetches
it) into a fresh, empty cache folder each time, alternating the two ways in one process: as
``ensure_dequantized`` does it (:func:`~selfspec.modeling.loading.gguf_parsed_once`: the check,
config, weights and tokenizer share one reader) and with that block made a no-op (each builds its
own reader, as before). Records the seconds, the number of parses, the threads and the load
average, and checks that both ways write byte-identical weights::

    python benchmarks/gguf_conversion.py --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from selfspec.artifacts import atomic_write_text

RESULTS = Path(__file__).parent / "results" / "gguf_conversion_cpu.json"


def convert_once(source: Path, shared: bool, cache: Path) -> dict[str, Any]:
    """One conversion of ``source`` into ``cache``: seconds, parses and the weights' SHA-256."""
    import gguf

    from selfspec.modeling import loading

    os.environ["SELFSPEC_CACHE"] = str(cache)
    parses = 0
    original_init = gguf.GGUFReader.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal parses
        parses += 1
        original_init(self, *args, **kwargs)

    gguf.GGUFReader.__init__ = counting_init  # type: ignore[method-assign]
    parsed_once = loading.gguf_parsed_once
    if not shared:
        loading.gguf_parsed_once = contextlib.nullcontext  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        folder = loading.ensure_dequantized(str(source.parent), source.name)
        seconds = time.perf_counter() - started
    finally:
        gguf.GGUFReader.__init__ = original_init  # type: ignore[method-assign]
        loading.gguf_parsed_once = parsed_once
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()[:16]
    return {"seconds": round(seconds, 1), "parses": parses, "weights_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from selfspec.modeling.realmodels import fetch_model

    source = fetch_model(offline=True)  # (from the user cache, before SELFSPEC_CACHE points elsewhere)
    runs: dict[str, list[dict[str, Any]]] = {"one parse": [], "a parse per reader": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeats):
            order = [True, False] if turn % 2 == 0 else [False, True]
            for shared in order:
                run = convert_once(source, shared, Path(tmp) / f"{turn}-{shared}")
                runs["one parse" if shared else "a parse per reader"].append(run)
                print(json.dumps({"shared": shared, **run}), flush=True)
    record = {
        "model": "smollm2-135m-instruct (Q4_1 GGUF, 98 MB)",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "identical_weights": len({r["weights_sha256"] for rs in runs.values() for r in rs}) == 1,
    }
    atomic_write_text(RESULTS, json.dumps(record, indent=2) + "\n")
    lines = [
        "# A first load's GGUF conversion: one parse against a parse per reader",
        "",
        "`benchmarks/gguf_conversion.py`: SmolLM2-135M-Instruct's Q4_1 file converted into an empty cache,",
        f"the two ways alternated in one process, {args.repeats} each, {record['threads']} threads, load average",
        f"{record['load_average_before'][0]} before and {record['load_average_after'][0]} after.",
        "",
        "| | seconds (each run) | parses | weights |",
        "|---|---|---|---|",
    ]
    for name, rs in runs.items():
        seconds = ", ".join(str(r["seconds"]) for r in rs)
        lines.append(f"| {name} | {seconds} | {rs[0]['parses']} | {rs[0]['weights_sha256']} |")
    lines += ["", f"Identical weights both ways: {'yes' if record['identical_weights'] else 'NO'}.", ""]
    atomic_write_text(RESULTS.with_suffix(".md"), "\n".join(lines))


if __name__ == "__main__":
    main()
