"""Side-by-side benchmark: plain decoding, transformers' own speculative modes and selfspec.

Every method runs in one process, on the same model object and prompts, interleaved (the
method order rotates every repeat), so machine noise hits all of them alike. Greedy outputs
are checked token for token against transformers' greedy ``generate``.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..artifacts import atomic_path, atomic_write_text
from ..decoding.engine import SpeculativeEngine
from ..drafting import list_drafters
from ..drafting.planning import BenchRow
from ..drafting.registry import registered
from ..errors import ConfigurationError
from ..modeling.loading import DEMO_DRAFT_MODEL, DEMO_MODEL, load_model_and_tokenizer
from ..modeling.realmodels import display_name
from ..prompts import CATEGORY_ALIASES, PROMPT_SETS, STOCK_PROMPT_SETS, as_plain_text
from .store import machine_fingerprint

logger = logging.getLogger(__name__)

#: Token-tree node budgets ``selfspec bench`` compares with the chain by default.
DEFAULT_BENCH_TREE_NODES = (8,)

#: ``--methods`` choices of transformers' peers; the baselines (transformers' greedy ``generate``,
#: and its sampling at each temperature a chosen method samples at) always run.
HF_FAMILIES: dict[str, str] = {
    "hf_early_exit": "transformers assistant_early_exit",
    "hf_prompt_lookup": "transformers prompt_lookup_num_tokens",
}
#: The family of transformers' greedy and sampling baselines (never filtered out).
BASELINE = "baseline"


def method_families() -> dict[str, str]:
    """``--methods`` choices: every family the registered drafters' bench rows declare, then transformers' peers.

    A registered drafter without declared rows is its own family (one greedy ``selfspec_<name>`` row).
    """
    families: dict[str, str] = {}
    for spec in registered():
        if spec.bench is not None:
            families.update(spec.bench.families)
    return {**families, **HF_FAMILIES}


def check_methods(methods: Sequence[str] | None) -> list[str] | None:
    """Validate ``--methods`` (family names, or shell patterns over method names); ``None``: all."""
    if methods is None:
        return None
    chosen = list(methods)
    families = method_families()
    for name in chosen:
        if (
            name not in families
            and name not in list_drafters()
            and not any(ch in name for ch in "*?[")
            and not name.startswith(("selfspec_", "hf_"))
        ):
            raise ConfigurationError(
                f"unknown benchmark method {name!r}; choose among {', '.join(families)} "
                "(or a pattern over method names, e.g. 'selfspec_tree_*')"
            )
    return chosen


def default_prompt_sets(model: str) -> dict[str, list[Any]]:
    """The built-in prompts for ``model``: the Austen sets for the demo model, else the stock-model sets."""
    return PROMPT_SETS if model in (DEMO_MODEL, DEMO_DRAFT_MODEL) else STOCK_PROMPT_SETS


def select_categories(sets: dict[str, list[Any]], categories: Sequence[str] | None) -> dict[str, list[Any]]:
    """Restrict ``sets`` to ``categories`` (aliases such as ``chat`` accepted); a clear error for unknown ones."""
    if not categories:
        return dict(sets)
    chosen: dict[str, list[Any]] = {}
    for name in categories:
        key = name if name in sets else CATEGORY_ALIASES.get(name)
        if key is None or key not in sets:
            raise ConfigurationError(f"unknown prompt category {name!r}; this prompt set has: {', '.join(sets)}")
        chosen[key] = sets[key]
    return chosen


@dataclass
class Run:
    """One timed generation."""

    method: str
    category: str
    prompt: int
    repeat: int
    new_tokens: int
    seconds: float
    token_ids: list[int]
    tau: float | None = None
    acceptance_rate: float | None = None
    peak_memory_mb: float | None = None
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    target_forwards: int | None = None


@dataclass
class Method:
    """A decoding method under test."""

    name: str
    baseline: str  # the method its speedup is measured against
    generate: Callable[[list[int], int, int], tuple[list[int], Any]]
    greedy: bool = True
    description: str = ""
    family: str = ""  # the --methods choice that selects it (method_families())


@dataclass
class BenchReport:
    """Everything a benchmark run measured."""

    settings: dict[str, Any]
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready report (raw runs without token ids)."""
        return {
            "settings": self.settings,
            "methods": self.methods,
            "runs": [{k: v for k, v in vars(r).items() if k != "token_ids"} for r in self.runs],
        }


def _hf_method(
    name: str,
    model: Any,
    baseline: str,
    description: str,
    family: str,
    greedy: bool = True,
    **generate_kwargs: Any,
) -> Method:
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos

    def run(prompt_ids: list[int], max_new_tokens: int, seed: int) -> tuple[list[int], Any]:
        ids = torch.tensor([prompt_ids], device=model.device)
        if not greedy:
            torch.manual_seed(seed)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **generate_kwargs,
        )
        return [int(t) for t in out[0, len(prompt_ids) :]], None

    return Method(name, baseline, run, greedy, description, family)


def _selfspec_method(row: BenchRow) -> Method:
    engine, temperature = row.engine, row.temperature

    def run(prompt_ids: list[int], max_new_tokens: int, seed: int) -> tuple[list[int], Any]:
        out = engine.generate_ids(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return out.token_ids, out.stats

    baseline = "hf_greedy" if temperature == 0.0 else f"hf_sample_t{temperature}"
    return Method(row.name, baseline, run, temperature == 0.0, row.description, row.family)


@dataclass
class RowContext:
    """What a registered drafter's bench rows are built from (:class:`~selfspec.drafting.planning.BenchContext`)."""

    loaded: SpeculativeEngine
    exit_layer: int
    num_draft_tokens: int
    temperatures: Sequence[float]
    tree_nodes: Sequence[int]
    draft_model: Any = None

    def engine(self, **arguments: Any) -> SpeculativeEngine:
        """An engine on the loaded model and tokenizer (batching as the loaded one: ``selfspec bench --batching``)."""
        arguments = {"batching": self.loaded.batching, **arguments}
        return SpeculativeEngine(self.loaded.model, self.loaded.tokenizer, **arguments)


def build_methods(
    auto_engine: SpeculativeEngine,
    *,
    exit_layer: int,
    num_draft_tokens: int,
    lookup_tokens: int,
    temperatures: Sequence[float],
    draft_model: Any = None,
    tree_nodes: Sequence[int] = (),
) -> list[Method]:
    """The methods compared: transformers' baselines and peers, and every registered drafter's rows.

    Each registration declares its rows (:class:`~selfspec.drafting.planning.DrafterBench`): the
    plain loop, the calibrated plan, fixed early exits and their token trees (``tree_nodes``), the
    exit adapter and Medusa heads when saved beside the model, a draft model when one is loaded...
    A registered drafter that declares none gets one greedy ``selfspec_<name>`` row when it builds
    without arguments of its own.
    """
    model = auto_engine.model
    methods = [
        _hf_method("hf_greedy", model, "hf_greedy", "transformers generate, greedy", BASELINE, do_sample=False),
        _hf_method(
            f"hf_early_exit_{exit_layer}",
            model,
            "hf_greedy",
            f"transformers assistant_early_exit={exit_layer}",
            "hf_early_exit",
            do_sample=False,
            assistant_early_exit=exit_layer,
        ),
        _hf_method(
            f"hf_prompt_lookup_{lookup_tokens}",
            model,
            "hf_greedy",
            f"transformers prompt_lookup_num_tokens={lookup_tokens}",
            "hf_prompt_lookup",
            do_sample=False,
            prompt_lookup_num_tokens=lookup_tokens,
        ),
    ]
    for t in temperatures:
        methods.append(
            _hf_method(
                f"hf_sample_t{t}",
                model,
                f"hf_sample_t{t}",
                f"transformers sampling, T={t}",
                BASELINE,
                greedy=False,
                do_sample=True,
                temperature=t,
                top_k=0,
                top_p=1.0,
            )
        )
    context = RowContext(auto_engine, exit_layer, num_draft_tokens, temperatures, tree_nodes, draft_model)
    for spec in registered():
        rows = spec.bench.rows(spec.name, context) if spec.bench is not None else _default_rows(spec.name, context)
        methods += [_selfspec_method(row) for row in rows]
    return methods


def _default_rows(name: str, context: RowContext) -> list[BenchRow]:
    """A greedy ``selfspec_<name>`` row for a registered drafter that declares no rows (a user's, a new one)."""
    k = context.num_draft_tokens
    try:
        engine = context.engine(drafter=name, num_draft_tokens=k)
    except ConfigurationError:
        return []  # it needs arguments the benchmark does not have (a model or heads of its own)
    return [BenchRow(f"selfspec_{name}", engine, f"registered drafter {name!r}, {k} drafts", name)]


def filter_methods(methods: list[Method], chosen: Sequence[str] | None) -> list[Method]:
    """Keep the chosen families / name patterns, plus the baselines they are measured against."""
    if chosen is None:
        return methods
    families = method_families()
    kept = [
        m
        for m in methods
        if m.family in chosen or any(fnmatch.fnmatchcase(m.name, c) for c in chosen if c not in families)
    ]
    for pattern in chosen:
        known = pattern in families or pattern in list_drafters()
        if not known and not any(fnmatch.fnmatchcase(m.name, pattern) for m in methods):
            raise ConfigurationError(
                f"no benchmark method matches {pattern!r}; this model has: {', '.join(m.name for m in methods)}"
            )
    baselines = {"hf_greedy"} | {m.baseline for m in kept}
    return [m for m in methods if m.name in baselines or m in kept]


def _encode(engine: SpeculativeEngine, prompt: Any) -> list[int]:
    """A prompt's token ids; chat messages become plain-text turns for a model without a chat template."""
    tokenizer = engine.tokenizer
    if not isinstance(prompt, str) and tokenizer is not None and getattr(tokenizer, "chat_template", None) is None:
        prompt = as_plain_text(prompt)
    return engine.encode_prompt(prompt)


def run_benchmark(
    model: str = "selfspec-demo",
    *,
    prompt_sets: dict[str, list[Any]] | None = None,
    max_new_tokens: int = 96,
    repeats: int = 3,
    threads: int | str | None = 1,
    exit_layer: int | None = None,
    num_draft_tokens: int | None = None,
    lookup_tokens: int = 4,
    temperatures: Sequence[float] = (0.7, 1.0),
    categories: Sequence[str] | None = None,
    progress: bool = True,
    draft_model: str | None = "auto",
    tree_nodes: Sequence[int] = (),
    methods: Sequence[str] | None = None,
    extra_methods: Callable[[SpeculativeEngine], list[Method]] | None = None,
    **engine_args: Any,
) -> BenchReport:
    """Run every method on every prompt ``repeats`` times, interleaved, and summarise.

    Args:
        model: the model to load (hub id, folder, or ``"selfspec-demo"``).
        prompt_sets: ``{category: [prompt, ...]}``; by default the built-in Spec-Bench-like sets
            for the demo model, and RAG, summarization, chat and code prompts for any other
            model (:data:`~selfspec.prompts.STOCK_PROMPT_SETS`).
        max_new_tokens: new tokens per generation.
        repeats: passes over all prompts; the method order rotates each pass.
        threads: torch CPU threads (set explicitly: the machine may be shared), passed to
            :meth:`SpeculativeEngine.from_pretrained` (``"auto"`` measures; ``None`` leaves torch alone).
        exit_layer: the fixed-E method's exit layer and the transformers early-exit layer
            (default: the calibrated one).
        num_draft_tokens: the fixed-k method's draft length (default: the calibrated one).
        lookup_tokens: transformers' ``prompt_lookup_num_tokens``.
        temperatures: sampling temperatures to compare at.
        categories: restrict to these categories (checked before the model is loaded).
        progress: show a progress bar.
        draft_model: a draft model (name or folder) for the ``selfspec_draft_model`` method;
            ``"auto"``: ``"selfspec-demo-draft"`` when benchmarking ``"selfspec-demo"``, else none.
        tree_nodes: node budgets of early-exit token trees to compare with the chain
            (``selfspec_tree_N`` methods, greedy and at each temperature).
        methods: run only these method families (:func:`method_families`) or name patterns
            (``fnmatch``), plus their baselines; ``None``: every method.
        extra_methods: builds more methods from the loaded engine (a script's own variants);
            they always run, after the chosen ones.
        **engine_args: passed to :meth:`SpeculativeEngine.from_pretrained`.
    """
    sets = select_categories(prompt_sets or default_prompt_sets(str(model)), categories)
    chosen_methods = check_methods(methods)
    engine = SpeculativeEngine.from_pretrained(model, threads=threads, **engine_args)
    exit_layer = exit_layer or engine.exit_layer
    num_draft_tokens = num_draft_tokens or engine.num_draft_tokens
    prompts = [(cat, i, _encode(engine, p)) for cat, items in sets.items() for i, p in enumerate(items)]
    if draft_model == "auto":
        draft_model = DEMO_DRAFT_MODEL if model == DEMO_MODEL else None
    loaded_draft = None
    if draft_model is not None:
        loaded_draft, _, _ = load_model_and_tokenizer(
            draft_model,
            quantization=engine_args.get("quantization"),
            dtype=engine.runner.dtype,
            device=engine.runner.device,
        )
    to_run = build_methods(
        engine,
        exit_layer=exit_layer,
        num_draft_tokens=num_draft_tokens,
        lookup_tokens=lookup_tokens,
        temperatures=temperatures,
        draft_model=loaded_draft,
        tree_nodes=tree_nodes,
    )
    to_run = filter_methods(to_run, chosen_methods)
    if extra_methods is not None:
        to_run += extra_methods(engine)
    on_cuda = engine.runner.device.type == "cuda"
    report = BenchReport(
        settings={
            "model": display_name(model),  # a real model's short name, never its file in the cache
            "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype),
            "threads": torch.get_num_threads(),
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "exit_layer": exit_layer,
            "num_draft_tokens": num_draft_tokens,
            "auto_exit_layer": engine.exit_layer,
            "auto_num_draft_tokens": engine.num_draft_tokens,
            "lookup_tokens": lookup_tokens,
            "tree_nodes": list(tree_nodes),
            "batching": engine.batching,
            "categories": {c: len(v) for c, v in sets.items()},
            "methods": list(methods) if methods is not None else "all",
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "machine": machine_fingerprint(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_average_before": [round(x, 2) for x in os.getloadavg()],
            "plan": engine.plan.summary() if engine.plan is not None else None,
            "verify_cost": engine.calibration.get("verify_cost"),
        }
    )
    # warm up every method once (first-call costs are not decoding speed)
    for method in to_run:
        method.generate(prompts[0][2], 8, 0)

    total = repeats * len(prompts) * len(to_run)
    bar = tqdm(total=total, desc="benchmark", disable=not progress)
    for repeat in range(repeats):
        shift = repeat % len(to_run)
        order = to_run[shift:] + to_run[:shift]
        for category, index, ids in prompts:
            for method in order:
                if on_cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                tokens, stats = method.generate(ids, max_new_tokens, 1000 * repeat + index)
                if on_cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                report.runs.append(
                    Run(
                        method=method.name,
                        category=category,
                        prompt=index,
                        repeat=repeat,
                        new_tokens=len(tokens),
                        seconds=seconds,
                        token_ids=tokens,
                        tau=stats.mean_accepted_length if stats is not None else None,
                        acceptance_rate=stats.acceptance_rate if stats is not None else None,
                        peak_memory_mb=torch.cuda.max_memory_allocated() / 2**20 if on_cuda else None,
                        draft_seconds=stats.draft_seconds if stats is not None else None,
                        verify_seconds=stats.verify_seconds if stats is not None else None,
                        target_forwards=stats.target_forwards if stats is not None else None,
                    )
                )
                bar.update()
    bar.close()
    report.methods = summarise(report.runs, to_run)
    report.settings["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    report.settings["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return report


def _rate(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(r.new_tokens for r in runs) / seconds if seconds else 0.0


def profile(runs: list[Run]) -> dict[str, float] | None:
    """Where the time goes, in milliseconds per generated token.

    Draft, verify (target forwards, the prefill included), overhead (the rest: acceptance,
    cache, bookkeeping), and target forwards per token. ``None`` for methods without
    selfspec's statistics (transformers).
    """
    timed = [r for r in runs if r.draft_seconds is not None and r.verify_seconds is not None]
    tokens = sum(r.new_tokens for r in timed)
    if not timed or not tokens:
        return None
    total = sum(r.seconds for r in timed)
    draft = sum(r.draft_seconds or 0.0 for r in timed)
    verify = sum(r.verify_seconds or 0.0 for r in timed)
    return {
        "total_ms_per_token": round(1000 * total / tokens, 3),
        "draft_ms_per_token": round(1000 * draft / tokens, 3),
        "verify_ms_per_token": round(1000 * verify / tokens, 3),
        "overhead_ms_per_token": round(1000 * (total - draft - verify) / tokens, 3),
        "target_forwards_per_token": round(sum(r.target_forwards or 0 for r in timed) / tokens, 3),
    }


def plain_reference(name: str, baseline: str) -> str | None:
    """The selfspec plain loop a selfspec method is compared with (same temperature), if any."""
    if not name.startswith("selfspec_") or name.startswith("selfspec_plain"):
        return None
    if baseline == "hf_greedy":
        return "selfspec_plain"
    if baseline.startswith("hf_sample_t"):
        return "selfspec_plain_t" + baseline.removeprefix("hf_sample_t")
    return None


def summarise(runs: list[Run], methods: list[Method]) -> dict[str, dict[str, Any]]:
    """Per method: tokens/s (overall and per repeat), speedup, tau, acceptance, exactness, profile.

    Selfspec methods are also compared with selfspec's own plain loop at the same temperature
    (``vs_plain``, overall and per category, with the per-repeat range), where it ran.
    """
    by_method: dict[str, list[Run]] = {}
    for run in runs:
        by_method.setdefault(run.method, []).append(run)
    greedy_reference = {(r.category, r.prompt, r.repeat): r.token_ids for r in by_method.get("hf_greedy", [])}
    plain_reference_ids = {(r.category, r.prompt, r.repeat): r.token_ids for r in by_method.get("selfspec_plain", [])}
    summary: dict[str, dict[str, Any]] = {}
    for method in methods:
        mine = by_method.get(method.name, [])
        base = by_method.get(method.baseline, [])
        per_repeat = [_rate([r for r in mine if r.repeat == k]) for k in sorted({r.repeat for r in mine})]
        categories = sorted({r.category for r in mine})
        per_category = {}
        for cat in categories:
            mine_c = [r for r in mine if r.category == cat]
            base_c = [r for r in base if r.category == cat]
            taus = [r.tau for r in mine_c if r.tau is not None]
            repeats = sorted({r.repeat for r in mine_c})
            per_repeat_speedup = [
                round(_rate([r for r in mine_c if r.repeat == k]) / _rate([r for r in base_c if r.repeat == k]), 3)
                for k in repeats
                if any(r.repeat == k for r in base_c)
            ]
            per_category[cat] = {
                "tokens_per_second": round(_rate(mine_c), 2),
                "speedup": round(_rate(mine_c) / _rate(base_c), 3) if base_c else None,
                "speedup_per_repeat": per_repeat_speedup,
                "tau": round(statistics.mean(taus), 3) if taus else None,
            }
            plain_name = plain_reference(method.name, method.baseline)
            plain_c = [r for r in by_method.get(plain_name or "", []) if r.category == cat]
            if plain_c:
                per_category[cat]["vs_plain"] = round(_rate(mine_c) / _rate(plain_c), 3)
                ratios = [
                    round(_rate([r for r in mine_c if r.repeat == k]) / _rate([r for r in plain_c if r.repeat == k]), 3)
                    for k in repeats
                    if any(r.repeat == k for r in plain_c)
                ]
                per_category[cat]["vs_plain_per_repeat"] = ratios
                per_category[cat]["vs_plain_median"] = round(statistics.median(ratios), 3) if ratios else None
        taus = [r.tau for r in mine if r.tau is not None]
        rates = [r.acceptance_rate for r in mine if r.acceptance_rate is not None]
        identical = identical_plain = None
        if method.greedy and greedy_reference:
            identical = all(r.token_ids == greedy_reference[(r.category, r.prompt, r.repeat)] for r in mine)
        if method.greedy and plain_reference_ids and method.name != "hf_greedy":
            identical_plain = all(r.token_ids == plain_reference_ids[(r.category, r.prompt, r.repeat)] for r in mine)
        memory = [r.peak_memory_mb for r in mine if r.peak_memory_mb is not None]
        summary[method.name] = {
            "description": method.description,
            "baseline": method.baseline,
            "tokens_per_second": round(_rate(mine), 2),
            "tokens_per_second_median_repeat": round(statistics.median(per_repeat), 2) if per_repeat else None,
            "tokens_per_second_spread": [round(min(per_repeat), 2), round(max(per_repeat), 2)] if per_repeat else None,
            "speedup": round(_rate(mine) / _rate(base), 3) if base else None,
            "tau": round(statistics.mean(taus), 3) if taus else None,
            "acceptance_rate": round(statistics.mean(rates), 3) if rates else None,
            "identical_to_greedy": identical,
            "identical_to_plain": identical_plain,
            "peak_memory_mb": round(max(memory), 1) if memory else None,
            "profile": profile(mine),
            "per_category": per_category,
        }
        plain_runs = by_method.get(plain_reference(method.name, method.baseline) or "", [])
        if plain_runs:
            summary[method.name]["vs_plain"] = round(_rate(mine) / _rate(plain_runs), 3)
            ratios = [
                _rate([r for r in mine if r.repeat == k]) / _rate([r for r in plain_runs if r.repeat == k])
                for k in sorted({r.repeat for r in mine})
                if any(r.repeat == k for r in plain_runs)
            ]
            summary[method.name]["vs_plain_per_repeat"] = [round(x, 3) for x in ratios]
            summary[method.name]["vs_plain_median"] = round(statistics.median(ratios), 3) if ratios else None
    return summary


def format_table(report: BenchReport) -> str:
    """A markdown table of the summary, one row per method."""
    lines = [
        "| method | tok/s | spread (per repeat) | speedup | tau | acceptance | identical to greedy "
        "| identical to plain |",
        "|---|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for name, m in report.methods.items():
        spread = m["tokens_per_second_spread"]
        ident = {True: "yes", False: "NO", None: "n/a (sampling)"}[m["identical_to_greedy"]]
        plain = {True: "yes", False: "NO", None: "-"}[m.get("identical_to_plain")]
        lines.append(
            f"| {name} | {m['tokens_per_second']:.1f} | {spread[0]:.1f}-{spread[1]:.1f} | "
            f"{m['speedup']:.2f}x vs {m['baseline']} | {_fmt(m['tau'])} | {_fmt(m['acceptance_rate'])} | {ident} "
            f"| {plain} |"
        )
    return "\n".join(lines)


def format_category_table(report: BenchReport) -> str:
    """Speedup (and tau) per method and category, greedy methods only."""
    names = [n for n, m in report.methods.items() if m["baseline"] == "hf_greedy"]
    categories = list(report.settings["categories"])
    lines = ["| method | " + " | ".join(categories) + " |", "|---|" + "---:|" * len(categories)]
    for name in names:
        cells = []
        for cat in categories:
            c = report.methods[name]["per_category"].get(cat, {})
            tau = f" (tau {c['tau']:.2f})" if c.get("tau") is not None else ""
            cells.append(f"{c.get('speedup', 0):.2f}x{tau}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_plain_table(report: BenchReport) -> str:
    """Each selfspec method against selfspec's own plain loop at the same temperature, per category.

    Cells: the median over repeats of the ratio of tokens per second, with its range over repeats.
    """
    names = [n for n, m in report.methods.items() if m.get("vs_plain") is not None]
    if not names:
        return ""
    categories = list(report.settings["categories"])
    lines = [
        "| method | overall | " + " | ".join(categories) + " |",
        "|---|---:|" + "---:|" * len(categories),
    ]
    for name in names:
        cells = []
        for cat in categories:
            c = report.methods[name]["per_category"].get(cat, {})
            cells.append(_median_cell(c.get("vs_plain_median"), c.get("vs_plain_per_repeat") or []))
        m = report.methods[name]
        overall = _median_cell(m.get("vs_plain_median", m["vs_plain"]), m.get("vs_plain_per_repeat") or [])
        lines.append(f"| {name} | {overall} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_profile_table(report: BenchReport) -> str:
    """Where the time goes: milliseconds per generated token in drafting, verifying and the rest."""
    rows = [(n, m["profile"]) for n, m in report.methods.items() if m.get("profile")]
    if not rows:
        return ""
    lines = [
        "| method | total ms/token | draft | verify | overhead | target forwards/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, p in rows:
        lines.append(
            f"| {name} | {p['total_ms_per_token']:.1f} | {p['draft_ms_per_token']:.1f} | "
            f"{p['verify_ms_per_token']:.1f} | {p['overhead_ms_per_token']:.1f} | "
            f"{p['target_forwards_per_token']:.2f} |"
        )
    return "\n".join(lines)


def _median_cell(median: float | None, spread: list[float]) -> str:
    if median is None:
        return "-"
    return f"{median:.2f}x ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else f"{median:.2f}x"


def _section(title: str, table: str) -> str:
    return f"\n## {title}\n\n{table}\n" if table else ""


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def write_report(report: BenchReport, out_dir: str | Path, name: str = "bench") -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` (speedup per method and category)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    atomic_write_text(paths[0], json.dumps(report.to_json(), indent=2) + "\n")
    settings = report.settings
    header = (
        f"# selfspec benchmark: {settings['model']} on {settings['device']} ({settings['dtype']}, "
        f"{settings['threads']} thread(s))\n\n{settings['max_new_tokens']} new tokens, {settings['repeats']} repeats, "
        f"methods interleaved in one process; {settings['date']}.\n\n" + _context_lines(settings)
    )
    atomic_write_text(
        paths[1],
        header
        + format_table(report)
        + "\n\n## Speedup per category (greedy)\n\n"
        + format_category_table(report)
        + "\n"
        + _section(
            "Against selfspec's own plain loop at the same temperature (median of the per-repeat ratios of "
            "tokens/s, range over repeats)",
            format_plain_table(report),
        )
        + _section(
            "Where the time goes (milliseconds per generated token: drafting, target forwards incl. the prefill, "
            "the rest of the loop)",
            format_profile_table(report),
        ),
    )
    try:
        paths.append(_plot(report, out / f"{name}.png"))
    except ImportError:  # matplotlib is an optional extra: say so, do not skip silently
        logger.warning("no %s.png: matplotlib is not installed (pip install 'selfspec[bench]')", name)
    return paths


def _context_lines(settings: dict[str, Any]) -> str:
    """The machine, its load, the plan ``auto`` ran and the calibrated verify-cost curve (when recorded)."""
    lines = []
    if settings.get("machine"):
        lines.append(f"Machine: {settings['machine']}.")
    if settings.get("load_average_before"):
        lines.append(
            f"Load average {settings['load_average_before']} before, {settings.get('load_average_after')} after "
            "(a shared machine: read ratios, not absolute times)."
        )
    if settings.get("plan"):
        lines.append(f"`auto` plan: {settings['plan']}.")
    curve = settings.get("verify_cost")
    if curve:
        shown = ", ".join(f"{k}: {float(v):.2f}" for k, v in sorted(curve.items(), key=lambda kv: int(kv[0])))
        lines.append(f"Calibrated verify cost (drafts: plain steps): {shown}.")
    return "".join(f"{line}\n" for line in lines) + ("\n" if lines else "")


def method_colours(names: Sequence[str]) -> dict[str, Any]:
    """One distinct colour per method (tab20, then tab20b and tab20c for longer lists)."""
    import matplotlib

    palette: list[Any] = []
    for name in ("tab20", "tab20b", "tab20c"):
        cmap = matplotlib.colormaps[name]
        palette += [cmap(i) for i in range(cmap.N)]
    if len(names) > len(palette):  # more methods than listed colours: sample a continuous map
        cmap = matplotlib.colormaps["turbo"]
        return {n: cmap(i / max(1, len(names) - 1)) for i, n in enumerate(names)}
    return dict(zip(names, palette, strict=False))


def _plot(report: BenchReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, m in report.methods.items() if m["baseline"] == "hf_greedy"]
    categories = list(report.settings["categories"])
    colours = method_colours(names)
    fig, ax = plt.subplots(figsize=(max(12, 1.2 * len(categories) * max(1, len(names)) / 6), 5.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        cells = [report.methods[name]["per_category"].get(c, {}) for c in categories]
        values = [c.get("speedup") or 0 for c in cells]
        spread = [c.get("speedup_per_repeat") or [v] for c, v in zip(cells, values, strict=True)]
        errors = [
            [max(0.0, v - min(r)) for v, r in zip(values, spread, strict=True)],
            [max(0.0, max(r) - v) for v, r in zip(values, spread, strict=True)],
        ]
        ax.bar(
            [x + i * width for x in range(len(categories))],
            values,
            width,
            label=name,
            color=colours[name],
            yerr=errors,
            error_kw={"elinewidth": 0.8, "capsize": 1.5, "ecolor": "0.25"},
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=15)
    ax.set_ylabel("speedup vs transformers greedy generate")
    ax.set_title(
        f"{Path(str(report.settings['model'])).name} on {report.settings['device']}, greedy, "
        f"{report.settings['threads']} thread(s); bars: overall, whiskers: per-repeat range"
    )
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=110, format="png")
    plt.close(fig)
    return path
