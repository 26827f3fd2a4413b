#!/usr/bin/env bash
# The GPU check that decides in one call (issue 40, item 7): about 9 minutes on one H100/H200, no
# network. Sections, most decisive first: env; the measured ceilings (device copy, one-row GEMV on the
# 8B weight shapes); CUDA graphs recorded or not (fail-fast); the graphed step at widths 1/3/5/9 by
# CUDA events; forced acceptance 0.6/0.8/1.0 through the full loop with the host phases; a random
# EAGLE-3-shaped head's round; the eager row-exact verify and each weight's row invariance;
# transformers' static cache + compile; 4k/8k prefill and the decode at 4k context; 4-bit
# bitsandbytes where it is installed. gpu_check.json and gpu_check.md are rewritten (atomically)
# after every section; each section says ok / skipped / failed / timed_out and why.
# See benchmarks/gpu_check.py for what each field means.
#
# Usage:  GPU_CHECK_TIMEOUT=540 bash benchmarks/gpu_check.sh --out "$OUT"     # the device machine (deadline 480 s)
#         bash benchmarks/gpu_check.sh --sections forced eagle3 --out "$OUT"  # what a first call did not reach
#         bash benchmarks/gpu_check.sh --smoke --out /tmp/gc                   # CPU smoke run, about 30 s
# The outer timeout (GPU_CHECK_TIMEOUT, default 540 s) sends SIGTERM: the running section is marked
# timed_out, the JSON is written, and the run ends (exit 124).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"   # selfspec from this checkout, not installed
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout --signal=TERM --kill-after=20 "${GPU_CHECK_TIMEOUT:-540}" "$PY" benchmarks/gpu_check.py "$@"
status=$?
[ "$status" -eq 124 ] && echo "gpu_check: the outer timeout ended the run; the JSON holds what was measured" >&2
exit "$status"
