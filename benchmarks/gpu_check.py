"""The GPU check that decides in one call (issue 40, item 7).

Prepared for one device call of about 9 minutes on a lent H100/H200 (no network, nothing
installable): ``GPU_CHECK_TIMEOUT=540 bash benchmarks/gpu_check.sh --out "$OUT"`` (deadline
``--deadline 480`` s by default). A Llama-3-8B-shaped model with random weights in bf16 (the
``llama3-8b`` shape), one engine whose static round every section shares. Sections, most
decisive first; each gets ``status`` ``ok`` / ``skipped`` / ``failed`` / ``timed_out`` and a
``reason``, and ``gpu_check.json`` (atomic: a temporary file, then ``os.replace``) and
``gpu_check.md`` are rewritten after every section, so a cut-off run still leaves what it measured:

1. ``env``: torch, CUDA, transformers, the GPU, bitsandbytes' version (not imported), the load.
2. ``ceilings``: the measured ceilings. A large device-to-device copy (read + write bytes / time)
   and ``F.linear`` at one row (cuBLAS GEMV on CUDA) on every weight shape of a layer and the LM
   head: GB/s each, and a decode step's weight bytes over the copy bandwidth (the roofline);
   q/k/v and gate/up as separate one-row calls against one fused call (``fused_gemv``), with
   whether the fused call keeps every output's bits (:func:`~selfspec.modeling.fastpath.fusion_keeps_bits`:
   where it does, the engine's runner reads them fused).
3. ``graphs``: whether CUDA graphs record, fail-fast: the plain width-1 step compiled
   (``compile=True``: inductor, ``mode="reduce-overhead"``), one replay under ``torch.profiler``
   (``graph_launch_calls``, ``kernel_launch_calls``), inductor's ``cudagraph_skips`` counter, any
   "skipping cudagraphs" log line, and the graph launches per round over a short real call;
   ``fused_projections``: how many q/k/v and gate/up groups the engine reads as one weight.
   ``failed`` on CUDA when no graph launched.
4. ``widths``: the graphed step of widths 1/3/5/9 (one compile each), its median by CUDA events
   and its graph launches: the verify-cost curve of what runs, independent of matching text.
5. ``forced``: :class:`forced_acceptance.ForcedAcceptanceDrafter` (test-only, never registered)
   through the full loop on the same engine: the model made context-free in place
   (:func:`forced_acceptance.make_context_free`, restored after), so the real verify accepts
   exactly the forced ``n ~ Geometric(alpha)`` capped at 8 drafts. Plain and alpha 0.6/0.8/1.0
   interleaved: tok/s, tokens a round, ms a round, the host phases of each round
   (:func:`forced_acceptance.record_rounds`: draft, launch, wait on the read, commit, the gap
   to the next round, device time by events), and proof that the accepted lengths are the forced ones.
6. ``eagle3``: a random EAGLE-3-shaped head (``new_eagle3_head``: three tapped layers, a 32k draft
   vocabulary) with 8 drafts a round: which loop serves it (the static round, or
   ``refused by static round: <reason>`` and the eager loop), ms a round, and tok/s projected at
   acceptance 0.8 from that round cost.
7. ``eager_verify``: what the eager loop's verify costs per width (1/3/5/9, the row-exact path:
   one SDPA call per row and one GEMV per row for weights that fail the invariance probe) and,
   per weight of layer 0 and the LM head, the widths whose rows differ from the rows alone.
8. ``hf_static``: transformers' ``generate`` with ``cache_implementation="static"`` and its own
   compile (``CompileConfig(fullgraph=True, mode="reduce-overhead")``), 32 new tokens.
9. ``long_context``: ``static_prefill`` at 4k and 8k prompts against transformers' prefill
   forward, then the graphed width-1 step at 4k context (bucket 8192) against ``widths``' w1.
10. ``bnb4``: only where bitsandbytes and CUDA are both present (else ``skipped`` with the reason):
    the linears in NF4, whether the static round takes the model and at which widths its 4-bit
    kernels keep a row's bits (``exact_widths``), the eager plain step, and the verify-cost curve
    through the lean path (a quantized projection called as its module).

Each section starts only with enough time left (:data:`NEEDS`) and is interrupted at its own
budget (:data:`BUDGETS`) or the deadline, whichever is first (``SIGALRM``; ``timed_out``). The
outer ``timeout`` (``SIGTERM``) marks the running section ``timed_out``, writes, and ends the run.

``--smoke``: the same sections on CPU with a tiny random Llama (2 layers, a 512-token vocabulary),
``torch.compile(backend="eager")`` for the compiled paths, small sizes; sections that need CUDA
say ``skipped: no CUDA`` only where no CPU equivalent runs (``bnb4``), and CUDA-only figures
(graph launches, events) are ``null`` with ``cuda_only`` saying so.

    PYTHONPATH=src python benchmarks/gpu_check.py --out "$OUT"          # the GPU
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gc  # CPU, about 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, str(Path(__file__).parent))  # forced_acceptance beside this file (test-only, not shipped)

from forced_acceptance import (
    ForcedAcceptanceDrafter,
    RoundRecord,
    expected_tokens_per_round,
    follows_successor,
    make_context_free,
    phase_medians,
    record_rounds,
)

from selfspec import SpeculativeEngine
from selfspec.artifacts import atomic_write_text
from selfspec.drafting.base import DecodeState, Draft, Drafter
from selfspec.modeling.fastpath import fusion_keeps_bits

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    },
}
SECTIONS = (
    "env",
    "ceilings",
    "graphs",
    "widths",
    "forced",
    "eagle3",
    "eager_verify",
    "row_invariant",
    "hf_static",
    "long_context",
    "bnb4",
)
#: seconds a section may run (on the 8B shape; the H100 compiled one width of it in 29-36 s).
BUDGETS = {
    "env": 10,
    "ceilings": 40,
    "graphs": 90,
    "widths": 150,
    "forced": 60,
    "eagle3": 90,
    "eager_verify": 40,
    "row_invariant": 150,
    "hf_static": 120,
    "long_context": 75,
    "bnb4": 60,
}
#: seconds that must be left before the deadline for a section to start.
NEEDS = {
    "env": 0,
    "ceilings": 5,
    "graphs": 30,
    "widths": 30,
    "forced": 10,
    "eagle3": 20,
    "eager_verify": 10,
    "row_invariant": 40,
    "hf_static": 45,
    "long_context": 30,
    "bnb4": 20,
}
DRAFTS = 8  # drafts of a full round: width 9
WIDTHS = (1, 3, 5, 9)
ALPHAS = (0.6, 0.8, 1.0)
EAGLE_DRAFT_VOCAB = 32000
NO_CUDA = "no CUDA: this figure exists only on a CUDA device"


class SectionTimeout(Exception):
    """A section ran past its budget or the deadline (``SIGALRM``), or the outer timeout came (``SIGTERM``)."""


class Skip(Exception):
    """A section cannot run here; the message is the reason."""


# ----------------------------------------------------------------------------- the run's bookkeeping
@dataclass
class Check:
    """One run: its arguments, the results (written after every section) and the shared objects."""

    args: argparse.Namespace
    results: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)  # the model, the engine (never saved)
    started: float = field(default_factory=time.perf_counter)
    terminated: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.args.deadline - (time.perf_counter() - self.started)

    def save(self) -> None:
        """Rewrite ``gpu_check.json`` and ``gpu_check.md`` atomically (a temporary file, then ``os.replace``)."""
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        atomic_write_text(out / "gpu_check.json", json.dumps(self.results, indent=1, default=str) + "\n")
        atomic_write_text(out / "gpu_check.md", markdown(self.results))

    def run_section(self, name: str, body: Callable[[Check, dict[str, Any]], None]) -> None:
        """Run one section into ``results["sections"][name]`` (filled in place: partial results are kept)."""
        out: dict[str, Any] = {"status": "running"}
        self.results.setdefault("sections", {})[name] = out
        left = self.left()
        if self.terminated:
            out |= {"status": "skipped", "reason": "the outer timeout ended the run"}
        elif left < NEEDS[name]:
            out |= {"status": "skipped", "reason": f"deadline: {left:.0f} s left, the section needs {NEEDS[name]}"}
        else:
            self.save()
            started = time.perf_counter()
            limit = max(min(BUDGETS[name] * self.args.budget_scale, left), 1.0)
            rang: list[str] = []
            try:
                with alarm(limit, rang):
                    body(self, out)
                out["status"] = out.get("status") if out.get("status") == "failed" else "ok"
            except Skip as skip:
                out |= {"status": "skipped", "reason": str(skip)}
            except Exception as exc:  # noqa: BLE001 - recorded; the next section runs
                if rang or self.terminated:  # a timeout, whatever wrapped it (dynamo re-raises its own errors)
                    why = rang[0] if rang else "the outer timeout (SIGTERM)"
                    out |= {"status": "timed_out", "reason": f"{why} after {time.perf_counter() - started:.0f} s"}
                else:
                    out |= {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:600]}
                out["trace"] = traceback.format_exc()[-2500:]
            out["seconds"] = round(time.perf_counter() - started, 1)
        out.setdefault("reason", None)
        log(self, f"{name}: {out['status']} {json.dumps(out, default=str)[:300]}")
        self.save()


def log(check: Check, message: str) -> None:
    print(f"[{time.perf_counter() - check.started:6.1f}s] {message}", flush=True)


@contextlib.contextmanager
def alarm(seconds: float, rang: list[str]) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the block after ``seconds`` (``SIGALRM``, the main thread).

    ``rang`` receives the reason when it fires: code that catches and re-raises (dynamo wraps an
    exception raised while it traces) still leaves the section ``timed_out``.
    """

    def ring(_signum: int, _frame: Any) -> None:
        rang.append("the section's budget or the deadline passed")
        raise SectionTimeout(rang[0])

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_ms(check: Check, call: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median ms of ``call``: CUDA events on CUDA (device time between two events), else the wall clock."""
    for _ in range(warmup):
        call()
    synchronize(check.device)
    samples = []
    for _ in range(repeats):
        if check.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            begun = time.perf_counter()
            call()
            samples.append(1000 * (time.perf_counter() - begun))
    return round(statistics.median(samples), 4)


# ----------------------------------------------------------------------------- shared objects
def build_random_llama(check: Check) -> Any:
    """A random Llama of ``--shape`` (bf16 on CUDA, float32 on CPU), SDPA, no end-of-sequence token."""
    config = transformers.LlamaConfig(**SHAPES[check.args.shape])
    config.eos_token_id = None
    config.tie_word_embeddings = False
    dtype = torch.bfloat16 if check.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(check.device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def model_of(check: Check) -> Any:
    """The run's random model, built on first use (its build time recorded under ``results["model"]``)."""
    if "model" not in check.kept:
        started = time.perf_counter()
        check.kept["model"] = build_random_llama(check)
        synchronize(check.device)
        info = {"shape": check.args.shape, "build_s": round(time.perf_counter() - started, 1)}
        info["dtype"] = str(check.kept["model"].dtype)
        if check.cuda:
            info["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        check.results["model"] = info
    return check.kept["model"]


def compile_option(check: Check) -> bool | str:
    """The engine's ``compile=``: inductor (``True``) on the GPU; the smoke run's backend on CPU."""
    return True if check.args.compile_backend == "inductor" else check.args.compile_backend


def engine_of(check: Check) -> SpeculativeEngine:
    """The run's graphed engine: the forced drafter (plain until told otherwise), 8 drafts, compiled."""
    if "engine" not in check.kept:
        model = model_of(check)
        drafter = ForcedAcceptanceDrafter(list(range(model.config.vocab_size)), 0)  # plain until ``forced``
        engine = SpeculativeEngine(  # cuBLAS and SDPA (row_exact=False): the baseline the kernels are timed against
            model,
            None,
            drafter=drafter,
            num_draft_tokens=DRAFTS,
            calibration={},
            compile=compile_option(check),
            row_exact=False,
        )
        if engine.static_round is None:
            raise RuntimeError(f"the engine has no static round (compile={compile_option(check)!r})")
        check.kept["engine"], check.kept["drafter"] = engine, drafter
    return check.kept["engine"]


def prompt_of(check: Check, length: int | None = None, seed: int = 1) -> list[int]:
    vocab = SHAPES[check.args.shape]["vocab_size"]
    length = check.args.prompt_len if length is None else length
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def call_slots(check: Check) -> int:
    """The slots the forced calls reserve (prompt, new tokens, the widest draft): the bucket every step shares."""
    from selfspec.modeling.static_step import WIDTHS as ALL_WIDTHS

    return check.args.prompt_len + check.args.new_tokens + ALL_WIDTHS[-1]


def step_replay(check: Check, step: Any, width: int, context: int) -> Callable[[], Any]:
    """One greedy step of ``width`` at ``context`` cached positions (the length reset each time)."""
    cache = step.cache
    bucket = cache.max_length
    tokens = torch.full((1, width), 7, dtype=torch.long, device=check.device)
    drafts = torch.tensor(width - 1, dtype=torch.long).to(check.device)

    def once() -> Any:
        cache.length.fill_(context)
        return step.greedy(tokens, drafts, bucket)

    return once


def launches(check: Check, call: Callable[[], Any]) -> dict[str, Any]:
    """One ``call`` under ``torch.profiler``: graph launches, kernel launches, kernels and their device time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if check.cuda else [])
    with torch.inference_mode(), profile(activities=activities) as profiler:
        call()
        synchronize(check.device)
    events = list(profiler.events())
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    result: dict[str, Any] = {"aten_ops_nested": sum(e.name.startswith("aten::") for e in host)}
    if not check.cuda:
        return result | {"graph_launch_calls": None, "kernel_launch_calls": None, "cuda_only": NO_CUDA}
    return result | {
        "graph_launch_calls": sum(e.name.startswith(("cudaGraphLaunch", "cuGraphLaunch")) for e in host),
        "kernel_launch_calls": sum(e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for e in host),
        "kernels": len(kernels),
        "device_ms": round(sum(_device_us(e) for e in kernels) / 1000, 3),
    }


def _device_us(event: Any) -> float:
    time_range = getattr(event, "time_range", None)
    if time_range is not None:
        return float(time_range.elapsed_us())
    for name in ("device_time", "cuda_time"):
        value = getattr(event, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


@contextlib.contextmanager
def cudagraph_log() -> Iterator[list[str]]:
    """Collect log lines that mention CUDA graphs (inductor's "skipping cudagraphs due to ...") in the block."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "cudagraph" in message.lower():
                lines.append(message[:300])

    handler = Collect(logging.DEBUG)
    logger = logging.getLogger("torch")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def compiled_steps(engine: SpeculativeEngine) -> list[list[Any]]:
    """The engine's compiled static steps, ``[kind, width, bucket]`` each."""
    assert engine.static_round is not None
    return [list(key) for key in sorted(engine.static_round.step.compiled)]


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"].get("cudagraph_skips", 0))


# ----------------------------------------------------------------------------- 1. env
def env_section(check: Check, out: dict[str, Any]) -> None:
    """Versions, the device, the load."""
    out |= {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": str(check.device),
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "compile_backend": check.args.compile_backend,
    }
    if check.cuda:
        props = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": props.name,
            "capability": list(torch.cuda.get_device_capability(0)),
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    try:
        out["bitsandbytes"] = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        out["bitsandbytes"] = "absent"
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__


# ----------------------------------------------------------------------------- 2. ceilings
def weight_shapes(model: Any) -> dict[str, torch.Tensor]:
    """Layer 0's linear weights and the LM head, by name."""
    layer = model.model.layers[0]
    weights = {name: m.weight for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    weights["lm_head"] = model.lm_head.weight
    return weights


def ceilings_section(check: Check, out: dict[str, Any]) -> None:
    """The device copy bandwidth and the one-row ``F.linear`` bandwidth on each weight shape."""
    model = model_of(check)
    repeats = check.args.repeats
    copy_bytes = check.args.copy_mib * 2**20
    source = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=check.device).normal_()
    target = torch.empty_like(source)
    copy_ms = timed_ms(check, lambda: target.copy_(source), repeats)
    copy_gbs = 2 * copy_bytes / (copy_ms / 1000) / 1e9  # read + write
    out["copy"] = {"mib": check.args.copy_mib, "ms": copy_ms, "gb_s": round(copy_gbs, 1)}
    linears: dict[str, Any] = {}
    with torch.inference_mode():
        for name, weight in weight_shapes(model).items():
            x = torch.randn(1, weight.shape[1], dtype=weight.dtype, device=check.device)
            ms = timed_ms(check, lambda w=weight, x=x: F.linear(x, w), repeats)
            nbytes = weight.numel() * weight.element_size()
            linears[name] = {"shape": list(weight.shape), "ms": ms, "gb_s": round(nbytes / (ms / 1000) / 1e9, 1)}
    out["gemv_one_row"] = linears
    out["fused_gemv"] = fused_gemv(check, model, repeats)
    embed = model.get_input_embeddings().weight
    step_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    out["step_weight_gb"] = round(step_bytes / 1e9, 3)
    out["roofline_ms_at_copy_bandwidth"] = round(1000 * step_bytes / (copy_gbs * 1e9), 3)
    out["roofline_tok_s_at_copy_bandwidth"] = round(copy_gbs * 1e9 / step_bytes, 1)


def fused_gemv(check: Check, model: Any, repeats: int) -> dict[str, Any]:
    """Layer 0's q/k/v and gate/up at one row: separate ``F.linear`` calls against one fused call."""
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    groups = {
        "qkv": [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")],
        "gate_up": [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")],
    }
    rows: dict[str, Any] = {}
    with torch.inference_mode():
        for name, modules in groups.items():
            if any(m is None for m in modules):
                continue
            weights = [m.weight for m in modules]
            fused = torch.cat(weights)
            x = torch.randn(1, fused.shape[1], dtype=fused.dtype, device=check.device)
            apart = timed_ms(check, lambda x=x, ws=weights: [F.linear(x, w) for w in ws], repeats)
            one = timed_ms(check, lambda x=x, f=fused: F.linear(x, f), repeats)
            rows[name] = {
                "shape": list(fused.shape),
                "separate_ms": apart,
                "fused_ms": one,
                "fused_over_separate": round(one / apart, 3) if apart else None,
                "keeps_bits": fusion_keeps_bits(weights, [m.bias for m in modules]),
            }
            del fused
    return rows


# ----------------------------------------------------------------------------- 3. graphs
def graphs_section(check: Check, out: dict[str, Any]) -> None:
    """Compile the plain width-1 step, replay it under the profiler, then count graph launches in a real call."""
    engine = engine_of(check)
    step = engine.static_round.step  # type: ignore[union-attr]
    slots = call_slots(check)
    skips = cudagraph_skips()
    if check.cuda:
        with contextlib.suppress(Exception):  # inductor's "skipping cudagraphs due to ..." is a perf hint
            torch._logging.set_logs(perf_hints=True)
    with cudagraph_log() as lines:
        started = time.perf_counter()
        step.prepare(slots, widths=(1,))
        synchronize(check.device)
        out["compile_s_w1"] = round(time.perf_counter() - started, 1)
        out["bucket"] = step.cache.max_length
        once = step_replay(check, step, 1, check.args.prompt_len)
        with torch.inference_mode():
            for _ in range(3):  # cudagraph trees: warm up, record, replay
                once()
        out["replay_w1"] = launches(check, once)
        check.save()
        tokens = 8  # a short call with the forced calls' slots (a longer prompt): the same bucket, no compile
        prompt = prompt_of(check, check.args.prompt_len + check.args.new_tokens - tokens, seed=2)
        engine.generate_ids(prompt, max_new_tokens=tokens)  # warm the call path

        def call() -> None:
            engine.generate_ids(prompt, max_new_tokens=tokens)

        counted = launches(check, call)
    out["call"] = counted | {"rounds": tokens - 1}
    if counted.get("graph_launch_calls") is not None:
        out["call"]["graph_launches_per_round"] = round(counted["graph_launch_calls"] / (tokens - 1), 2)
    if check.cuda:
        with contextlib.suppress(Exception):
            torch._logging.set_logs()  # back to the defaults: the later sections' logs stay readable
    out["cudagraph_skips"] = cudagraph_skips() - skips
    out["compiled_steps"] = compiled_steps(engine)
    out["cudagraph_log"] = lines[:10]
    out["fused_projections"] = engine.runner.fused_projections
    if not check.cuda:
        out["graphs_recorded"] = None
        out["cuda_only"] = NO_CUDA
        return
    out["graphs_recorded"] = bool(out["replay_w1"]["graph_launch_calls"])
    if not out["graphs_recorded"]:
        out["status"] = "failed"
        out["reason"] = f"CUDA graphs did not record the width-1 step: skips {out['cudagraph_skips']}, log {lines[:2]}"


# ----------------------------------------------------------------------------- 4. widths
def widths_section(check: Check, out: dict[str, Any]) -> None:
    """The graphed step of each width: compile time, median by events, graph launches."""
    engine = engine_of(check)
    step = engine.static_round.step  # type: ignore[union-attr]
    slots = call_slots(check)
    rows: dict[str, Any] = {}
    out["widths"] = rows
    for width in WIDTHS:
        started = time.perf_counter()
        step.prepare(slots, widths=(width,))
        synchronize(check.device)
        once = step_replay(check, step, width, check.args.prompt_len)
        with torch.inference_mode():
            ms = timed_ms(check, once, check.args.repeats * 2, warmup=3)
            counted = launches(check, once)
        rows[f"w{width}"] = {
            "compile_s": round(time.perf_counter() - started, 1),
            "ms": ms,
            "graph_launch_calls": counted.get("graph_launch_calls"),
            "kernel_launch_calls": counted.get("kernel_launch_calls"),
        }
        check.save()
    out["timing"] = "CUDA events (device time)" if check.cuda else "wall clock (CPU)"
    base = rows["w1"]["ms"]
    out["relative_to_w1"] = {name: round(row["ms"] / base, 3) for name, row in rows.items()}
    check.kept["w1_ms"] = base
    out["compiled_steps"] = compiled_steps(engine)


# ----------------------------------------------------------------------------- 5. forced acceptance
def forced_section(check: Check, out: dict[str, Any]) -> None:
    """Plain and forced acceptance 0.6/0.8/1.0 through the full loop on the graphed engine, interleaved."""
    engine = engine_of(check)
    drafter: ForcedAcceptanceDrafter = check.kept["drafter"]
    model = model_of(check)
    started = time.perf_counter()
    context_free = make_context_free(model)
    seconds = round(time.perf_counter() - started, 1)
    out["context_free"] = {"min_margin": round(context_free.min_margin, 4), "s": seconds}
    drafter.successor = context_free.successor
    prompt = prompt_of(check)
    new_tokens = check.args.new_tokens
    variants: dict[str, tuple[int, float]] = {"plain": (0, 1.0)} | {f"alpha_{a}": (DRAFTS, a) for a in ALPHAS}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    try:
        for drafts, alpha in ((0, 1.0), (DRAFTS, 1.0)):  # warm: widths 1 and 9 (compiled by ``widths`` already)
            drafter.reset(alpha, 0, drafts)
            engine.generate_ids(prompt, max_new_tokens=new_tokens)
        for repeat in range(check.args.forced_repeats):
            for name, (drafts, alpha) in variants.items():
                drafter.reset(alpha, 100 + repeat, drafts)
                samples[name].append(forced_call(check, engine, drafter, prompt, new_tokens))
                out[name] = summarize_forced(samples[name], drafts, alpha)
            check.save()
    finally:
        context_free.restore()
        drafter.reset(1.0, 0, 0)
    plain = out["plain"]["tok_s"]
    out["vs_plain"] = {name: round(out[name]["tok_s"] / plain, 2) for name in variants if name != "plain"}
    out["vs_plain_rounds_only"] = {
        name: round(out[name]["tok_s_rounds"] / out["plain"]["tok_s_rounds"], 2) for name in variants if name != "plain"
    }
    out["issue40_forced_0.8_at_least_2.0x_plain_graphed"] = out["vs_plain"]["alpha_0.8"] >= 2.0
    out["every_accepted_length_forced"] = all(out[name]["accepted_lengths_forced"] for name in variants)
    out["compiled_steps"] = compiled_steps(engine)  # the same as ``widths``': no call compiled anything
    check.kept["plain_graphed_tok_s"] = plain


def recorded_call(
    check: Check, engine: SpeculativeEngine, prompt: list[int], new_tokens: int
) -> tuple[Any, float, list[RoundRecord]]:
    """One synchronized, timed ``generate_ids`` call with its rounds recorded: (output, seconds, records)."""
    synchronize(check.device)
    with record_rounds(engine) as records:
        started = time.perf_counter()
        output = engine.generate_ids(prompt, max_new_tokens=new_tokens)
        synchronize(check.device)
        seconds = time.perf_counter() - started
    return output, seconds, records


def forced_call(
    check: Check, engine: SpeculativeEngine, drafter: ForcedAcceptanceDrafter, prompt: list[int], new_tokens: int
) -> dict[str, Any]:
    """One timed call with its rounds recorded; whether the verify accepted exactly what was forced."""
    output, seconds, records = recorded_call(check, engine, prompt, new_tokens)
    full = [r for r in records if r.drafted == drafter.num_draft_tokens]  # the tail drafts nothing
    forced = [n for n, d in zip(drafter.forced, drafter.drafted, strict=True) if d == drafter.num_draft_tokens]
    round_s = sum(r.total_ms for r in full) / 1000
    return {
        "seconds": seconds,
        "tokens": len(output.token_ids),
        "full_rounds": len(full),
        "full_round_tokens": sum(r.accepted + 1 for r in full),
        "full_round_s": round_s,
        # plain (k = 0): every round accepts nothing; else each full round accepts exactly its forced length
        "accepted_lengths_forced": (
            all(r.accepted == 0 for r in records)
            if drafter.num_draft_tokens == 0
            else [r.accepted for r in full] == forced
        ),
        "text_follows_successor": follows_successor(output.token_ids, drafter.successor),
        "paths": sorted({r.path for r in records}),
        "phases": phase_medians(full),
    }


def summarize_forced(samples: list[dict[str, Any]], drafts: int, alpha: float) -> dict[str, Any]:
    """The median call of one variant: tok/s over the call, over its full rounds; tokens and ms a round; phases."""
    middle = sorted(samples, key=lambda s: s["seconds"])[len(samples) // 2]
    rounds = max(middle["full_rounds"], 1)
    return {
        "tok_s": round(middle["tokens"] / middle["seconds"], 1),
        "tok_s_rounds": round(middle["full_round_tokens"] / max(middle["full_round_s"], 1e-9), 1),
        "tokens": middle["tokens"],
        "full_rounds": middle["full_rounds"],
        "tokens_per_round": round(middle["full_round_tokens"] / rounds, 2),
        "expected_tokens_per_round": round(expected_tokens_per_round(alpha, drafts), 2),
        "ms_per_round": round(1000 * middle["full_round_s"] / rounds, 3),
        "phases_median_ms": middle["phases"],
        "accepted_lengths_forced": all(s["accepted_lengths_forced"] for s in samples),
        "text_follows_successor": all(s["text_follows_successor"] for s in samples),
        "paths": middle["paths"],
        "calls": len(samples),
    }


# ----------------------------------------------------------------------------- 6. EAGLE-3
def eagle3_section(check: Check, out: dict[str, Any]) -> None:
    """A random EAGLE-3-shaped head's rounds: which loop serves them, and what a round costs."""
    from selfspec.decoding.static_round import static_round_reason
    from selfspec.drafting.eagle.eagle3 import default_feature_layers, new_eagle3_head

    model = model_of(check)
    config = model.config
    count = config.num_hidden_layers
    # the published rule [2, L // 2, L - 3]; a smoke model's few layers: first, middle, last output (L)
    layers = tuple(default_feature_layers(count)) if count >= 6 else (0, count // 2, count)
    vocab = min(check.args.eagle_draft_vocab, config.vocab_size)
    draft_ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(3))[:vocab].sort().values
    head = new_eagle3_head(model, layers, draft_ids.to(check.device))
    head = head.to(check.device, model.dtype)
    out |= {"feature_layers": list(layers), "draft_vocab": vocab}
    engine = SpeculativeEngine(
        model,
        None,
        drafter="eagle",
        eagle_head=head,
        num_draft_tokens=DRAFTS,
        calibration={},
        compile=compile_option(check),
        row_exact=False,
    )
    drafter = engine.drafter
    reason: str | None = "the engine has no static round" if engine.static_round is None else None
    unknown = None
    if reason is None:
        try:  # its signature is another item's (issue 40, item 3): the call's path then decides below
            reason = static_round_reason(drafter, _NoConstraint())  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - recorded
            unknown = f"static_round_reason failed: {type(exc).__name__}: {exc}"[:300]
    out["static_round"] = "accepted" if reason is None else f"refused by static round: {reason}"
    prompt = prompt_of(check)
    new_tokens = check.args.new_tokens
    started = time.perf_counter()
    engine.generate_ids(prompt, max_new_tokens=new_tokens)  # warm: compiles the head's steps where it can
    out["first_call_s"] = round(time.perf_counter() - started, 1)
    check.save()
    output, seconds, records = recorded_call(check, engine, prompt, new_tokens)
    drafting = [r for r in records if r.drafted > 0]
    served = sorted({r.path for r in records})
    out["served_by"] = served
    if unknown is not None:  # no reason to quote: the loop that served the rounds says it
        out["static_round"] = "accepted" if served == ["static"] else f"refused by static round: ({unknown})"
    out |= {"tok_s": round(len(output.token_ids) / seconds, 1), "rounds": len(records)}
    if drafting:
        round_ms = [r.total_ms for r in drafting]
        ms = statistics.median(round_ms)
        expected = expected_tokens_per_round(0.8, DRAFTS)
        out |= {
            "drafting_rounds": len(drafting),
            "drafts_per_round": round(statistics.mean(r.drafted for r in drafting), 2),
            "accepted_per_round": round(statistics.mean(r.accepted for r in drafting), 2),
            "ms_per_round": round(ms, 3),
            "phases_median_ms": phase_medians(drafting),
            "projected_tok_s_at_alpha_0.8": round(1000 * expected / ms, 1),
        }
        plain = check.kept.get("plain_graphed_tok_s")
        if plain:
            out["projected_vs_plain_graphed_at_0.8"] = round(out["projected_tok_s_at_alpha_0.8"] / plain, 2)
    else:
        out["note"] = "no round drafted (the guard or the head's confidence stop drafted nothing)"


@dataclass
class _NoConstraint:
    """The one field :func:`static_round_reason` reads of a generation besides the drafter: no grammar."""

    constraint: None = None


# ----------------------------------------------------------------------------- 7. the eager verify
def eager_verify_section(check: Check, out: dict[str, Any]) -> None:
    """The eager loop's verify per width (row-exact in half precision) and each weight's row invariance."""
    model = model_of(check)
    out["row_invariance"] = row_invariance(model)
    check.save()
    engine = SpeculativeEngine(model, None, drafter="none", calibration={}, compile=False, row_exact=False)
    runner = engine.runner
    runner.row_exact = True  # the eager row-by-row verify this section prices (not the row-invariant kernels)
    context = check.args.prompt_len
    prompt = prompt_of(check)
    cache = runner.new_cache(context + max(WIDTHS) + 2)
    device = check.device
    rows: dict[str, float] = {}
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(context, device=device), cache)
        for width in WIDTHS:
            tokens = ids[:, -width:]
            positions = torch.arange(context, context + width, device=device)

            def once(tokens: torch.Tensor = tokens, positions: torch.Tensor = positions) -> None:
                runner.logits(runner.run_layers(runner.embed(tokens), 0, runner.num_layers, positions, cache))
                cache.crop_to(context)

            rows[f"w{width}"] = timed_ms(check, once, check.args.repeats)
            check.save()
    out["verify_ms"] = rows
    out["relative_to_w1"] = {name: round(ms / rows["w1"], 3) for name, ms in rows.items()}
    if check.kept.get("w1_ms"):
        out["eager_w1_over_graphed_w1"] = round(rows["w1"] / check.kept["w1_ms"], 2)


def row_invariance(model: Any, widths: tuple[int, ...] = (2, 3, 5, 9, 17), blocks: int = 2) -> dict[str, Any]:
    """Per weight of layer 0 and the LM head: the widths whose rows differ from the rows computed alone."""
    from selfspec.modeling.attention import linear_is_row_invariant

    generator = torch.Generator(device=model.device).manual_seed(0)
    result: dict[str, Any] = {}
    with torch.no_grad():
        for name, weight in weight_shapes(model).items():
            differing = []
            for width in widths:
                x = torch.randn(blocks, width, weight.shape[1], generator=generator, device=weight.device)
                x = x.to(weight.dtype)
                alone = torch.stack([torch.cat([F.linear(row[None], weight) for row in block]) for block in x])
                if not torch.equal(F.linear(x, weight), alone):
                    differing.append(width)
            result[name] = {
                "shape": list(weight.shape),
                "widths_differing": differing,
                "probe_says_invariant": linear_is_row_invariant(weight),
            }
    return result


# ----------------------------------------------------------------------------- 8. transformers' static cache + compile
class OracleDrafter(Drafter):
    """Drafts the next ``k`` tokens of a reference text (the plain loop's): the real oracle, not forced.

    Where the speculative text follows the reference, every draft is accepted (``k + 1`` tokens a
    round); from the first token where it leaves it, the drafts stop matching. ``k = 0``: plain.
    """

    name = "oracle"
    chain_only = True

    def __init__(self, reference: list[int], num_draft_tokens: int) -> None:
        self.reference, self.num_draft_tokens = reference, num_draft_tokens

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        start = len(state.token_ids)
        return Draft(tokens=self.reference[start : start + min(self.num_draft_tokens, max_tokens)])


def row_invariant_section(check: Check, out: dict[str, Any]) -> None:
    """The row-invariant Triton kernels on the device (issue 41, item 4).

    - ``linear_widths_differing``: per weight of layer 0 and the LM head, the widths 1..9 whose rows
      differ from the same rows computed alone through the kernel (should be empty everywhere);
      ``attention_widths_differing`` likewise for ``chain_attention`` after ``prompt_len`` keys.
    - ``ms``: each kernel against cuBLAS (``F.linear``) and SDPA at widths 1 and 9, CUDA events;
      ``step_linears_ms``: every layer's weights plus the LM head at that width (kernel vs cuBLAS).
    - ``step_ms``: the compiled (graphed) width-1 and width-9 static step with ``row_exact=True``
      against the cuBLAS engine's (``widths``), and ``graph_launches`` of the kernel step.
    - ``text``: per prompt, the plain text with ``row_exact=True`` (the compiled static round), then
      the oracle drafting that text 8 tokens a round: the first divergence (``null``: none) and the
      tokens per round (``9`` when every draft is accepted), and ``generate``'s first divergence.
    """
    if not check.cuda:
        raise Skip(
            "no CUDA: the kernels' bits on tensor cores and their speed exist only on a GPU (their logic "
            "runs under Triton's interpreter in tests/exact/test_modeling_kernels.py)"
        )
    from selfspec.modeling.kernels import chain_attention, linear

    model, device = model_of(check), check.device
    generator = torch.Generator(device=device).manual_seed(0)
    widths = range(1, DRAFTS + 2)
    differing: dict[str, list[int]] = {}
    timings: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, weight in weight_shapes(model).items():
            x = torch.randn(max(widths), weight.shape[1], device=device, dtype=weight.dtype, generator=generator)
            alone = torch.cat([linear(x[i : i + 1], weight) for i in range(max(widths))])
            differing[name] = [w for w in widths if not torch.equal(linear(x[:w], weight), alone[:w])]
            timings[name] = {}
            for w in (1, max(widths)):
                rows = x[:w]
                timings[name][f"kernel_w{w}"] = timed_ms(
                    check, lambda r=rows, m=weight: linear(r, m), check.args.repeats
                )
                timings[name][f"cublas_w{w}"] = timed_ms(
                    check, lambda r=rows, m=weight: F.linear(r, m), check.args.repeats
                )
        out["linear_widths_differing"] = differing
        out["ms"] = timings
        layers = model.config.num_hidden_layers
        out["step_linears_ms"] = {
            f"{kind}_w{w}": round(
                layers * sum(t[f"{kind}_w{w}"] for n, t in timings.items() if n != "lm_head")
                + timings["lm_head"][f"{kind}_w{w}"],
                3,
            )
            for kind in ("kernel", "cublas")
            for w in (1, max(widths))
        }
        check.save()
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        past = check.args.prompt_len
        shape = (1, config.num_key_value_heads, past + max(widths), head_dim)
        key = torch.randn(shape, device=device, dtype=model.dtype, generator=generator)
        value = torch.randn(shape, device=device, dtype=model.dtype, generator=generator)
        query = torch.randn(
            1, config.num_attention_heads, max(widths), head_dim, device=device, dtype=model.dtype, generator=generator
        )
        alone = torch.cat(
            [chain_attention(query[:, :, i : i + 1], key, value, past + i) for i in range(max(widths))], dim=2
        )
        out["attention_widths_differing"] = [
            w for w in widths if not torch.equal(chain_attention(query[:, :, :w], key, value, past), alone[:, :, :w])
        ]
    check.save()
    row_invariant_text(check, out)


def row_invariant_text(check: Check, out: dict[str, Any]) -> None:
    """``row_invariant``'s compiled steps and texts: the kernels engine (``row_exact=True``) and its oracle."""
    model = model_of(check)
    oracle = OracleDrafter([], 0)
    engine = SpeculativeEngine(
        model,
        None,
        drafter=oracle,
        num_draft_tokens=DRAFTS,
        calibration={},
        compile=compile_option(check),
        row_exact=True,
    )
    out["exactness"] = engine.exactness
    assert engine.static_round is not None and engine.runner.row_kernels
    step = engine.static_round.step
    step.reserve(call_slots(check))
    context = check.args.prompt_len
    steps: dict[str, Any] = {}
    with torch.inference_mode():
        for width in (1, DRAFTS + 1):
            replay = step_replay(check, step, width, context)
            replay()  # compiles
            steps[f"kernels_w{width}"] = timed_ms(check, replay, check.args.repeats)
            baseline = check.kept.get("engine")
            if baseline is not None and baseline.static_round.step.cache is not None:
                steps[f"cublas_w{width}"] = timed_ms(
                    check, step_replay(check, baseline.static_round.step, width, context), check.args.repeats
                )
            check.save()
        steps["graph_launches_w1"] = launches(check, step_replay(check, step, 1, context)).get("graph_launch_calls")
    if "cublas_w1" in steps:
        steps["kernels_over_cublas_w1"] = round(steps["kernels_w1"] / steps["cublas_w1"], 3)
    out["step_ms"] = steps
    check.save()
    texts = []
    for seed in (1, 2, 3):
        prompt = prompt_of(check, seed=seed)
        oracle.num_draft_tokens = 0
        plain = engine.generate_ids(prompt, max_new_tokens=check.args.new_tokens).token_ids
        oracle.reference, oracle.num_draft_tokens = prompt + plain, DRAFTS
        speculative = engine.generate_ids(prompt, max_new_tokens=check.args.new_tokens)
        rounds = max(speculative.stats.target_forwards - 1, 1)
        texts.append(
            {
                "new_tokens": len(plain),
                "speculative_vs_plain": first_divergence(speculative.token_ids, plain),
                "tokens_per_round": round(len(speculative.token_ids) / rounds, 2),
            }
        )
        out["text"] = texts
        check.save()
    oracle.num_draft_tokens = 0
    prompt = prompt_of(check, seed=1)
    plain = engine.generate_ids(prompt, max_new_tokens=64).token_ids
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=check.device)
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
    out["plain_vs_generate_64"] = first_divergence(plain, reference[0, ids.shape[1] :].tolist())


def first_divergence(left: list[int], right: list[int]) -> int | None:
    """The first index where two texts differ (one ending first counts), or ``None`` when identical."""
    for index, (a, b) in enumerate(zip(left, right, strict=False)):
        if a != b:
            return index
    return None if len(left) == len(right) else min(len(left), len(right))


def hf_static_section(check: Check, out: dict[str, Any]) -> None:
    """transformers' ``generate`` with a static cache, its decode step compiled by transformers itself."""
    from transformers import CompileConfig

    model = model_of(check)
    ids = torch.tensor([prompt_of(check)], device=check.device)
    config = CompileConfig(fullgraph=True, mode="reduce-overhead", backend=check.args.compile_backend)
    if not check.cuda:
        config._compile_all_devices = True  # type: ignore[assignment]  # transformers compiles on CPU if told
    new_tokens = check.args.hf_new_tokens
    options: dict[str, Any] = {
        "do_sample": False,
        "pad_token_id": 0,
        "cache_implementation": "static",
        "compile_config": config,
    }
    started = time.perf_counter()
    try:
        model.generate(ids, max_new_tokens=new_tokens, **options)
    except Exception as exc:  # noqa: BLE001 - a graph break under fullgraph=True: transformers' default then
        out["fullgraph_error"] = f"{type(exc).__name__}: {exc}"[:400]
        options["compile_config"] = CompileConfig(backend=check.args.compile_backend)
        model.generate(ids, max_new_tokens=new_tokens, **options)
    synchronize(check.device)
    out["first_call_s"] = round(time.perf_counter() - started, 1)
    out["compiled"] = hasattr(model, "_compiled_call")
    check.save()
    model.generate(ids, max_new_tokens=new_tokens, **options)  # the graphs' recording
    synchronize(check.device)
    started = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=new_tokens, **options)[0, ids.shape[1] :].tolist()
    synchronize(check.device)
    seconds = time.perf_counter() - started
    out |= {"tok_s": round(len(tokens) / seconds, 1), "ms_per_token": round(1000 * seconds / len(tokens), 3)}
    out["tokens"] = len(tokens)
    plain = check.kept.get("plain_graphed_tok_s")
    if plain:
        out["selfspec_plain_graphed_vs_this"] = round(plain / out["tok_s"], 2)


# ----------------------------------------------------------------------------- 9. long context
def long_context_section(check: Check, out: dict[str, Any]) -> None:
    """``static_prefill`` at the long prompts against transformers' prefill, then the graphed decode at 4k."""
    from selfspec.modeling.static_step import StaticStep, static_prefill
    from selfspec.modeling.transfer import device_ids

    model = model_of(check)
    engine = engine_of(check)
    runner = engine.runner
    step = StaticStep(runner, engine.static_round.step.backend)  # type: ignore[union-attr]  # its own cache
    longest = max(check.args.long_prompts)
    prefill: dict[str, Any] = {}
    out["prefill"] = prefill
    with torch.inference_mode():
        for length in check.args.long_prompts:
            prompt = prompt_of(check, length, seed=length)
            cache = step.reserve(length)
            ids = device_ids([prompt], check.device)

            def selfspec_prefill(cache: Any = cache, ids: torch.Tensor = ids) -> None:
                static_prefill(runner, cache, ids)

            def hf_prefill(ids: torch.Tensor = ids) -> None:
                model(ids, use_cache=True, logits_to_keep=1)

            prefill[str(length)] = {
                "static_prefill_ms": timed_ms(check, selfspec_prefill, 3, warmup=1),
                "transformers_prefill_ms": timed_ms(check, hf_prefill, 3, warmup=1),
            }
            check.save()
    del cache
    context = check.args.decode_context
    started = time.perf_counter()
    with torch.inference_mode():
        step.cache.length.fill_(0)  # type: ignore[union-attr]  # the prefill's text is not the decode's
    step.prepare(max(longest, context + DRAFTS + 2), widths=(1,))
    out["decode_compile_s"] = round(time.perf_counter() - started, 1)
    out["decode_bucket"] = step.cache.max_length  # type: ignore[union-attr]
    with torch.inference_mode():
        out["decode_w1_ms_at_context"] = timed_ms(check, step_replay(check, step, 1, context), check.args.repeats * 2)
    out["decode_context"] = context
    if check.kept.get("w1_ms"):
        out["vs_w1_at_short_context"] = round(out["decode_w1_ms_at_context"] / check.kept["w1_ms"], 3)


# ----------------------------------------------------------------------------- 10. 4-bit
def bnb4_section(check: Check, out: dict[str, Any]) -> None:
    """NF4 linears: whether the static round takes them, the eager plain step and the verify curve."""
    if not check.cuda:
        raise Skip("no CUDA: bitsandbytes' 4-bit kernels run on CUDA here")
    try:
        import bitsandbytes
    except ImportError as exc:
        raise Skip(f"bitsandbytes absent ({exc}); carry a wheel beside the tree to run it") from exc
    from selfspec.modeling.runner import ModelRunner
    from selfspec.modeling.static_step import exact_widths, static_round_supported

    model = model_of(check)
    for name in ("engine", "drafter"):  # the graphed engine's steps read the weights about to be replaced
        check.kept.pop(name, None)
    quantize_linears(model, model.dtype, check.device)
    torch.cuda.empty_cache()
    runner = ModelRunner(model)
    out |= {"bitsandbytes": bitsandbytes.__version__, "fast_path": runner.fast_layers is not None}
    out["static_round"] = static_round_supported(runner) or "accepted"
    if runner.fast_layers is not None:  # the widths whose verify rows keep a one-row call's bits
        out["exact_widths"] = list(exact_widths(runner))
    engine = SpeculativeEngine(model, None, drafter="none", calibration={}, compile=False)
    prompt = prompt_of(check)
    engine.generate_ids(prompt, max_new_tokens=4)
    synchronize(check.device)
    started = time.perf_counter()
    output = engine.generate_ids(prompt, max_new_tokens=check.args.hf_new_tokens)
    synchronize(check.device)
    out["plain_eager_tok_s"] = round(len(output.token_ids) / (time.perf_counter() - started), 1)
    context = len(prompt)
    cache = runner.new_cache(context + 17)
    ids = torch.tensor([prompt], device=check.device)
    times: dict[str, float] = {}
    with torch.inference_mode():
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(context, device=check.device), cache)
        for width in (1, 2, 4, 8):
            positions = torch.arange(context, context + width, device=check.device)

            def once(width: int = width, positions: torch.Tensor = positions) -> None:
                runner.logits(runner.run_layers(runner.embed(ids[:, :width]), 0, runner.num_layers, positions, cache))
                cache.crop_to(context)

            times[f"w{width}"] = timed_ms(check, once, check.args.repeats)
    out["verify_ms"] = times
    out["relative_to_w1"] = {k: round(v / times["w1"], 3) for k, v in times.items()}


def quantize_linears(model: Any, compute: torch.dtype, device: torch.device) -> None:
    """Swap every decoder linear layer for bitsandbytes NF4 (the LM head stays)."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if not isinstance(linear, torch.nn.Linear):
                    continue
                weight = linear.weight.data.to("cpu", compute)
                new = bnb.nn.Linear4bit(
                    linear.in_features, linear.out_features, bias=False, compute_dtype=compute, quant_type="nf4"
                )
                new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
                setattr(parent, name, new.to(device))


BODIES: dict[str, Callable[[Check, dict[str, Any]], None]] = {
    "env": env_section,
    "ceilings": ceilings_section,
    "graphs": graphs_section,
    "widths": widths_section,
    "forced": forced_section,
    "eagle3": eagle3_section,
    "eager_verify": eager_verify_section,
    "row_invariant": row_invariant_section,
    "hf_static": hf_static_section,
    "long_context": long_context_section,
    "bnb4": bnb4_section,
}


# ----------------------------------------------------------------------------- the summary
def headline(results: dict[str, Any]) -> list[str]:
    """The decisive figures, one line each (absent where their section did not run)."""
    sections = results.get("sections", {})

    def get(*path: str) -> Any:
        value: Any = sections
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    facts = [
        ("copy bandwidth GB/s", get("ceilings", "copy", "gb_s")),
        ("roofline ms/step at copy bandwidth", get("ceilings", "roofline_ms_at_copy_bandwidth")),
        ("CUDA graphs recorded (width 1)", get("graphs", "graphs_recorded")),
        ("graph launches per round in a call", get("graphs", "call", "graph_launches_per_round")),
        ("graphed step ms w1 / w9", f"{get('widths', 'widths', 'w1', 'ms')} / {get('widths', 'widths', 'w9', 'ms')}"),
        ("plain graphed loop tok/s", get("forced", "plain", "tok_s")),
        ("forced 0.8 / plain graphed", get("forced", "vs_plain", "alpha_0.8")),
        ("every accepted length forced", get("forced", "every_accepted_length_forced")),
        ("EAGLE-3 round", get("eagle3", "static_round")),
        (
            "EAGLE-3 ms/round, projected tok/s at 0.8",
            f"{get('eagle3', 'ms_per_round')}, {get('eagle3', 'projected_tok_s_at_alpha_0.8')}",
        ),
        ("eager verify w9 / w1", get("eager_verify", "relative_to_w1", "w9")),
        ("transformers static + compile tok/s", get("hf_static", "tok_s")),
        ("decode w1 ms at long context / short", get("long_context", "vs_w1_at_short_context")),
    ]
    return [f"- {name}: {value}" for name, value in facts]


def flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, scalar)`` pairs of a nested dict (lists kept whole)."""
    if isinstance(value, dict):
        return [pair for key, item in value.items() for pair in flatten(item, f"{prefix}{key}.")]
    return [(prefix[:-1], value)]


def markdown(results: dict[str, Any]) -> str:
    """The run as markdown: the headline, then every section's status, reason and figures."""
    env = results.get("sections", {}).get("env", {})
    lines = [
        "# GPU check (`benchmarks/gpu_check.sh`, issue 40)",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, "
        f"device `{env.get('device')}` {env.get('gpu', '')}; model {results.get('model')}; "
        f"run {results.get('elapsed_s')} s of a {results.get('args', {}).get('deadline')} s deadline.",
        "",
        "## Headline",
        "",
        *headline(results),
        "",
        "Random weights in the Llama-3-8B shape: text divergence there is a worst case; compare timings",
        "only within one run (one card). The forced rows run the model made context-free",
        "(benchmarks/forced_acceptance.py).",
        "",
    ]
    for name, section in results.get("sections", {}).items():
        lines += [f"## {name}: {section.get('status')}", ""]
        if section.get("reason"):
            lines += [f"Reason: {section['reason']}", ""]
        pairs = [(k, v) for k, v in flatten(section) if k not in ("status", "reason", "trace")]
        lines += [f"- `{key}`: {json.dumps(value, default=str)[:200]}" for key, value in pairs]
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, compile backend 'eager', small sizes")
    parser.add_argument("--device", default=None, help="default: cuda when available (cpu with --smoke)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: llama3-8b (tiny with --smoke)")
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--deadline", type=float, default=None, help="seconds (default 480; 120 with --smoke)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every section's budget")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; eager with --smoke)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (240 with --smoke)")
    parser.add_argument("--new-tokens", type=int, default=None, help="forced/EAGLE calls (128; 40 with --smoke)")
    parser.add_argument("--hf-new-tokens", type=int, default=None, help="transformers' baseline (32; 8 with --smoke)")
    parser.add_argument("--long-prompts", type=int, nargs="*", default=None, help="default 4096 8192 (256 512)")
    parser.add_argument("--decode-context", type=int, default=None, help="default 4096 (256 with --smoke)")
    parser.add_argument("--copy-mib", type=int, default=None, help="the copy's size (2048; 16 with --smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (10; 2 with --smoke)")
    parser.add_argument("--forced-repeats", type=int, default=None, help="interleaved passes (3; 1 with --smoke)")
    parser.add_argument("--eagle-draft-vocab", type=int, default=EAGLE_DRAFT_VOCAB)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "device": "cpu" if smoke else ("cuda" if torch.cuda.is_available() else "cpu"),
        "shape": "tiny" if smoke else "llama3-8b",
        "deadline": 120.0 if smoke else 480.0,
        "compile_backend": "eager" if smoke else "inductor",
        "prompt_len": 240 if smoke else 128,  # smoke: a bucket of 512, past the smallest
        "new_tokens": 40 if smoke else 128,
        "hf_new_tokens": 8 if smoke else 32,
        "long_prompts": [256, 512] if smoke else [4096, 8192],
        "decode_context": 256 if smoke else 4096,
        "copy_mib": 16 if smoke else 2048,
        "repeats": 2 if smoke else 10,
        "forced_repeats": 1 if smoke else 3,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("GPU_CHECK_THREADS", "1" if args.smoke else torch.get_num_threads())))
    check = Check(args)
    check.results["args"] = {k: v for k, v in vars(args).items() if k != "out"}

    def terminate(_signum: int, _frame: Any) -> None:
        check.terminated = True
        raise SectionTimeout("the outer timeout (SIGTERM)")

    signal.signal(signal.SIGTERM, terminate)
    # transformers imports a model class on first use: an alarm that rang inside that import left
    # the lazy module unable to import it again, so every later section failed at once (CI)
    _ = transformers.LlamaConfig, transformers.LlamaForCausalLM
    for name in SECTIONS:
        if name in args.sections:
            try:
                check.run_section(name, BODIES[name])
            except SectionTimeout:  # SIGTERM between sections
                check.terminated = True
    check.results["finished"] = not check.terminated
    check.kept.clear()
    check.save()
    log(check, f"wrote {Path(args.out) / 'gpu_check.json'} and gpu_check.md")
    return 124 if check.terminated else 0


if __name__ == "__main__":
    sys.exit(main())
