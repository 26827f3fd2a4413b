"""A GPU check that learns the most in one call (issue 26, item 7).

Prepared for one device call of at most 10 minutes on a lent GPU (one H200, torch 2.11,
transformers 5.17, no bitsandbytes, nothing installable, no network): ``bash
benchmarks/gpu_check.sh --out "$OUT"``. Sections, most valuable first; each is guarded (an error is
recorded and the next one runs), no new measurement starts once the global deadline
(``--deadline``, 270 s) has passed, and the JSON and the markdown are rewritten after every
measurement, so a timeout still leaves what was measured:

1. ``env``: torch, CUDA, transformers, the GPU; the decoder layer's cache keyword (and the one
   selfspec reads from it); the SDPA backends enabled; bitsandbytes' version (never imported).
2. ``demo``: exactness on the bundled demo model in fp16 and bf16: transformers' greedy
   ``generate`` against selfspec's eager loop: plain, prompt lookup (8 drafts a round) and the
   early exit; per prompt the first position where the text differs (``None``: identical),
   tokens/s, tokens per round, host syncs per round (CUDA: ``torch.cuda.set_sync_debug_mode("warn")``,
   one warning per sync; CPU: the dispatch-mode counter of
   ``tests/exact/test_decoding_sync_budget.py``, eager runs only: a dispatch mode cannot wrap a
   compiled call).
3. ``llama8b``: a Llama-3-8B-shaped model with random weights (bf16 on CUDA, SDPA, no EOS), an
   oracle drafter (:class:`OracleDrafter`: the known greedy continuation, each token kept with
   probability ``alpha``, the first miss ends the run) at forced acceptance 0.6 / 0.8 / 1.0 with 8
   drafts a round (first, per linear weight of layer 0 and the LM head, the block widths whose
   rows differ from the rows computed alone, and the engine's probe verdict): tokens/s for plain
   eager (``drafter="none", compile=False``), speculative eager,
   transformers' eager ``generate``, then plain graphed (``compile=True``) and speculative graphed,
   with their compile times apart; kernels and device time per forward (``torch.profiler``) of
   the eager static step of widths 1 and 9 (the compiled ones in ``profile_compiled``).
4. ``sdpa``: the SDPA backends (flash, mem-efficient, cuDNN, math) with GQA at 4k context: an
   ``is_causal`` prefill and a 9-query ``causal_lower_right`` chain verify, against the boolean
   mask and the repeated-K/V forms: time, peak memory, largest deviation.
5. ``demo_compiled``: the same exactness check through the static round (``compile=True``, CUDA
   graphs on CUDA), plain and prompt lookup on one engine (:class:`SwitchedLookup`), bf16 then
   fp16; after the 8B shape because every width prompt lookup reaches is one more compile.
6. ``hf_compiled``: transformers' ``generate`` with a static cache, the decode step compiled by
   transformers itself (``cache_implementation="static"`` with
   ``compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")``: in transformers 5.x
   ``generate`` compiles the decode step when the cache is static; with a graph break, its default
   ``CompileConfig()``). Last because its compile time is the least predictable.
7. ``profile_compiled``: the graphed 8B steps (widths 1 and 9) under ``torch.profiler``: kernels,
   device time and graph launches per step; last, since profiling CUDA graph replays is the one
   call here that has been known to crash a process.
8. ``quantized`` (only with ``--quantized``; imports bitsandbytes): the verify-cost curve of the
   same shape in NF4 through selfspec's module path.

Why the speculative runs stop short: a round near the end of a call drafts fewer than 8 tokens,
i.e. a narrower width whose step would have to be compiled too. The oracle ends the call (it
raises :class:`EnoughTokens`) at the first round whose budget is under 8, so the graphed
speculative engine needs width 9 only and the plain one width 1 only: two compiles of the 8B
shape. Its tokens/s counts the tokens emitted up to that round over the time since the call
started (prefill included, as for the plain runs).

Results: ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` (default ``benchmarks/results``).

    PYTHONPATH=src python benchmarks/gpu_check.py --out "$OUT"                       # the GPU
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --shape tiny --quick  # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import inspect
import json
import os
import random
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from selfspec import SpeculativeEngine
from selfspec.drafting.base import DecodeState, Draft, Drafter

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
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
    },
}
SECTIONS = ("env", "demo", "llama8b", "sdpa", "demo_compiled", "hf_compiled", "profile_compiled", "quantized")
DEMO_PROMPTS = (
    "It is a truth universally acknowledged, that a single man",
    "Mr. Darcy said to Elizabeth that",
    "The weather at Netherfield was",
)
ALPHAS = (0.6, 0.8, 1.0)
DRAFTS = 8  # draft tokens a round: the static round verifies them at width 9
#: seconds a section (or a compile inside one) needs left before the deadline to start.
NEEDS = {
    "env": 0.0,
    "demo": 20.0,
    "llama8b": 30.0,
    "sdpa": 5.0,
    "hf_compiled": 60.0,
    "demo_compiled": 40.0,
    "profile_compiled": 0.0,  # about a second: it runs past the deadline too
    "quantized": 30.0,
}
COMPILE_NEEDS = 40.0


# ----------------------------------------------------------------------------- the run's bookkeeping
@dataclass
class Check:
    """One run: its arguments, results (rewritten to disk at every :meth:`save`) and deadline."""

    args: argparse.Namespace
    results: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)  # objects shared by sections (never saved)
    started: float = field(default_factory=time.perf_counter)

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def compiles(self) -> bool:
        """Whether compiled variants run (always on CUDA; on CPU only with ``--cpu-compile``)."""
        return self.cuda or self.args.cpu_compile

    @property
    def compile_option(self) -> bool | str:
        """The engines' ``compile=`` for compiled variants (``True``: inductor, or a backend's name)."""
        return True if self.args.compile_backend == "inductor" else self.args.compile_backend

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.args.deadline - (time.perf_counter() - self.started)

    def save(self) -> None:
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        (out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        (out / "gpu_check.md").write_text(markdown(self.results))

    def run_section(self, name: str, body: Callable[[Check, dict[str, Any]], None]) -> None:
        """Run one section into ``results[name]`` (filled in place, so partial results are saved)."""
        out: dict[str, Any] = {}
        self.results[name] = out
        if NEEDS[name] > 0 and self.left() < NEEDS[name]:  # env and profile_compiled always run
            out["skipped"] = f"deadline: {self.left():.0f} s left, the section needs {NEEDS[name]:.0f}"
        else:
            started = time.perf_counter()
            try:
                body(self, out)
            except Exception as exc:  # noqa: BLE001 - recorded; the next section runs
                out["error"] = f"{type(exc).__name__}: {exc}"[:600]
                out["trace"] = traceback.format_exc()[-2500:]
            out["seconds"] = round(time.perf_counter() - started, 1)
        log(self, f"{name}: {json.dumps(out, default=str)[:400]}")
        self.save()


def log(check: Check, message: str) -> None:
    print(f"[{time.perf_counter() - check.started:6.1f}s] {message}", flush=True)


def guarded(check: Check, out: dict[str, Any], key: str, body: Callable[[], Any], needs: float = 0.0) -> Any:
    """``out[key] = body()`` unless the deadline is near; an error is recorded under ``key``; saved after."""
    if check.left() < needs:
        out[key] = {"skipped": f"deadline: {check.left():.0f} s left, needs {needs:.0f}"}
        check.save()
        return None
    try:
        value = body()
    except Exception as exc:  # noqa: BLE001 - recorded; the next measurement runs
        failure = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-1500:]}
        partial = out.get(key)  # what the body recorded before it failed stays
        value = (partial | failure) if isinstance(partial, dict) else failure
    out[key] = value
    log(check, f"  {key}: {json.dumps(value, default=str)[:300]}")
    check.save()
    return value


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where ``tokens`` differs from ``reference`` (``None``: identical)."""
    for index, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# ----------------------------------------------------------------------------- host syncs
READS = (
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten._local_scalar_dense.default,
)


@dataclass
class SyncCount:
    """Host syncs seen while a :func:`count_syncs` block ran."""

    reads: int = 0


@contextlib.contextmanager
def count_syncs(device: torch.device) -> Iterator[SyncCount]:
    """Count host-device syncs in the block.

    CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` warns once per synchronizing call. CPU: a
    ``TorchDispatchMode`` counts ``aten.item`` / ``is_nonzero`` / ``_local_scalar_dense``, with
    ``Tensor.tolist`` and ``torch.tensor(..., device=)`` patched (never around a compiled call).
    """
    counted = SyncCount()
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counted
            finally:
                torch.cuda.set_sync_debug_mode(0)
        counted.reads = sum("synchroniz" in str(w.message).lower() for w in caught)
        return
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            counted.reads += func in READS
            return func(*args, **(kwargs or {}))

    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def counted_tolist(self: torch.Tensor) -> Any:
        counted.reads += 1
        return tolist(self)

    def counted_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        counted.reads += "device" in kwargs  # a blocking copy to the device
        return tensor(*args, **kwargs)

    torch.Tensor.tolist, torch.tensor = counted_tolist, counted_tensor  # type: ignore[method-assign,assignment]
    try:
        with Reads():
            yield counted
    finally:
        torch.Tensor.tolist, torch.tensor = tolist, tensor  # type: ignore[method-assign]


# ----------------------------------------------------------------------------- 1. env
def env_section(check: Check, out: dict[str, Any]) -> None:
    """Versions, the GPU, the decoder layer's cache keyword and the SDPA backends enabled."""
    from transformers.models.llama import modeling_llama

    parameters = inspect.signature(modeling_llama.LlamaDecoderLayer.forward).parameters
    out |= {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": str(check.device),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu_count": os.cpu_count(),
        "decoder_layer_cache_keyword": [k for k in ("cache", "past_key_values") if k in parameters],
        "sdpa_enabled": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        },
    }
    with contextlib.suppress(ImportError):
        from selfspec.modeling.compat import cache_keyword

        tiny = transformers.LlamaConfig(
            hidden_size=8, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=1
        )
        out["selfspec_cache_keyword"] = cache_keyword(modeling_llama.LlamaDecoderLayer(tiny, 0))
    if check.cuda:
        props = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": props.name,
            "capability": list(torch.cuda.get_device_capability(0)),
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
        }
    try:  # the installed version, without importing it (the check never needs it by default)
        out["bitsandbytes"] = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        out["bitsandbytes"] = "absent"
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__


# ----------------------------------------------------------------------------- 2. demo exactness
@dataclass(frozen=True)
class Variant:
    """One selfspec configuration of the demo section."""

    name: str
    options: dict[str, Any]
    compiled: bool = False
    lookup: bool = False  # the compiled engine's switchable drafter: prompt lookup on, or off (plain)


class SwitchedLookup(Drafter):
    """Prompt lookup that can be switched off (then every round is a plain step).

    The compiled demo runs plain decoding and prompt lookup on one engine, so the width-1 step
    is compiled once for both (a compile costs seconds on a GPU; the check has minutes).
    """

    name = "switched_lookup"
    chain_only = True

    def __init__(self) -> None:
        from selfspec.drafting.prompt_lookup import PromptLookupDrafter

        self.lookup = PromptLookupDrafter()
        self.enabled = True

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Prompt lookup's draft when enabled, else nothing."""
        return self.lookup.propose(state, max_tokens) if self.enabled else Draft()


EAGER_VARIANTS = (
    Variant("plain_eager", {"drafter": "none"}),
    Variant("lookup_eager", {"drafter": "prompt_lookup", "num_draft_tokens": DRAFTS}),
    Variant("early_exit_eager", {"drafter": "early_exit", "exit_layer": 4, "num_draft_tokens": 4}),
)
COMPILED_VARIANTS = (
    Variant("plain_compiled", {"num_draft_tokens": DRAFTS}, compiled=True, lookup=False),
    Variant("lookup_compiled", {"num_draft_tokens": DRAFTS}, compiled=True, lookup=True),
)


def demo_section(check: Check, out: dict[str, Any]) -> None:
    """The demo model per dtype: HF greedy ``generate`` against the eager variants (seconds each)."""
    for dtype in check.args.demo_dtypes:
        out[dtype] = {}
        demo_dtype(check, dtype, out[dtype], EAGER_VARIANTS)
        if check.cuda:
            torch.cuda.empty_cache()


def demo_compiled_section(check: Check, out: dict[str, Any]) -> None:
    """The compiled demo variants per dtype (a fresh ``generate`` reference each), after the 8B shape.

    Each width prompt lookup reaches is one compile of the demo model: tens of seconds on a cold
    GPU, so these run once the 8B comparison (the issue's acceptance test) has its numbers.
    """
    if not check.compiles:
        out["skipped"] = "compiled variants run on CUDA, or on CPU with --cpu-compile"
        return
    for dtype in check.args.demo_compiled_dtypes:
        out[dtype] = {}
        demo_dtype(check, dtype, out[dtype], COMPILED_VARIANTS)


def demo_dtype(check: Check, dtype: str, row: dict[str, Any], variants: tuple[Variant, ...]) -> None:
    """One dtype of the demo into ``row``: the ``generate`` reference, then each variant."""
    from selfspec.modeling.loading import load_model_and_tokenizer

    new_tokens = check.args.demo_new_tokens
    model, tokenizer, _ = load_model_and_tokenizer("selfspec-demo", device=check.device, dtype=dtype)
    prompts = [list(tokenizer(text)["input_ids"]) for text in DEMO_PROMPTS]
    references = guarded(check, row, "hf_generate", lambda: hf_greedy(check, model, prompts, new_tokens))
    if not isinstance(references, dict) or "tokens" not in references:
        return
    reference_tokens = references.pop("tokens")
    compiled_engine: dict[str, SpeculativeEngine] = {}  # one engine for every compiled variant
    for variant in variants:
        if variant.compiled and not check.compiles:
            row[variant.name] = {"skipped": "compiled variants run on CUDA, or on CPU with --cpu-compile"}
            continue
        guarded(
            check,
            row,
            variant.name,
            functools.partial(
                demo_variant, check, model, tokenizer, variant, prompts, reference_tokens, compiled_engine
            ),
            needs=COMPILE_NEEDS if variant.compiled and check.cuda else 0.0,
        )


def hf_greedy(check: Check, model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """transformers' greedy ``generate`` per prompt (warmed up), with its tokens/s."""
    pad = model.generation_config.pad_token_id or 0

    def generate(ids: list[int]) -> list[int]:
        tensor = torch.tensor([ids], device=model.device)
        output = model.generate(tensor, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return list(output[0, len(ids) :].tolist())

    generate(prompts[0])
    synchronize(check.device)
    started = time.perf_counter()
    tokens = [generate(ids) for ids in prompts]
    synchronize(check.device)
    seconds = time.perf_counter() - started
    return {
        "tok_s": round(sum(map(len, tokens)) / seconds, 1),
        "new_tokens": [len(t) for t in tokens],
        "tokens": tokens,
    }


def demo_variant(
    check: Check,
    model: Any,
    tokenizer: Any,
    variant: Variant,
    prompts: list[list[int]],
    references: list[list[int]],
    compiled_engine: dict[str, SpeculativeEngine],
) -> dict[str, Any]:
    """One variant over every prompt: first divergence from ``generate``, speed, syncs per round."""
    if variant.compiled:
        if "engine" not in compiled_engine:
            compiled_engine["engine"] = SpeculativeEngine(
                model,
                tokenizer,
                drafter=SwitchedLookup(),
                calibration={},
                compile=check.compile_option,
                **variant.options,
            )
        engine = compiled_engine["engine"]
        drafter = engine.drafter
        assert isinstance(drafter, SwitchedLookup)
        drafter.enabled = variant.lookup
    else:
        engine = SpeculativeEngine(model, tokenizer, calibration={}, compile=False, **variant.options)
    new_tokens = check.args.demo_new_tokens
    result: dict[str, Any] = {"static_round": engine.static_round is not None}
    started = time.perf_counter()
    for ids in prompts:  # warm up; a compiled engine compiles here every width the prompts use
        engine.generate_ids(ids, max_new_tokens=new_tokens)
    synchronize(check.device)
    result["warm_up_s"] = round(time.perf_counter() - started, 2)
    outputs, seconds = [], 0.0
    for ids in prompts:
        synchronize(check.device)
        started = time.perf_counter()
        outputs.append(engine.generate_ids(ids, max_new_tokens=new_tokens))
        synchronize(check.device)
        seconds += time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outputs)
    rounds = sum(o.stats.target_forwards - 1 for o in outputs)  # the prefill is not a round
    result |= {
        "first_divergence": [first_divergence(o.token_ids, ref) for o, ref in zip(outputs, references, strict=True)],
        "tok_s": round(tokens / seconds, 1),
        "tokens_per_round": round((tokens - len(outputs)) / max(rounds, 1), 2),
    }
    result["identical"] = all(d is None for d in result["first_divergence"])
    if engine.static_round is not None:
        result["compiled_steps"] = [list(key) for key in sorted(engine.static_round.step.compiled)]
    if variant.compiled and not check.cuda:
        result["syncs_per_round"] = None  # a dispatch mode cannot wrap a compiled call
        return result
    with count_syncs(check.device) as counted:
        counted_output = engine.generate_ids(prompts[0], max_new_tokens=new_tokens)
    counted_rounds = max(counted_output.stats.target_forwards - 1, 1)
    result |= {"syncs_per_call": counted.reads, "syncs_per_round": round(counted.reads / counted_rounds, 2)}
    return result


# ----------------------------------------------------------------------------- 3. the 8B shape
class EnoughTokens(Exception):
    """Raised by :class:`OracleDrafter` to end a timed call before its narrower tail rounds."""


class OracleDrafter(Drafter):
    """Drafts the known greedy continuation; each token kept with probability ``alpha``, the first miss ends the run.

    A forced acceptance rate on a random model (issue 26): the draft is the reference text with
    the first token that "misses" replaced by another one, so the target accepts exactly the
    tokens before it. The misses are drawn from a generator seeded by the position, so every
    engine sees the same ones. It proposes only chains and never writes the target's cache
    (``chain_only``), so the static round serves it.

    It also times the call: the first round's start, the number of rounds, and the moment a
    round's budget falls under ``num_draft_tokens`` (the tail of the call), where it raises
    :class:`EnoughTokens`.
    """

    name = "oracle"
    chain_only = True

    def __init__(self, num_draft_tokens: int, vocab_size: int) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = vocab_size
        self.reset([], 0, 1.0)

    def reset(self, reference: list[int], prompt_tokens: int, alpha: float) -> None:
        """Aim at ``reference`` (the new tokens after a ``prompt_tokens``-token prompt) with acceptance ``alpha``."""
        self.reference, self.prompt_tokens, self.alpha = reference, prompt_tokens, alpha
        self.rounds = 0
        self.first_round: float | None = None
        self.stopped: float | None = None
        self.emitted: list[int] = []

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """The reference's next tokens, the first miss replaced (see the class docstring)."""
        now = time.perf_counter()
        emitted = len(state.token_ids) - self.prompt_tokens
        if max_tokens < self.num_draft_tokens:
            self.stopped, self.emitted = now, list(state.token_ids[self.prompt_tokens :])
            raise EnoughTokens
        if self.first_round is None:
            self.first_round = now
        self.rounds += 1
        tokens = list(self.reference[emitted : emitted + max_tokens])
        misses = random.Random(emitted * 1009 + round(self.alpha * 100))
        for index in range(len(tokens)):
            if misses.random() >= self.alpha:
                tokens[index] = (tokens[index] + 1) % self.vocab_size
                break
        return Draft(tokens=tokens)


def expected_tokens_per_round(alpha: float, drafts: int) -> float:
    """``1 + alpha + ... + alpha^drafts``: tokens a round emits when each draft is kept with ``alpha``."""
    return sum(alpha**i for i in range(drafts + 1))


def build_random_llama(check: Check) -> Any:
    """A random Llama of ``--shape`` (bf16 on CUDA, float32 on CPU), SDPA, no end-of-sequence token."""
    config = transformers.LlamaConfig(**SHAPES[check.args.shape])
    config.eos_token_id = None
    dtype = torch.bfloat16 if check.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(check.device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def timed_plain(check: Check, engine: SpeculativeEngine, prompt: list[int], new_tokens: int) -> tuple[Any, float]:
    synchronize(check.device)
    started = time.perf_counter()
    output = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    synchronize(check.device)
    return output, time.perf_counter() - started


def timed_oracle(
    check: Check, engine: SpeculativeEngine, oracle: OracleDrafter, prompt: list[int], new_tokens: int
) -> float:
    """Run until the oracle stops the call; the seconds from the call's start to that stop."""
    synchronize(check.device)
    started = time.perf_counter()
    with contextlib.suppress(EnoughTokens):
        engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert oracle.stopped is not None, "the call ended before the oracle stopped it"
    return oracle.stopped - started


def llama8b_section(check: Check, out: dict[str, Any]) -> None:
    """The 8B shape: plain and speculative, eager and graphed, HF eager; kernels per forward."""
    args = check.args
    started = time.perf_counter()
    model = build_random_llama(check)
    synchronize(check.device)
    check.kept["llama"] = model
    out["build_s"] = round(time.perf_counter() - started, 1)
    out["shape"] = args.shape
    out["dtype"] = str(model.dtype)
    if check.cuda:
        out["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    new_tokens = args.new_tokens
    plain_new = new_tokens + 2 * DRAFTS  # the reference must reach past the oracle's last draft
    oracle_new = new_tokens + DRAFTS  # the oracle stops when fewer than DRAFTS tokens are left
    out["prompt_tokens"], out["new_tokens"], out["drafts_per_round"] = len(prompt), new_tokens, DRAFTS
    references: dict[str, list[int]] = {}

    def plain(compiled: bool, backend: bool | str = check.compile_option, key: str = "") -> dict[str, Any]:
        del key  # one measurement: nothing partial to keep (the argument mirrors ``speculative``)
        engine = SpeculativeEngine(model, None, drafter="none", calibration={}, compile=backend if compiled else False)
        result: dict[str, Any] = {"fast_path": engine.runner.fast_layers is not None}
        if compiled:
            assert engine.static_round is not None
            result["compile_s"] = prepare(check, engine, len(prompt) + plain_new, (1,))
        engine.generate_ids(prompt, max_new_tokens=plain_new)  # warm up (graphed: records the graph)
        output, seconds = timed_plain(check, engine, prompt, plain_new)
        references["graphed" if compiled else "eager"] = output.token_ids
        check.kept[f"reference_{'graphed' if compiled else 'eager'}"] = output.token_ids
        check.kept[f"plain_{'graphed' if compiled else 'eager'}"] = engine
        result |= {
            "tok_s": round(len(output.token_ids) / seconds, 1),
            "ms_per_token": round(1000 * seconds / len(output.token_ids), 3),
            "tokens": len(output.token_ids),
        }
        if compiled and "eager" in references:
            result["first_divergence_vs_eager"] = first_divergence(output.token_ids, references["eager"])
        result |= compile_record(engine)
        return result

    def speculative(compiled: bool, backend: bool | str = check.compile_option, key: str = "") -> dict[str, Any]:
        mode = "graphed" if compiled else "eager"
        reference = references.get(mode) or references.get("eager")
        if reference is None:
            return {"skipped": "no plain reference text"}
        result: dict[str, Any] = {}
        out[key or f"speculative_{mode}"] = result  # saved as it fills: a timeout keeps the alphas measured
        oracle = OracleDrafter(DRAFTS, vocab)
        engine = SpeculativeEngine(
            model,
            None,
            drafter=oracle,
            num_draft_tokens=DRAFTS,
            calibration={},
            compile=backend if compiled else False,
        )
        if compiled:
            assert engine.static_round is not None
            result["compile_s"] = prepare(check, engine, len(prompt) + oracle_new, (DRAFTS + 1,))
        oracle.reset(reference, len(prompt), 1.0)
        timed_oracle(check, engine, oracle, prompt, oracle_new)  # warm up (graphed: records the graph)
        check.kept[f"speculative_{mode}"] = engine
        for alpha in ALPHAS:
            oracle.reset(reference, len(prompt), alpha)
            seconds = timed_oracle(check, engine, oracle, prompt, oracle_new)
            assert oracle.first_round is not None and oracle.stopped is not None
            round_s = (oracle.stopped - oracle.first_round) / max(oracle.rounds, 1)
            expected = expected_tokens_per_round(alpha, DRAFTS)
            result[f"alpha_{alpha}"] = {
                "tok_s": round(len(oracle.emitted) / seconds, 1),
                "tokens": len(oracle.emitted),
                "rounds": oracle.rounds,
                "tokens_per_round": round((len(oracle.emitted) - 1) / max(oracle.rounds, 1), 2),
                "expected_tokens_per_round": round(expected, 2),
                "ms_per_round": round(1000 * round_s, 3),
                "projected_tok_s": round(expected / round_s, 1),
                "first_divergence_vs_reference": first_divergence(oracle.emitted, reference[: len(oracle.emitted)]),
            }
            check.save()
        result |= compile_record(engine)
        return result

    # the eager runs first (seconds each), then the two compiles (the least predictable part)
    guarded(check, out, "row_invariance", lambda: row_invariance(model))
    guarded(check, out, "plain_eager", lambda: plain(False))
    guarded(check, out, "speculative_eager", lambda: speculative(False))
    guarded(check, out, "hf_eager", lambda: hf_eager(check, model, prompt, new_tokens, references.get("eager")))
    if check.compiles:
        for name, run in (("plain_graphed", plain), ("speculative_graphed", speculative)):
            done = guarded(check, out, name, functools.partial(run, True, check.compile_option), needs=COMPILE_NEEDS)
            if check.cuda and isinstance(done, dict) and "error" in done:  # e.g. Triton cannot build its kernels
                fallback = f"{name}_cudagraphs_backend"  # CUDA graphs of the eager kernels, no code generation
                run_fallback = functools.partial(run, True, "cudagraphs", fallback)
                guarded(check, out, fallback, run_fallback, needs=COMPILE_NEEDS / 2)
    check.kept["profile_tokens_for"] = len(prompt) + oracle_new
    guarded(check, out, "profile", lambda: profile_steps(check, len(prompt) + oracle_new, compiled=False))
    summarize_llama(out)


def row_invariance(model: Any, widths: tuple[int, ...] = (2, 3, 5, 9, 16, 17), blocks: int = 4) -> dict[str, Any]:
    """Per linear weight of layer 0 and the LM head: at which widths a block's rows differ from the rows alone.

    The eager loop's half-precision verify is exact only where each linear layer it batches is
    row-invariant (:func:`selfspec.modeling.attention.linear_is_row_invariant`, whose verdict is
    recorded too); the first GPU check saw speculative text leave the plain loop's at token 6.
    """
    from selfspec.modeling.attention import linear_is_row_invariant

    layer = model.model.layers[0]
    weights = {name: module.weight for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}
    weights["lm_head"] = model.lm_head.weight
    generator = torch.Generator(device=model.device).manual_seed(0)
    result: dict[str, Any] = {}
    with torch.no_grad():
        for name, weight in weights.items():
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


def compile_record(engine: SpeculativeEngine) -> dict[str, Any]:
    """Which static steps the engine compiled (``(kind, width, bucket)``) and dynamo's graph count so far."""
    if engine.static_round is None:
        return {}
    counters = torch._dynamo.utils.counters["stats"]
    return {
        "compiled_steps": [list(key) for key in sorted(engine.static_round.step.compiled)],
        "dynamo_unique_graphs_so_far": int(counters.get("unique_graphs", 0)),
    }


def prepare(check: Check, engine: SpeculativeEngine, slots_for: int, widths: tuple[int, ...]) -> float:
    """Compile the static round's steps of ``widths`` for calls of ``slots_for`` tokens; seconds taken."""
    from selfspec.modeling.static_step import WIDTHS

    assert engine.static_round is not None
    started = time.perf_counter()
    engine.static_round.step.prepare(slots_for + WIDTHS[-1], widths=widths)
    synchronize(check.device)
    return round(time.perf_counter() - started, 1)


def hf_eager(
    check: Check, model: Any, prompt: list[int], new_tokens: int, reference: list[int] | None
) -> dict[str, Any]:
    """transformers' eager greedy ``generate`` (dynamic cache) on the same prompt."""
    ids = torch.tensor([prompt], device=check.device)
    model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    synchronize(check.device)
    started = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    synchronize(check.device)
    seconds = time.perf_counter() - started
    tokens_list = tokens.tolist()
    return {
        "tok_s": round(len(tokens_list) / seconds, 1),
        "tokens": len(tokens_list),
        "first_divergence_vs_selfspec_eager": None
        if reference is None
        else first_divergence(tokens_list, reference[: len(tokens_list)]),
    }


def profile_steps(check: Check, tokens_for: int, compiled: bool) -> dict[str, Any]:
    """Kernels and device time of one static step of width 1 and 9, eager or compiled.

    Eager: a fresh :class:`StaticStep` without ``torch.compile`` (the same layer code, every
    kernel launched from Python). Compiled: the graphed engines' own steps (width 1 from the plain
    engine, width 9 from the speculative one), replayed at the bucket their calls used.
    """
    from selfspec.modeling.static_step import WIDTHS, StaticStep, bucket_for

    slots = tokens_for + WIDTHS[-1]
    context = check.args.prompt_len
    result: dict[str, Any] = {"context": context, "bucket": bucket_for(slots)}
    if compiled:
        engines = {1: check.kept.get("plain_graphed"), DRAFTS + 1: check.kept.get("speculative_graphed")}
        if any(engine is None or engine.static_round is None for engine in engines.values()):
            return result | {"skipped": "no graphed engines to profile (the llama8b section did not build them)"}
        steps = {w: e.static_round.step for w, e in engines.items()}  # type: ignore[union-attr]
    else:
        eager_step = StaticStep(check.kept["plain_eager"].runner)
        eager_step.reserve(slots)
        steps = {1: eager_step, DRAFTS + 1: eager_step}
    for width, step in steps.items():
        result[f"{'compiled' if compiled else 'eager'}_w{width}"] = profile_one(check, step, width, context)
        check.save()
    return result


def profile_compiled_section(check: Check, out: dict[str, Any]) -> None:
    """The graphed steps under the profiler, last: profiling CUDA graph replays is the riskiest call here."""
    if "profile_tokens_for" not in check.kept:
        out["skipped"] = "the llama8b section did not run"
        return
    out |= profile_steps(check, check.kept["profile_tokens_for"], compiled=True)


def profile_one(check: Check, step: Any, width: int, context: int) -> dict[str, Any]:
    """One step of ``width`` at ``context`` cached positions: wall ms (mean of repeats), then one under the profiler.

    The bucket is the step's cache size (the one its engine's calls used, so nothing recompiles).
    """
    from torch.profiler import ProfilerActivity, profile

    cache = step.cache
    bucket = cache.max_length
    tokens = torch.full((1, width), 7, dtype=torch.long, device=check.device)
    drafts = torch.tensor(width - 1, dtype=torch.long).to(check.device)

    def once() -> None:
        cache.length.fill_(context)
        step.greedy(tokens, drafts, bucket)

    with torch.inference_mode():
        for _ in range(3):
            once()
        synchronize(check.device)
        started = time.perf_counter()
        for _ in range(check.args.repeats):
            once()
        synchronize(check.device)
        wall_ms = 1000 * (time.perf_counter() - started) / check.args.repeats
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if check.cuda else [])
        with profile(activities=activities) as profiler:
            once()
            synchronize(check.device)
    events = list(profiler.events())
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return {
        "wall_ms": round(wall_ms, 3),
        "kernels": len(kernels),
        "device_ms": round(sum(_device_us(e) for e in kernels) / 1000, 3),
        "aten_ops_nested": sum(e.name.startswith("aten::") for e in host),  # a profiler count: nested calls too
        "kernel_launch_calls": sum(e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel")) for e in host),
        "graph_launch_calls": sum(e.name.startswith("cudaGraphLaunch") for e in host),
    }


def _device_us(event: Any) -> float:
    """A kernel event's duration in microseconds (its time range; older torch names as fallbacks)."""
    time_range = getattr(event, "time_range", None)
    if time_range is not None:
        return float(time_range.elapsed_us())
    for name in ("device_time", "cuda_time"):
        value = getattr(event, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def summarize_llama(out: dict[str, Any]) -> None:
    """Speculative graphed over plain graphed (the issue's >= 1.8x at acceptance 0.8), and the like."""
    summary: dict[str, Any] = {}
    plain = {m: out.get(f"plain_{m}", {}).get("tok_s") for m in ("eager", "graphed")}
    for mode in ("eager", "graphed"):
        runs = out.get(f"speculative_{mode}", {})
        for alpha in ALPHAS:
            run = runs.get(f"alpha_{alpha}") if isinstance(runs, dict) else None
            if run and plain[mode]:
                summary[f"speculative_{mode}_vs_plain_{mode}_alpha_{alpha}"] = round(run["tok_s"] / plain[mode], 2)
            if run and plain["graphed"]:
                summary[f"speculative_{mode}_vs_plain_graphed_alpha_{alpha}"] = round(
                    run["tok_s"] / plain["graphed"], 2
                )
    if plain["eager"] and plain["graphed"]:
        summary["plain_graphed_vs_plain_eager"] = round(plain["graphed"] / plain["eager"], 2)
    target = summary.get("speculative_graphed_vs_plain_graphed_alpha_0.8")
    if target is not None:  # the acceptance test on a GPU
        summary["issue26_speculative_graphed_at_least_1.8x_plain_graphed_at_0.8"] = target >= 1.8
    out["summary"] = summary


# ----------------------------------------------------------------------------- 4. SDPA backends
def sdpa_section(check: Check, out: dict[str, Any]) -> None:
    """SDPA with GQA at ``--sdpa-context``: prefill and a 9-query chain verify, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = SHAPES[check.args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    context = check.args.sdpa_context
    dtype = torch.bfloat16 if check.cuda else torch.float32
    device = check.device
    out |= {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "context": context, "dtype": str(dtype)}
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    for case, queries in (("prefill", context), ("chain_verify_9", 9)):
        query = torch.randn(1, heads, queries, head_dim, device=device, dtype=dtype)
        key = torch.randn(1, kv_heads, context, head_dim, device=device, dtype=dtype)
        value = torch.randn_like(key)
        rows = torch.arange(context - queries, context, device=device)[:, None]
        mask = (torch.arange(context, device=device)[None, :] <= rows)[None, None]  # [1, 1, q, kv]
        forms = sdpa_forms(query, key, value, mask)
        rows_out: dict[str, Any] = {}
        out[case] = rows_out
        reference = forms["bool_mask_gqa"]().float()
        for form, call in forms.items():
            for backend in backends:
                if check.left() < 0:
                    rows_out[f"{form}/{backend.name}"] = {"skipped": "deadline"}
                    continue
                rows_out[f"{form}/{backend.name}"] = time_sdpa(check, call, backend, sdpa_kernel, reference)
            check.save()


def sdpa_forms(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """The attention calls compared: selfspec's boolean mask before issue 26, repeated K/V, and the causal forms.

    ``is_causal`` for a prefill (as many queries as keys); ``causal_lower_right`` for a verify of fewer
    queries (the last queries of the text, each seeing every key up to its own position).
    """
    from torch.nn.attention.bias import causal_lower_right

    sdpa = torch.nn.functional.scaled_dot_product_attention
    queries, context = query.shape[2], key.shape[2]
    repeat = query.shape[1] // key.shape[1]
    forms: dict[str, Callable[[], torch.Tensor]] = {
        "bool_mask_gqa": lambda: sdpa(query, key, value, attn_mask=mask, enable_gqa=True),
        "repeat_kv_bool_mask": lambda: sdpa(
            query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1), attn_mask=mask
        ),
    }
    if queries == context:
        forms["is_causal_gqa"] = lambda: sdpa(query, key, value, is_causal=True, enable_gqa=True)
    else:
        bias = causal_lower_right(queries, context)
        forms["causal_lower_right_gqa"] = lambda: sdpa(query, key, value, attn_mask=bias, enable_gqa=True)
    return forms


def time_sdpa(check: Check, call: Callable[[], torch.Tensor], backend: Any, sdpa_kernel: Any, reference: Any) -> Any:
    """Median ms of ``call`` under one backend, its peak memory, its largest deviation; or why it was refused."""
    device = check.device
    try:
        with sdpa_kernel([backend]):
            result = call()
            synchronize(device)
            if check.cuda:
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            samples = []
            for _ in range(check.args.repeats):
                started = time.perf_counter()
                call()
                synchronize(device)
                samples.append(time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - a refused backend is an answer
        return {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    row = {
        "ms": round(1000 * statistics.median(samples), 3),
        "max_abs_diff_vs_math_mask": round(float((result.float() - reference).abs().max()), 5),
    }
    if check.cuda:
        row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - baseline) / 2**20, 1)
    return row


# ----------------------------------------------------------------------------- 5. HF static cache + compile
def hf_compiled_section(check: Check, out: dict[str, Any]) -> None:
    """transformers' ``generate`` with a static cache, the decode step compiled by transformers itself."""
    from transformers import CompileConfig

    model = check.kept.get("llama") or build_random_llama(check)
    check.kept["llama"] = model
    prompt = torch.randint(
        0, model.config.vocab_size, (check.args.prompt_len,), generator=torch.Generator().manual_seed(1)
    )
    ids = prompt[None].to(check.device)
    config: CompileConfig | None = None  # on CPU without --cpu-compile: the static cache, eagerly
    if check.compiles:
        config = CompileConfig(fullgraph=True, mode="reduce-overhead", backend=check.args.compile_backend)
        if not check.cuda:
            config._compile_all_devices = True  # type: ignore[assignment]  # transformers compiles on CPU if told
    new_tokens = check.args.new_tokens
    options = {"do_sample": False, "pad_token_id": 0, "cache_implementation": "static", "compile_config": config}
    started = time.perf_counter()
    try:
        model.generate(ids, max_new_tokens=new_tokens, **options)  # compiles the decode step (CUDA)
    except Exception as exc:  # noqa: BLE001 - a graph break under fullgraph=True: transformers' default then
        out["fullgraph_error"] = f"{type(exc).__name__}: {exc}"[:400]
        options["compile_config"] = CompileConfig(backend=check.args.compile_backend) if config else None
        model.generate(ids, max_new_tokens=new_tokens, **options)
    synchronize(check.device)
    out["first_call_s"] = round(time.perf_counter() - started, 1)
    out["compiled"] = hasattr(model, "_compiled_call")
    out["compile_config"] = str(options["compile_config"])
    check.save()
    model.generate(ids, max_new_tokens=new_tokens, **options)  # the graphs' recording runs
    synchronize(check.device)
    started = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=new_tokens, **options)[0, ids.shape[1] :].tolist()
    synchronize(check.device)
    seconds = time.perf_counter() - started
    out |= {"tok_s": round(len(tokens) / seconds, 1), "tokens": len(tokens)}
    reference = check.kept.get("reference_eager")
    if reference is not None:
        out["first_divergence_vs_selfspec_eager"] = first_divergence(tokens, reference[: len(tokens)])
    plain = check.results.get("llama8b", {}).get("plain_graphed", {})
    if isinstance(plain, dict) and plain.get("tok_s"):
        out["selfspec_plain_graphed_vs_this"] = round(plain["tok_s"] / out["tok_s"], 2)


# ----------------------------------------------------------------------------- 6. NF4 (optional)
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


def quantized_section(check: Check, out: dict[str, Any]) -> None:
    """NF4 verify-cost curve through the module path (a forward of 1..16 tokens, relative to 1)."""
    import bitsandbytes

    from selfspec.modeling.runner import ModelRunner

    check.kept.pop("llama", None)
    for key in [k for k in check.kept if k.startswith(("plain_", "speculative_"))]:
        check.kept.pop(key)
    if check.cuda:
        torch.cuda.empty_cache()
    model = build_random_llama(check)
    quantize_linears(model, model.dtype, check.device)
    runner = ModelRunner(model)
    out |= {"bitsandbytes": bitsandbytes.__version__, "fast_path": runner.fast_layers is not None}
    context = check.args.prompt_len
    cache = runner.new_cache(context + 17)
    ids = torch.randint(0, runner.vocab_size, (1, context), device=check.device)
    with torch.inference_mode():
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(context, device=check.device), cache)
        times = {}
        for width in (1, 2, 4, 8, 16):

            def forward(width: int = width) -> None:
                positions = torch.arange(context, context + width, device=check.device)
                runner.logits(runner.run_layers(runner.embed(ids[:, :width]), 0, runner.num_layers, positions, cache))
                cache.crop_to(context)

            forward()
            synchronize(check.device)
            started = time.perf_counter()
            for _ in range(check.args.repeats):
                forward()
            synchronize(check.device)
            times[width] = (time.perf_counter() - started) / check.args.repeats
    out["one_token_ms"] = round(1000 * times[1], 3)
    out["verify_cost"] = {str(w): round(t / times[1], 3) for w, t in times.items()}


# ----------------------------------------------------------------------------- the summary
def markdown(results: dict[str, Any]) -> str:
    """A short markdown summary of the JSON (what ran, what it measured, what failed)."""
    env = results.get("env", {})
    lines = [
        "# GPU check (`benchmarks/gpu_check.sh`)",
        "",
        f"torch {env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, "
        f"device `{env.get('device')}` {env.get('gpu', '')}; bitsandbytes {env.get('bitsandbytes')}; "
        f"decoder layer cache keyword {env.get('decoder_layer_cache_keyword')}; run {results.get('elapsed_s')} s.",
        "",
    ]
    demo = {
        f"{dtype}{' (compiled)' if section == 'demo_compiled' else ''}": row
        for section in ("demo", "demo_compiled")
        for dtype, row in (results.get(section) or {}).items()
    }
    if demo:
        lines += [
            "## Demo model: selfspec against transformers' greedy `generate`",
            "",
            "| dtype | variant | identical | first divergence per prompt | tok/s | tokens/round | syncs/round |",
            "|---|---|---|---|---|---|---|",
        ]
        for dtype, row in demo.items():
            if not isinstance(row, dict):
                continue
            hf = row.get("hf_generate", {})
            if isinstance(hf, dict) and "tok_s" in hf:
                lines.append(f"| {dtype} | HF generate | - | - | {hf['tok_s']} | 1 | - |")
            for name, cell in row.items():
                if name == "hf_generate" or not isinstance(cell, dict):
                    continue
                if "tok_s" not in cell:
                    lines.append(f"| {dtype} | {name} | {_why(cell)} | | | | |")
                    continue
                same = "yes" if cell.get("identical") else "**NO**"
                lines.append(
                    f"| {dtype} | {name} | {same} | {cell.get('first_divergence')} | {cell['tok_s']} | "
                    f"{cell.get('tokens_per_round')} | {cell.get('syncs_per_round')} |"
                )
        lines.append("")
    llama = results.get("llama8b", {})
    if llama:
        lines += [
            f"## {llama.get('shape')} random weights ({llama.get('dtype')}), oracle drafter, "
            f"{llama.get('drafts_per_round')} drafts a round",
            "",
            "| variant | tok/s | tokens/round | ms/round | projected tok/s | compile s | first divergence |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in [k for k in llama if k.startswith("plain_")] + ["hf_eager"]:
            cell = llama.get(name)
            if isinstance(cell, dict):
                if "tok_s" in cell:
                    divergence = cell.get("first_divergence_vs_eager", cell.get("first_divergence_vs_selfspec_eager"))
                    lines.append(
                        f"| {name} | {cell['tok_s']} | 1 | {cell.get('ms_per_token', '')} | | "
                        f"{cell.get('compile_s', '')} | {divergence} |"
                    )
                else:
                    lines.append(f"| {name} | {_why(cell)} | | | | | |")
        for mode in [k.removeprefix("speculative_") for k in llama if k.startswith("speculative_")]:
            cell = llama.get(f"speculative_{mode}")
            if not isinstance(cell, dict):
                continue
            if not any(k.startswith("alpha_") for k in cell):
                lines.append(f"| speculative_{mode} | {_why(cell)} | | | | | |")
            for alpha in ALPHAS:
                run = cell.get(f"alpha_{alpha}")
                if isinstance(run, dict):
                    lines.append(
                        f"| speculative_{mode} alpha {alpha} | {run['tok_s']} | {run['tokens_per_round']} "
                        f"(expected {run['expected_tokens_per_round']}) | {run['ms_per_round']} | "
                        f"{run['projected_tok_s']} | {cell.get('compile_s', '')} | "
                        f"{run['first_divergence_vs_reference']} |"
                    )
        hf = results.get("hf_compiled", {})
        if isinstance(hf, dict) and "tok_s" in hf:
            lines.append(
                f"| HF static cache + compile | {hf['tok_s']} | 1 | | | {hf.get('first_call_s')} (first call) | |"
            )
        elif hf:
            lines.append(f"| HF static cache + compile | {_why(hf)} | | | | | |")
        if llama.get("summary"):
            lines += [
                "",
                "Ratios: "
                + ", ".join(f"{k} {v if isinstance(v, bool) else f'{v}x'}" for k, v in llama["summary"].items()),
            ]
        profile = dict(llama.get("profile") or {}) | dict(results.get("profile_compiled") or {})
        if "context" in profile:
            lines += [
                "",
                f"One static step at {profile['context']} cached positions (bucket {profile['bucket']}):",
                "",
                "| step | wall ms | kernels | device ms | aten ops (nested) |",
                "|---|---|---|---|---|",
            ]
            for name, cell in profile.items():
                if isinstance(cell, dict) and "wall_ms" in cell:
                    lines.append(
                        f"| {name} | {cell['wall_ms']} | {cell['kernels']} | {cell['device_ms']} | "
                        f"{cell['aten_ops_nested']} |"
                    )
        lines.append("")
    sdpa = results.get("sdpa", {})
    if sdpa:
        lines += [
            f"## SDPA with GQA at {sdpa.get('context')} positions ({sdpa.get('heads')} heads, "
            f"{sdpa.get('kv_heads')} KV heads, {sdpa.get('dtype')})",
            "",
            "| case | form / backend | ms | peak extra MiB | max abs diff | refused |",
            "|---|---|---|---|---|---|",
        ]
        for case in ("prefill", "chain_verify_9"):
            for name, cell in (sdpa.get(case) or {}).items():
                if "ms" in cell:
                    lines.append(
                        f"| {case} | {name} | {cell['ms']} | {cell.get('peak_extra_mib', '')} | "
                        f"{cell['max_abs_diff_vs_math_mask']} | |"
                    )
                else:
                    lines.append(f"| {case} | {name} | | | | {_why(cell)} |")
        lines.append("")
    failures = [
        f"- `{name}`: {_why(cell)}"
        for name, cell in results.items()
        if isinstance(cell, dict) and ("error" in cell or "skipped" in cell)
    ]
    if failures:
        lines += ["## Sections that did not run", "", *failures, ""]
    return "\n".join(lines)


def _why(cell: dict[str, Any]) -> str:
    return str(cell.get("error") or cell.get("skipped") or cell.get("refused") or "?").replace("|", "/")[:160]


# ----------------------------------------------------------------------------- main
BODIES: dict[str, Callable[[Check, dict[str, Any]], None]] = {
    "env": env_section,
    "demo": demo_section,
    "llama8b": llama8b_section,
    "sdpa": sdpa_section,
    "hf_compiled": hf_compiled_section,
    "demo_compiled": demo_compiled_section,
    "profile_compiled": profile_compiled_section,
    "quantized": quantized_section,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--sections", nargs="*", choices=SECTIONS, default=None, help="default: all but quantized")
    parser.add_argument("--quantized", action="store_true", help="also the NF4 section (imports bitsandbytes)")
    parser.add_argument("--deadline", type=float, default=270.0, help="seconds; no new measurement starts past it")
    parser.add_argument("--demo-dtypes", nargs="*", default=["float16", "bfloat16"])
    parser.add_argument("--demo-compiled-dtypes", nargs="*", default=["bfloat16", "float16"])
    parser.add_argument("--demo-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128, help="the 8B shape's prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="the 8B shape's new tokens")
    parser.add_argument("--sdpa-context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cpu-compile", action="store_true", help="on CPU, run the compiled variants too")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of compiled variants")
    parser.add_argument("--quick", action="store_true", help="the CPU smoke test's sizes (tiny shape expected)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.demo_new_tokens, args.prompt_len, args.new_tokens = 12, 16, 24
        args.sdpa_context, args.repeats = 256, 2
    if args.sections is None:
        args.sections = [s for s in SECTIONS if s != "quantized" or args.quantized]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("GPU_CHECK_THREADS", torch.get_num_threads())))
    check = Check(args)
    check.results["args"] = {k: v for k, v in vars(args).items() if k != "out"}  # the output folder: a local path
    for name in SECTIONS:
        if name in args.sections:
            check.run_section(name, BODIES[name])
    check.kept.clear()
    check.save()
    log(check, f"wrote {Path(args.out) / 'gpu_check.json'} and gpu_check.md")


if __name__ == "__main__":
    main()
