"""Half precision against float32 on this machine, measured on first load (issue 28 item 2).

``dtype="auto"`` runs a bf16 checkpoint in bfloat16 on CPUs with AMX or AVX512-BF16
(:func:`~selfspec.modeling.hardware.native_dtypes`). Whether that pays depends on the work: on the
2-core AMD EPYC measured here a one-token step of SmolLM2 costs the same in both precisions while a
long prefill is several times faster in bf16. First-load calibration therefore times both on a float32
copy of the model (CPU only, and only while the copy fits comfortably in memory) and says it with the plan.
"""

from __future__ import annotations

import copy
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from ..modeling.runner import ModelRunner

if TYPE_CHECKING:
    from ..decoding.engine import SpeculativeEngine

#: the prefill the comparison times (tokens).
PREFILL_TOKENS = 256
#: a float32 copy is made only when it takes at most this share of the machine's memory.
MEMORY_SHARE = 0.25


def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def precision_skip_reason(engine: SpeculativeEngine) -> str | None:
    """Why the comparison is not made for ``engine`` (``None``: it is)."""
    runner = engine.runner
    if runner.dtype not in (torch.bfloat16, torch.float16):
        return "the model runs in float32 already"
    if runner.device.type != "cpu":
        return "measured on CPUs only (a GPU computes half precision natively)"
    if getattr(engine.model, "is_quantized", False):
        return "a quantized model is not copied"
    params = sum(p.numel() for p in engine.model.parameters())
    if params * 4 > MEMORY_SHARE * _memory_bytes():
        return f"a float32 copy ({params * 4 / 2**30:.1f} GiB) would take over a quarter of this machine's memory"
    return None


def _timings(runner: ModelRunner, prompt: list[int], repeats: int) -> dict[str, float]:
    """Fastest seconds of a prefill of ``prompt`` and of one decode step after it."""
    ids = torch.tensor([prompt], device=runner.device)
    positions = torch.arange(len(prompt), device=runner.device)
    best = {"prefill": float("inf"), "step": float("inf")}
    for _ in range(repeats + 1):  # the first run warms up
        cache = runner.new_cache(len(prompt) + 2)
        started = time.perf_counter()
        hidden = runner.run_layers(runner.embed(ids), 0, runner.num_layers, positions, cache)
        runner.logits(hidden[:, -1:])
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        step = runner.run_layers(runner.embed(ids[:, :1]), 0, runner.num_layers, positions[-1:] + 1, cache)
        runner.logits(step)
        best = {"prefill": min(best["prefill"], prefill), "step": min(best["step"], time.perf_counter() - started)}
    return best


def measure_precision(engine: SpeculativeEngine, prompt: list[int], repeats: int = 3) -> dict[str, Any]:
    """Time a prefill of :data:`PREFILL_TOKENS` tokens and one decode step, in the engine's dtype and in float32.

    Returns:
        ``{"dtype", "prefill_speedup", "step_speedup", "prefill_seconds", "step_seconds"}`` (speedups of
        the engine's dtype over float32, ``> 1`` is faster), or ``{"skipped": why}``.
    """
    reason = precision_skip_reason(engine)
    if reason is not None:
        return {"skipped": reason}
    prompt = (prompt * (PREFILL_TOKENS // max(len(prompt), 1) + 1))[:PREFILL_TOKENS]
    runner = engine.runner
    float_model = copy.deepcopy(engine.model).float()
    float_runner = ModelRunner(float_model, fast_path=runner.fast_layers is not None)
    with torch.inference_mode():
        half = _timings(runner, prompt, repeats)
        full = _timings(float_runner, prompt, repeats)
    del float_runner, float_model
    return {
        "dtype": str(runner.dtype).replace("torch.", ""),
        "prefill_tokens": len(prompt),
        "prefill_speedup": round(full["prefill"] / half["prefill"], 2),
        "step_speedup": round(full["step"] / half["step"], 2),
        "prefill_seconds": {"half": round(half["prefill"], 4), "float32": round(full["prefill"], 4)},
        "step_seconds": {"half": round(half["step"], 4), "float32": round(full["step"], 4)},
    }


def describe_precision(measured: dict[str, Any] | None) -> str:
    """One sentence for the plan's log line (``""`` when nothing was measured)."""
    if not measured or "skipped" in measured:
        return ""
    return (
        f"{measured['dtype']} here runs a {measured['prefill_tokens']}-token prefill "
        f"{measured['prefill_speedup']:.2f}x and a decode step {measured['step_speedup']:.2f}x float32's speed"
    )
