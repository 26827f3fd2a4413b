#!/usr/bin/env bash
# GPU check (no network needed), under 8 minutes on one modern GPU:
#  1. verify-cost curve and draft cost per exit layer for a random Llama-3-8B-shaped model,
#     in bf16, bitsandbytes NF4 and 8-bit;
#  2. the demo model's full side-by-side benchmark on the GPU.
# Results land in benchmarks/results/ (JSON, markdown and PNG).
# Usage: bash benchmarks/gpu_check.sh [--shape tiny --device cpu]   (the latter is the CPU smoke test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-benchmarks/results}
export HF_HUB_OFFLINE=1
$PY benchmarks/gpu_check.py --out "$OUT" "$@"
if [ "$#" -eq 0 ]; then
  $PY -m selfspec bench --device cuda --max-new-tokens 96 --repeats 3 --out "$OUT" --name bench_gpu
fi
