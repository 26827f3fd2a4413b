"""The benchmark we publish: the demo model on CPU, one thread, every method side by side.

python benchmarks/run_bench.py            # writes benchmarks/results/bench_cpu.{json,md,png}
python benchmarks/run_bench.py --quick    # a short smoke run into a temporary folder
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from selfspec.cli import main

RESULTS = Path(__file__).parent / "results"

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        out = tempfile.mkdtemp()
        sys.exit(
            main(
                [
                    "bench",
                    "--max-new-tokens",
                    "24",
                    "--repeats",
                    "1",
                    "--categories",
                    "qa",
                    "rag",
                    "--temperatures",
                    "1.0",
                    "--out",
                    out,
                ]
            )
        )
    sys.exit(
        main(
            [
                "bench",
                "--max-new-tokens",
                "96",
                "--repeats",
                "3",
                "--threads",
                "1",
                "--out",
                str(RESULTS),
                "--name",
                "bench_cpu",
            ]
        )
    )
