"""``drafter="auto"`` on a model whose drafts are (almost) always rejected: it must not be slower.

python benchmarks/random_model_bench.py             # writes benchmarks/results/bench_random_cpu.{json,md,png}
python benchmarks/random_model_bench.py --quick     # a short smoke run into a temporary folder

The model is the demo model's shape (16 layers x 192, vocab 4096) with random weights (initializer
range 0.1), saved with
the demo tokenizer to a temporary folder: its early exits disagree with its last layer, and its
text is noise, so nothing it drafts is accepted except where its own greedy text repeats itself.
Loaded through ``SpeculativeEngine.from_pretrained`` like any user's model, it is calibrated on
first load; the benchmark then runs, interleaved, transformers' greedy and sampling, selfspec's
plain loop (greedy, T=0.7, T=1.0), ``drafter="auto"`` with its calibrated plan (same three), and two
settings that speculate whatever calibration says, held back only by the online guard:
``auto`` without a calibration (prompt lookup, 4 drafts, adaptive) and the adaptive early exit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import transformers

from selfspec import SpeculativeEngine
from selfspec.calibration.bench import Method, _selfspec_method, format_table, run_benchmark, write_report
from selfspec.modeling.loading import demo_model_path

RESULTS = Path(__file__).parent / "results"


def random_model(folder: Path, seed: int = 0) -> Path:
    """The demo model's shape with random weights and the demo tokenizer, saved to ``folder``."""
    demo = demo_model_path()
    config = transformers.AutoConfig.from_pretrained(demo)
    # 0.1, not transformers' 0.02: with small random weights every layer barely moves the residual
    # stream, so early exits agree with the last layer (~90%) and greedy text repeats one token
    # (lookup accepts it all); at 0.1 exits agree < 5% and 40 new tokens are 40 distinct ones
    config.initializer_range = 0.1
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig.from_pretrained(demo)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(demo).save_pretrained(folder)
    return folder


def guarded_methods(temperatures: tuple[float, ...]):  # a bench extra_methods callback
    """Methods that speculate regardless of calibration (the online guard is all that holds them back)."""

    def build(engine: SpeculativeEngine) -> list[Method]:
        model, tokenizer = engine.model, engine.tokenizer
        uncalibrated = SpeculativeEngine(model, tokenizer, drafter="auto", calibration={})
        early = SpeculativeEngine(model, tokenizer, drafter="early_exit", calibration={})
        about = "drafter='auto' without a calibration (prompt lookup, adaptive): the guard alone"
        methods = [
            _selfspec_method("selfspec_auto_uncalibrated", uncalibrated, "hf_greedy", about),
            _selfspec_method("selfspec_early_exit_adaptive", early, "hf_greedy", "early exit, adaptive (guarded)"),
        ]
        methods += [
            _selfspec_method(f"selfspec_auto_uncalibrated_t{t}", uncalibrated, f"hf_sample_t{t}", f"{about}, T={t}", t)
            for t in temperatures
        ]
        return methods

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="bench_random_cpu")
    args = parser.parse_args()
    temperatures = (0.7, 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_model(Path(tmp) / "random-llama-16x192")
        report = run_benchmark(
            str(folder),
            max_new_tokens=16 if args.quick else args.max_new_tokens,
            repeats=1 if args.quick else args.repeats,
            temperatures=temperatures,
            methods=["plain", "auto"],
            extra_methods=guarded_methods(temperatures),
            draft_model=None,
        )
    report.settings["model"] = "random Llama 16x192 (demo shape, random weights: initializer range 0.1, seed 0)"
    report.settings["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out = tempfile.mkdtemp() if args.quick else args.out
    for path in write_report(report, out, args.name):
        print(f"wrote {path}")
    print(format_table(report))


if __name__ == "__main__":
    main()
