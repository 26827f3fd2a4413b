#!/usr/bin/env bash
# The GPU check (issue 26): one call, no network, no bitsandbytes (unless --quantized), about
# 5 minutes on one H200 (a global deadline of 270 s; no new measurement starts past it).
# Sections, most valuable first: env; demo-model exactness against transformers' generate in
# fp16/bf16 (eager loop); a Llama-3-8B-shaped random model with an oracle drafter at forced
# acceptance 0.6/0.8/1.0 (plain and speculative, eager and graphed; HF eager); SDPA backends
# with GQA at 4k; the demo's exactness through the compiled static round; HF static cache + compile;
# the graphed 8B steps under the profiler.
# gpu_check.json and gpu_check.md are rewritten after every measurement, so a timeout still
# leaves results. See benchmarks/gpu_check.py for what each field means.
#
# Usage:  bash benchmarks/gpu_check.sh --out "$OUT"                  # on the device machine
#         bash benchmarks/gpu_check.sh --sections demo_compiled hf_compiled --out "$OUT"   # what a first call skipped
#         bash benchmarks/gpu_check.sh --device cpu --shape tiny --quick --out /tmp/gc   # CPU smoke test
# The outer timeout (GPU_CHECK_TIMEOUT, 540 s) ends a compile that hangs; the JSON written so far stays.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"   # selfspec from this checkout, not installed
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout --signal=TERM "${GPU_CHECK_TIMEOUT:-540}" "$PY" benchmarks/gpu_check.py "$@"
status=$?
[ "$status" -eq 124 ] && echo "gpu_check: the outer timeout ended the run; the JSON holds what was measured" >&2
exit "$status"
