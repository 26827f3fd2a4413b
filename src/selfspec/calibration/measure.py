"""Calibration: measure every applicable method on this model and hardware, and choose a plan.

On the model's own greedy continuations of a small built-in prompt mix it measures, per
position, whether each exit layer's greedy token (through an exit adapter where one is
present) would have been accepted; and on this hardware, with repeated interleaved timings
taken as medians and checked for monotonicity (re-measured when they are not), the cost of a
draft step at each exit layer and of verifying ``k`` drafts, relative to one plain step. Then
every registered drafter whose registration declares a ``calibration``
(:class:`~selfspec.drafting.planning.DrafterCalibration`) measures what it needs of its own
(a layer subset's agreement, a learned head's chains) through a :class:`MeasureContext` and
offers its candidates, each replayed over the continuations (:func:`replay`: tokens per
plain-step cost, plain decoding being 1.0). No drafter is named here. The fastest becomes the
:class:`~selfspec.drafting.auto.Plan` that ``drafter="auto"`` runs, and plain decoding when
nothing beats it by a margin.

The classic estimate is kept as :func:`expected_speedup`: with per-token acceptance ``a``,
draft length ``k``, draft cost ``c`` and verify cost ``v_k``, a round emits on average
``(1 - a^(k+1)) / (1 - a)`` tokens for ``k c + v_k`` step-costs (Leviathan et al. 2023).
"""

from __future__ import annotations

import itertools
import logging
import math
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import torch

from ..core.speed import AcceptanceEstimate, CostModel, expected_tokens, next_draft_length
from ..decoding.config import DEFAULT_CALIBRATION_BUDGET
from ..decoding.engine import SpeculativeEngine
from ..decoding.static_round import static_rounds
from ..drafting.auto import PLAIN_MARGIN, Plan
from ..drafting.planning import PLAIN, Candidate, DrafterCalibration
from ..drafting.registry import registered
from ..errors import ConfigurationError
from ..modeling.static_step import StaticStep, bucket_for, static_prefill, width_for
from ..prompts import CHAT_CALIBRATION_PROMPTS, DEFAULT_CALIBRATION_PROMPTS, PASSAGES
from .precision import describe_precision, measure_precision, precision_skip_reason
from .progress import CalibrationProgress, ProgressMode, progress_mode
from .store import load_per_core, machine_fingerprint, save_or_keep_calibration

logger = logging.getLogger(__name__)


def default_prompts(engine: SpeculativeEngine) -> list[Any]:
    """The built-in prompt mix for ``engine``'s model (token ids when it has no tokenizer)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return [[1, 2, 3, 4, 5, 6, 7, 8], [5, 9, 5, 9, 11, 5, 9, 5]]
    if getattr(tokenizer, "chat_template", None) is None:
        return list(DEFAULT_CALIBRATION_PROMPTS)
    from ..modeling.loading import DEMO_MODEL, demo_model_path

    if engine.name_or_path in (DEMO_MODEL, str(demo_model_path())):  # trained on Austen: its own kind of text
        return [
            *DEFAULT_CALIBRATION_PROMPTS[:4],
            [{"role": "user", "content": "Summarize the following passage.\n\n" + PASSAGES[2]}],
            [{"role": "user", "content": "Context:\n" + PASSAGES[3] + "\n\nQuestion: Who watched them?"}],
        ]
    return [list(p) for p in CHAT_CALIBRATION_PROMPTS]


@dataclass
class CalibrationResult:
    """What calibration measured and chose.

    Attributes:
        exit_layer: the best early-exit layer (what ``exit_layer="auto"`` uses).
        num_draft_tokens: its draft length.
        expected_speedup: that early exit's predicted speedup over plain decoding (may be < 1).
        agreement: greedy agreement of each exit layer with the last layer.
        draft_cost: cost of one draft step at each exit layer, relative to a plain step.
        verify_cost: cost of verifying ``k`` drafts (``k + 1`` tokens), relative to a plain step.
        sampled_verify_cost: the same for a round whose logits are all read (sampling, a grammar,
            log-probabilities), where greedy rounds take the argmax from the exact-argmax head
            (:mod:`selfspec.modeling.argmax_head`) and cost less; empty where they cost the same.
        step_seconds: median seconds of one plain one-token step.
        figures: what the registered drafters' calibrations saved (top-level ``selfspec.json``
            entries, by the drafter that saved them; e.g. an EAGLE head's figures).
        notes: one line per drafter on what it saved (``selfspec calibrate`` prints them).
        tree_speed: with ``trees=True``: measured greedy tokens per second of the chain and
            of each early-exit tree node budget.
        tree_nodes: with ``trees=True``: the fastest, ``None`` when the chain was fastest.
        plan: what ``drafter="auto"`` runs (:class:`~selfspec.drafting.auto.Plan`).
        plan_draft_cost: the planned drafter's cost per drafted token (the online guard's cost model).
        candidates: every candidate's predicted speedup over plain decoding, by its label.
        cost_checks: how many times the cost curves were re-measured for not being monotonic,
            and whether they were finally made monotonic by hand.
        sampled_plan: what ``drafter="auto"`` runs when a request samples: the plan replayed on the
            model's own sampled continuations (:func:`measure_sampled_plan`); plain decoding where
            sampled drafts do not pay; ``None`` when not measured (skipped for the budget).
        calibration_budget: the time budget in seconds (``None``: none).
        seconds: how long calibration took.
        skipped: the measurements left out or cut short for the budget (the drafters whose own
            measurement was left out were not candidates).
        phase_seconds: how long each phase took (``continuations``, ``acceptance``, ``costs``,
            ``drafters``, ``sampled``, ``precision``, ``trees``: those that ran).
        dropped: the drafters (figures keys) measured only on the pilot, whose acceptance could
            not pay there (:func:`measure_drafters`); they were not candidates.
    """

    exit_layer: int
    num_draft_tokens: int
    expected_speedup: float
    agreement: dict[int, float] = field(default_factory=dict)
    draft_cost: dict[int, float] = field(default_factory=dict)
    verify_cost: dict[int, float] = field(default_factory=dict)
    sampled_verify_cost: dict[int, float] = field(default_factory=dict)
    step_seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tree_speed: dict[str, float] = field(default_factory=dict)
    tree_nodes: int | None = None
    plan: Plan = field(default_factory=Plan)
    plan_draft_cost: float = 0.0
    candidates: dict[str, float] = field(default_factory=dict)
    cost_checks: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = ""
    sampled_plan: Plan | None = None
    calibration_budget: float | None = None
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    precision: dict[str, Any] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    @property
    def predicted_tokens_per_second(self) -> dict[str, float]:
        """Each candidate's predicted tokens per second on this hardware."""
        if self.step_seconds <= 0:
            return {}
        return {name: speed / self.step_seconds for name, speed in self.candidates.items()}

    def to_json(self) -> dict[str, Any]:
        """The calibration file's content (``selfspec.json``)."""
        data = asdict(self)
        del data["notes"], data["plan_draft_cost"]
        data.update(data.pop("figures"))
        if not self.tree_speed:  # not measured: "auto" falls back to the default
            del data["tree_speed"], data["tree_nodes"]
        else:
            data["tree_speed"] = {k: round(v, 2) for k, v in self.tree_speed.items()}
        for key in ("agreement", "draft_cost", "verify_cost", "sampled_verify_cost"):
            data[key] = {str(k): round(v, 4) for k, v in data[key].items()}
        if not self.sampled_verify_cost:
            del data["sampled_verify_cost"]
        data["expected_speedup"] = round(self.expected_speedup, 3)
        data["plan"] = self.plan.to_json()
        data["sampled_plan"] = None if self.sampled_plan is None else self.sampled_plan.to_json()
        data["seconds"] = round(self.seconds, 1)
        data["phase_seconds"] = {k: round(v, 1) for k, v in self.phase_seconds.items()}
        data["candidates"] = {k: round(v, 3) for k, v in sorted(self.candidates.items(), key=lambda kv: -kv[1])}
        data["predicted_tokens_per_second"] = {k: round(v, 1) for k, v in self.predicted_tokens_per_second.items()}
        data["costs"] = {
            "draft": round(self.plan_draft_cost, 4),
            "verify": {str(k): round(v, 4) for k, v in self.verify_cost.items()},
        }
        if self.sampled_verify_cost:
            data["costs"]["verify_sampled"] = {str(k): round(v, 4) for k, v in self.sampled_verify_cost.items()}
        data["source"] = "calibrate"
        data["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data["hardware"] = f"{platform.machine()} {self.device} {self.dtype} {torch.get_num_threads()} threads"
        data["machine"] = machine_fingerprint()
        return data


def expected_speedup(agreement: float, draft_cost: float, verify_cost: float, num_draft: int) -> float:
    """Expected tokens per unit of plain-step cost: ``(1 - a^(k+1)) / ((1 - a)(k c + v))``."""
    return expected_tokens(agreement, num_draft) / (num_draft * draft_cost + verify_cost)


def choose(
    agreement: dict[int, float], draft_cost: dict[int, float], verify_cost: dict[int, float]
) -> tuple[int, int, float]:
    """The ``(exit_layer, num_draft_tokens, expected speedup)`` that maximises expected speed.

    The speedup may be below 1: the caller compares it with plain decoding.
    """
    best = (min(agreement), 1, 0.0)
    for layer, a in agreement.items():
        for k, v in verify_cost.items():
            speed = expected_speedup(a, draft_cost[layer], v, k)
            if speed > best[2]:
                best = (layer, k, speed)
    return best


# ----------------------------------------------------------------------------- acceptance


@dataclass
class Continuations:
    """The model's own greedy continuations: ``sequences[i]`` is prompt + new tokens, new from ``starts[i]``."""

    sequences: list[list[int]]
    starts: list[int]

    @property
    def num_tokens(self) -> int:
        """How many generated tokens there are in all."""
        return sum(len(s) - start for s, start in zip(self.sequences, self.starts, strict=True))


def generate_continuations(
    engine: SpeculativeEngine,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    *,
    until: float | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
) -> Continuations:
    """Plain greedy continuations of each prompt (what any lossless method must reproduce).

    With ``until`` (a ``time.perf_counter()`` time), a prompt that the mean so far says would end
    past it is left out, with those after it (the first is always continued); ``on_prompt(done,
    total)`` follows each prompt.
    """
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter=PLAIN, calibration={})
    sequences: list[list[int]] = []
    started = time.perf_counter()
    for ids in prompt_ids:
        mean = (time.perf_counter() - started) / max(len(sequences), 1)
        if sequences and until is not None and time.perf_counter() + mean >= until:  # it would end past it
            break
        sequences.append(ids + plain.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids)
        if on_prompt is not None:
            on_prompt(len(sequences), len(prompt_ids))
    return Continuations(sequences, [len(ids) for ids in prompt_ids[: len(sequences)]])


def exit_matches(
    engine: SpeculativeEngine, data: Continuations, layers: Sequence[int], exit_adapter: Any = None
) -> tuple[dict[int, list[list[bool]]], list[list[int]]]:
    """Per sequence and generated position: does exit layer ``E``'s greedy token equal the model's?

    Teacher-forced on the continuations (one forward per sequence). With ``exit_adapter``, the
    adapter's layer is read through it. Also returns the last layer's greedy tokens.
    """
    runner = engine.runner
    matches: dict[int, list[list[bool]]] = {layer: [] for layer in layers}
    with torch.inference_mode():
        for sequence, start in zip(data.sequences, data.starts, strict=True):
            ids = torch.tensor([sequence], device=runner.device)
            cache = runner.new_cache(ids.shape[1])
            hidden = runner.embed(ids)
            positions = torch.arange(ids.shape[1], device=runner.device)
            done = 0
            exits: dict[int, torch.Tensor] = {}
            for layer in sorted(layers):
                hidden = runner.run_layers(hidden, done, layer, positions, cache)
                done = layer
                state = hidden[:, start - 1 : -1]
                if exit_adapter is not None and layer == exit_adapter.exit_layer:
                    state = exit_adapter(state)
                exits[layer] = runner.logits(state).argmax(-1)
            final = runner.run_layers(hidden, done, runner.num_layers, positions, cache)
            target = torch.tensor(sequence[start:], device=runner.device)
            check = runner.logits(final[:, start - 1 : -1]).argmax(-1)
            if not torch.equal(check, target):  # rare near-ties in the full forward: trust the sequence
                logger.debug("teacher-forced greedy differs from the generated text at some positions")
            for layer, tokens in exits.items():
                matches[layer].append((tokens == target).tolist())
    return matches, []


def agreement_of(matches: list[list[bool]]) -> float:
    """The fraction of positions that match."""
    total = sum(len(m) for m in matches)
    return sum(sum(m) for m in matches) / max(total, 1)


def measure_agreement(
    engine: SpeculativeEngine, prompt_ids: Sequence[list[int]], layers: Sequence[int], max_new_tokens: int
) -> dict[int, float]:
    """Greedy agreement of each exit layer with the last layer, on the model's own continuations."""
    data = generate_continuations(engine, prompt_ids, max_new_tokens)
    matches, _ = exit_matches(engine, data, layers)
    return {layer: agreement_of(matches[layer]) for layer in layers}


# ----------------------------------------------------------------------------- costs


#: Timed runs every variant of the cost curves gets before it may settle.
MIN_TURNS = 3
#: A cost curve "dips" where a point is more than this fraction below the one before it.
MONOTONIC_TOLERANCE = 0.03
#: A run that lowers a variant's fastest time by no more than this fraction leaves it where it was
#: (the tolerance of the monotonicity check: finer than that changes no decision).
SETTLED = MONOTONIC_TOLERANCE
#: A variant whose fastest time that many runs in a row left where it was is timed no more.
QUIET_RUNS = 2


def _interleaved_fastest(
    variants: dict[Any, Callable[[], None]],
    repeats: int,
    *,
    until: float | None = None,
    on_turn: Callable[[int, int], None] | None = None,
    essential: int | None = None,
    on_cut: Callable[[], None] | None = None,
) -> dict[Any, float]:
    """Fastest seconds of each variant, timed round-robin.

    Round-robin so that machine noise hits every variant alike; the fastest run rather than the
    median, because other work on a shared machine only ever adds time: under load (a busy
    2-core CPU) medians of multi-token forwards rose more than those of one-token steps and made
    every draft look too dear, so a busy first load settled on plain decoding. With ``until`` (a
    ``time.perf_counter()`` time) no turn starts that the last one's length says would end after
    it; when the warm-up turn already ended past it, the warm-up's own times are what is returned
    (a tight budget's price: a first run is a little slower); and the warm-up itself stops past it
    once the first ``essential`` variants are warm (the others are left out of the result: a tight
    budget's curve has only its essential points). ``on_turn(done, repeats)`` follows each turn;
    ``on_cut()`` is called when ``until`` ends the turns (not when every variant settled).

    A variant is timed no more once it has settled: after :data:`MIN_TURNS` runs, when its last
    :data:`QUIET_RUNS` runs each lowered its fastest time by no more than :data:`SETTLED` (noise on
    a shared machine only adds time, so a minimum that held twice is not waiting for a luckier
    run); the turns end when every variant has settled or after ``repeats``.
    """
    essential = len(variants) if essential is None else essential
    warm: dict[Any, float] = {}
    for position, (key, fn) in enumerate(variants.items()):  # warm up
        if position >= essential and until is not None and time.perf_counter() >= until:
            break  # the rest is left out: the budget has no time for it
        started = time.perf_counter()
        fn()
        warm[key] = time.perf_counter() - started
    variants = {key: variants[key] for key in warm}
    fastest = dict.fromkeys(variants, math.inf)
    quiet = dict.fromkeys(variants, 0)
    last_turn = 0.0
    for turn in range(repeats):
        if until is not None and time.perf_counter() + last_turn >= until:  # (a turn would end past it)
            if on_cut is not None:
                on_cut()
            if not turn:
                return warm
            break
        turn_started = time.perf_counter()
        keys = [key for key in variants if turn < MIN_TURNS or quiet[key] < QUIET_RUNS]
        if not keys:  # every variant settled
            break
        keys = keys[turn % len(keys) :] + keys[: turn % len(keys)]
        for key in keys:
            started = time.perf_counter()
            variants[key]()
            seconds = time.perf_counter() - started
            quiet[key] = quiet[key] + 1 if seconds >= fastest[key] * (1 - SETTLED) else 0
            fastest[key] = min(fastest[key], seconds)
        last_turn = time.perf_counter() - turn_started
        if on_turn is not None:
            on_turn(turn + 1, repeats)
    return fastest


def _interpolated(values: dict[int, float], keys: Sequence[int]) -> dict[int, float]:
    """``values`` at every one of ``keys``: the missing ones linear between their measured neighbours."""
    known = sorted(values)
    if not known:
        return values
    out = {}
    for key in keys:
        if key in values:
            out[key] = values[key]
            continue
        below = max((k for k in known if k < key), default=known[0])
        above = min((k for k in known if k > key), default=known[-1])
        share = (key - below) / (above - below) if above != below else 0.0
        out[key] = values[below] + share * (values[above] - values[below])
    return out


def _offending(values: dict[int, float], tolerance: float = MONOTONIC_TOLERANCE) -> list[int]:
    """The keys on either side of each dip of more than ``tolerance`` (none: the curve is monotonic)."""
    ordered = sorted(values)
    found: list[int] = []
    for a, b in itertools.pairwise(ordered):
        if values[b] < values[a] * (1 - tolerance):
            found += [key for key in (a, b) if key not in found]
    return found


def _running_max(values: dict[int, float]) -> dict[int, float]:
    out, top = {}, 0.0
    for key in sorted(values):
        top = max(top, values[key])
        out[key] = top
    return out


#: Verify lengths measured beyond the draft lengths, up to 32 drafts: where verifying is nearly
#: free (half precision, GPUs) long lookup copies and confident chains pay (issue 28).
LONG_VERIFY_LENGTHS = (12, 16, 24, 32)


def verify_lengths(max_draft_tokens: int, window: int | None = None) -> list[int]:
    """The draft lengths whose verify cost calibration measures.

    1 to ``max_draft_tokens``, then :data:`LONG_VERIFY_LENGTHS` beyond it (as far as the
    context ``window`` leaves room).
    """
    lengths = list(range(1, max_draft_tokens + 1)) + [k for k in LONG_VERIFY_LENGTHS if k > max_draft_tokens]
    return [k for k in lengths if window is None or k + 2 < window // 2] or [1]


#: What ``checks["path"]`` and :attr:`Plan.measured <selfspec.drafting.auto.Plan.measured>` say
#: when the eager loop's forwards were timed (the static round's: ``"static round (<backend>)"``).
EAGER_PATH = "eager loop"


class _EagerSteps:
    """The eager loop's forwards over the cost prompt's cache: ``steps(kind, n)`` is one timed run.

    Kinds: ``("full", 1)`` the plain step, ``("verify", k)`` a verify of ``k`` drafts (both through
    the exact-argmax head where the runner screens), ``("draft", E)`` one token through layers
    ``[0, E)`` and the LM head, ``("sampled", k)`` a verify reading every logit (``k = 0``: one token).
    """

    def __init__(self, engine: SpeculativeEngine, prompt_ids: list[int], longest: int) -> None:
        runner = self.runner = engine.runner
        self.prompt_ids = prompt_ids
        self.cache = runner.new_cache(len(prompt_ids) + longest + 2)
        self.screened = bool(runner.argmax_screen and runner.argmax_head is not None)
        ids = torch.tensor([prompt_ids], device=runner.device)
        positions = torch.arange(len(prompt_ids), device=runner.device)
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, positions, self.cache)

    def __call__(self, kind: str, n: int) -> Callable[[], None]:
        runner, cache, length = self.runner, self.cache, len(self.prompt_ids)
        end = n if kind == "draft" else runner.num_layers
        num_tokens = 1 if kind in ("full", "draft") else n + 1
        argmax_only = self.screened and kind in ("full", "verify")
        tokens = _tokens(self.prompt_ids, num_tokens, runner.device)
        positions = torch.arange(length, length + num_tokens, device=runner.device)

        def run() -> None:
            hidden = runner.run_layers(runner.embed(tokens), 0, end, positions, cache)
            runner.logits(hidden, argmax_only)
            _synchronize(runner.device)
            cache.crop_to(length)

        return run


class _StaticSteps:
    """The static round's compiled steps over the cost prompt's cache (what its calls run, issue 40).

    The same kinds as :class:`_EagerSteps`: ``("full", 1)`` the width-1 greedy step, ``("verify", k)``
    the greedy step of the width that holds ``k`` drafts (:func:`width_for`: a round pads its draft
    to it), ``("draft", E)`` the early exit's compiled draft step at layer ``E``. Greedy and
    sampled rounds run the same forward here (no argmax screen), so no second curve is taken.
    Each step is compiled (run once) before it is timed.
    """

    screened = False

    def __init__(self, step: StaticStep, prompt_ids: list[int], longest: int) -> None:
        self.step, self.prompt_ids = step, prompt_ids
        slots = len(prompt_ids) + width_for(longest) + 1
        self.bucket = bucket_for(slots)
        self.cache = step.reserve(slots)
        device = step.runner.device
        static_prefill(step.runner, self.cache, torch.tensor([prompt_ids], device=device))
        self.saved = self.cache.length.clone()

    def __call__(self, kind: str, n: int) -> Callable[[], None]:
        step, cache, bucket, device = self.step, self.cache, self.bucket, self.step.runner.device
        zero = torch.zeros((), dtype=torch.long, device=device)
        if kind == "draft":
            token = _tokens(self.prompt_ids, 1, device)

            def run() -> None:
                step.exit_draft(token, zero, n, bucket)  # writes past the length: the text is untouched
                _synchronize(device)

        else:
            tokens = _tokens(self.prompt_ids, 1 if kind == "full" else width_for(n), device)
            num_draft = torch.full((), 0 if kind == "full" else n, dtype=torch.long, device=device)

            def run() -> None:
                step.greedy(tokens, num_draft, bucket)
                _synchronize(device)
                cache.length.copy_(self.saved)

        run()  # compiled (or traced) before it is timed
        return run


def _tokens(prompt_ids: list[int], num: int, device: torch.device) -> torch.Tensor:
    """``[1, num]`` token ids: the prompt's last ``num`` (repeated when it is shorter)."""
    return torch.tensor([(prompt_ids * (num // len(prompt_ids) + 1))[-num:]], device=device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(
    engine: SpeculativeEngine, prompt_ids: list[int], longest: int
) -> tuple[_EagerSteps | _StaticSteps, str]:
    """The forwards calibration times, and which path they are: the static round's where it serves the calls.

    An engine with ``compile=`` on (``"auto"`` on CUDA) runs single calls in the static round,
    whose compiled steps cost what they cost there (a width-9 verify 1.08x a width-1 step on an
    H100), not what the eager loop's row-exact verify costs: calibration times those steps.
    """
    try:
        rounds = static_rounds(engine.runner, engine.options.compile)
    except ConfigurationError:  # (the engine refuses such a compile= itself)
        rounds = None
    if rounds is None:
        return _EagerSteps(engine, prompt_ids, longest), EAGER_PATH
    return _StaticSteps(rounds.step, prompt_ids, longest), f"static round ({rounds.step.backend})"


def measure_costs(
    engine: SpeculativeEngine,
    prompt_ids: list[int],
    layers: Sequence[int],
    draft_lengths: Sequence[int],
    repeats: int = 7,
    retries: int = 1,
    checks: dict[str, Any] | None = None,
    sampled: dict[int, float] | None = None,
    *,
    until: float | None = None,
    on_turn: Callable[[int, int], None] | None = None,
) -> tuple[dict[int, float], dict[int, float], float]:
    """Relative costs of a draft step per exit layer and of a verify per draft length.

    Timings are the fastest of up to ``repeats`` interleaved runs (:func:`_interleaved_fastest`: a
    variant whose fastest time held for :data:`QUIET_RUNS` runs is timed no more).
    Where a curve dips by more than 3% (not monotonic), the points on either side of each dip are
    measured again, with the plain step they are relative to, up to ``retries`` times (the rest
    of the curve is kept: it already rose as it should, and re-timing all of it cost SmolLM2's
    first load two thirds of its cost phase). Then the draft
    costs are made monotonic (running maximum: a deeper exit is never cheaper), while a verify
    curve that is still not monotonic is kept as measured: it is the hardware's (fp32 GEMMs on an
    AMD EPYC: 3 rows cost 2.07 steps, 4 rows 1.50): the loop pads a shorter verify to the
    cheapest measured width (:meth:`~selfspec.core.speed.CostModel.padded`) and the planner
    prices draft lengths that way. What happened is recorded in ``checks``, with the machine's
    load average (per core) before and after.

    The forwards timed are those the engine's calls run (:func:`_timed_steps`): the static
    round's compiled steps where ``compile=`` puts single calls there (``checks["path"]`` says
    which), else the eager loop's. There, greedy steps take their argmax from the runner's
    exact-argmax head where it has one (:mod:`selfspec.modeling.argmax_head`), so the plain step
    and the verify curve are measured that way; ``sampled`` (a dict, filled in place) then
    receives the curve of rounds that read every logit (sampling), relative to such a plain step,
    measured in the same interleaved runs.

    With ``until`` (a ``time.perf_counter()`` time: the calibration budget's share for the costs)
    no timing turn starts after it once one is timed, and a curve is measured again only while
    there is time (``checks["turns"]`` counts the turns, ``checks["turns_cut"]`` says the budget
    ended them, ``checks["remeasure_skipped"]`` says a re-measurement was left out);
    ``on_turn(done, planned)`` follows each turn.
    """
    checks = checks if checks is not None else {}
    checks["load_per_core"] = [load_per_core()]
    with torch.inference_mode():
        step, checks["path"] = _timed_steps(engine, prompt_ids, max(draft_lengths))

        # the essential points first (what a tight budget keeps): the plain step, the draft steps and
        # the verifies of the draft lengths; then the long verifies and the sampled curve
        # (of the draft steps, the shallowest and the deepest: the others are interpolated when left out)
        short = [k for k in draft_lengths if k not in LONG_VERIFY_LENGTHS] or list(draft_lengths[:1])
        ends = sorted({min(layers), max(layers)}) if layers else []
        keys: list[tuple[str, int]] = [("full", 1), *(("verify", k) for k in short), *(("draft", n) for n in ends)]
        essential = len(keys)
        keys += [("draft", layer) for layer in layers if layer not in ends]
        keys += [("verify", k) for k in draft_lengths if k not in short]
        if step.screened and sampled is not None:
            keys += [("sampled", 0), *(("sampled", k) for k in draft_lengths)]
        variants: dict[Any, Callable[[], None]] = {key: step(*key) for key in keys}
        checks.setdefault("remeasured", 0)
        checks["turns"] = 0
        planned = repeats  # (a re-measurement adds a few turns of a few points)

        def turned(done: int, _: int) -> None:
            checks["turns"] += 1
            if on_turn is not None:
                on_turn(checks["turns"], max(planned, checks["turns"]))  # (re-timing a dip adds turns)

        def cut() -> None:  # the budget, not settled timings, ended the turns
            checks["turns_cut"] = True

        draft: dict[int, float] = {}
        verify: dict[int, float] = {}
        full = 0.0
        timing = variants
        if sampled is not None:
            sampled.clear()
        for attempt in range(retries + 1):
            seconds = _interleaved_fastest(
                timing,
                repeats,
                until=until,
                on_turn=turned,
                essential=essential if not attempt else 1,
                on_cut=None if attempt else cut,
            )
            if not attempt and len(seconds) < len(variants):
                checks["untimed"] = len(variants) - len(seconds)
                variants = {key: variants[key] for key in seconds}
            reference = seconds[("full", 1)]  # each run's ratios are to its own plain step
            full = full or reference
            draft.update({n: seconds[("draft", n)] / reference for n in layers if ("draft", n) in seconds})
            draft = _interpolated(draft, layers)
            verify.update({k: seconds[("verify", k)] / reference for k in draft_lengths if ("verify", k) in seconds})
            if ("sampled", 0) in seconds and sampled is not None:
                base = seconds[("sampled", 0)]
                sampled.update({k: seconds[("sampled", k)] / base for k in draft_lengths if ("sampled", k) in seconds})
            offending = [("draft", key) for key in _offending(draft)]
            offending += [("verify", key) for key in _offending({0: 1.0, **verify}) if key]
            if not offending:
                checks["monotonic"] = True
                break
            checks["remeasured"] += 1
            if attempt < retries and until is not None and time.perf_counter() >= until:
                checks["monotonic"] = False
                checks["remeasure_skipped"] = True
                draft = _running_max(draft)
                break
            # measure again only where the curve dips: the dipping points, their neighbours, the plain step
            again = {("full", 1), *offending}
            if ("sampled", 0) in variants:
                again |= {("sampled", 0), *(("sampled", k) for kind, k in offending if kind == "verify")}
            timing = {key: run for key, run in variants.items() if key in again}
            checks["remeasured_variants"] = len(timing)
            logger.info("cost curves not monotonic (attempt %d); measuring %d again", attempt + 1, len(timing))
        else:
            checks["monotonic"] = False
            draft = _running_max(draft)
    checks["load_per_core"].append(load_per_core())
    return draft, verify, full


# ----------------------------------------------------------------------------- replay


@dataclass
class Replay:
    """A candidate's replayed run over the continuations."""

    tokens: int = 0
    cost: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def speedup(self) -> float:
        """Tokens per plain-step cost (plain decoding is 1.0)."""
        return self.tokens / self.cost if self.cost else 1.0

    @property
    def tau(self) -> float:
        """Mean tokens per round."""
        return self.tokens / self.rounds if self.rounds else 1.0


def replay(
    data: Continuations,
    costs: CostModel,
    num_draft_tokens: int,
    *,
    matches: list[list[bool]] | None = None,
    lookup: tuple[int, int] | None = None,
    adaptive: bool = True,
    accepted_per_round: Sequence[int] | None = None,
    max_draft_tokens: int | None = None,
) -> Replay:
    """Replay the continuations round by round, as the engine would decode them.

    Each round drafts with prompt lookup (``lookup=(min_ngram, max_ngram)``) when the text's
    last n-gram occurred before, else with the per-position ``matches`` of a model-based
    drafter (accepted up to its first miss), else decodes one plain step. The draft length
    adapts like the engine's controller. Costs come from ``costs``.

    A drafter measured per round instead of per position (an EAGLE head's chains, whose
    later tokens read the head's own predictions) gives ``accepted_per_round``: how many
    tokens its full-length chains had accepted; each round draws one (a fixed seed, so the
    replay is reproducible) and keeps at most its budget. With ``lookup`` as well it drafts
    only in rounds without a copy (a head with copies where the text repeats). An adaptive draft
    changes length by :func:`~selfspec.core.speed.next_draft_length`, up to ``max_draft_tokens``
    (default: the longest length of the cost curve, at least 8).
    """
    from ..drafting.prompt_lookup import NgramIndex

    if max_draft_tokens is None:
        max_draft_tokens = max(8, costs.longest, num_draft_tokens)
    draw = random.Random(0)
    counts = list(accepted_per_round or [])
    result = Replay()
    for i, (sequence, start) in enumerate(zip(data.sequences, data.starts, strict=True)):
        hits = matches[i] if matches is not None else None
        index = NgramIndex(lookup[1]) if lookup is not None else None
        position = start + 1  # the prefill emits the first new token
        result.tokens += 1
        result.cost += 1.0
        current = num_draft_tokens
        estimate = AcceptanceEstimate()  # per sequence, as the engine starts each call afresh
        while position < len(sequence):
            remaining = len(sequence) - position
            budget = max(0, min(current, remaining - 1))
            draft: list[int] = []
            accepted = 0
            model_cost = 0.0
            if index is not None and budget > 0:
                index.update(sequence[:position])
                draft = index.lookup(sequence[:position], lookup[0], budget)  # type: ignore[index]
                for a, b in zip(draft, sequence[position:], strict=False):
                    if a != b:
                        break
                    accepted += 1
            if not draft and hits is not None and budget > 0:
                offset = position - start
                for k in range(budget):
                    if not hits[offset + k]:
                        break
                    accepted += 1
                draft = [0] * budget
                model_cost = costs.draft * budget
            elif counts and budget > 0 and not draft:
                accepted = min(draw.choice(counts), budget)
                draft = [0] * budget
                model_cost = costs.draft * budget
            cost = model_cost + (costs.round_cost(len(draft)) - costs.draft * len(draft) if draft else 1.0)
            emitted = min(accepted + 1, remaining)
            result.tokens += emitted
            result.cost += cost
            result.rounds += 1
            result.drafted += len(draft)
            result.accepted += accepted
            position += emitted
            if adaptive and draft:
                estimate.update(len(draft), accepted)
                current = next_draft_length(current, len(draft), accepted, max_draft_tokens, costs, estimate.rate)
    return result


#: Node budgets that ``calibrate(trees=True)`` races against the chain.
TREE_CANDIDATES = (4, 8, 16)
#: A tree must beat the chain by this factor to be chosen (measurements are noisy).
TREE_MARGIN = 1.03


def measure_tree_speed(
    engine: SpeculativeEngine,
    prompts: Sequence[list[int]],
    exit_layer: int,
    num_draft_tokens: int,
    candidates: Sequence[int] = TREE_CANDIDATES,
    max_new_tokens: int = 32,
    passes: int = 2,
) -> dict[str, float]:
    """Greedy tokens per second of the early-exit chain and of trees of each node budget.

    Interleaved: each pass runs every variant on every prompt, in a rotated order.
    """
    variants = [("chain", None), *((str(n), n) for n in candidates)]
    engines = {
        name: SpeculativeEngine(
            engine.model,
            engine.tokenizer,
            drafter="early_exit",
            exit_layer=exit_layer,
            num_draft_tokens=num_draft_tokens,
            tree_nodes=nodes,
            calibration={},
        )
        for name, nodes in variants
    }
    seconds = dict.fromkeys(engines, 0.0)
    tokens = dict.fromkeys(engines, 0)
    for variant in engines.values():  # warm up
        variant.generate_ids(prompts[0], max_new_tokens=4)
    for turn in range(passes):
        order = list(engines)[turn % len(engines) :] + list(engines)[: turn % len(engines)]
        for prompt in prompts:
            for name in order:
                started = time.perf_counter()
                out = engines[name].generate_ids(prompt, max_new_tokens=max_new_tokens)
                seconds[name] += time.perf_counter() - started
                tokens[name] += len(out.token_ids)
    return {name: tokens[name] / seconds[name] if seconds[name] else 0.0 for name in engines}


def choose_tree_nodes(speeds: dict[str, float]) -> int | None:
    """The fastest tree budget if it beats the chain by :data:`TREE_MARGIN`, else ``None``."""
    trees = {int(k): v for k, v in speeds.items() if k != "chain"}
    if not trees:
        return None
    best = max(trees, key=lambda n: trees[n])
    return best if trees[best] > TREE_MARGIN * speeds.get("chain", 0.0) else None


@dataclass
class MeasureContext:
    """What calibration measured before asking the drafters (:class:`~selfspec.drafting.planning.CalibrationContext`).

    The registered drafters' calibrations (:class:`~selfspec.drafting.planning.DrafterCalibration`)
    read it to measure themselves and to replay their candidates.
    """

    data: Continuations
    matches: dict[int, list[list[bool]]]
    draft_cost: dict[int, float]
    verify_cost: dict[int, float]
    engine: Any = None
    prompt_ids: Sequence[list[int]] = ()
    max_new_tokens: int = 0
    max_draft_tokens: int = 8
    step_seconds: float = 0.0
    exit_adapter_layer: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    sampled_verify_cost: dict[int, float] = field(default_factory=dict)
    best_exit: tuple[int, int, float] = (1, 1, 0.0)

    def __post_init__(self) -> None:
        self.best_exit = best_early_exit(self.data, self.matches, self.draft_cost, self.verify_cost)

    @property
    def lengths(self) -> list[int]:
        """The measured draft lengths, shortest first."""
        return sorted(self.verify_cost)

    def replay(self, costs: CostModel, num_draft_tokens: int, **how: Any) -> Replay:
        """:func:`replay` of these continuations."""
        return replay(self.data, costs, num_draft_tokens, **how)


def best_early_exit(
    data: Continuations,
    matches: dict[int, list[list[bool]]],
    draft_cost: dict[int, float],
    verify_cost: dict[int, float],
) -> tuple[int, int, float]:
    """``(exit layer, draft length, replayed speedup)`` of the fastest early exit (what ``"auto"`` settings use)."""
    lengths = sorted(verify_cost)
    best = (min(matches) if matches else 1, lengths[0], 0.0)
    for layer, hits in matches.items():
        costs = CostModel(draft_cost[layer], verify_cost)
        for k in lengths:
            speed = replay(data, costs, k, matches=hits).speedup
            if speed > best[2]:
                best = (layer, k, speed)
    return best


def _plannable() -> list[tuple[str, DrafterCalibration]]:
    """Every registered drafter calibration considers, in registration order."""
    return [(spec.name, spec.calibration) for spec in registered() if spec.calibration is not None]


def _wanted(key: str, methods: Sequence[str] | None) -> bool:
    """Whether a measurement is needed: some method sharing its figures (``figures_key``, else its name) may win."""
    if methods is None:
        return True
    return any(n in methods for n, hooks in _plannable() if (hooks.figures_key or n) == key)


def _measure_order(context: MeasureContext) -> list[tuple[str, DrafterCalibration]]:
    """The drafters in order of expected value: unknown estimates (learned heads) first, then best estimate first."""
    ranked = []
    for position, (name, hooks) in enumerate(_plannable()):
        estimate = hooks.expected_speedup(name, context)
        ranked.append((estimate is not None, -(estimate or 0.0), position, name, hooks))
    return [(name, hooks) for *_, name, hooks in sorted(ranked, key=lambda r: r[:3])]


#: The pilot a drafter's own measurement runs on first: the first this many new tokens of every
#: continuation (every prompt of the mix), when the continuations are at least twice as long.
PILOT_TOKENS = 12
#: A drafter whose best candidate on the pilot is slower than this factor below the bar (the best
#: candidate that needs no measurement, on the same pilot, or plain decoding's margin) is dropped.
DROP_SLACK = 1.25


def pilot_context(context: MeasureContext, tokens: int = PILOT_TOKENS) -> MeasureContext | None:
    """``context`` cut to the first ``tokens`` new tokens of every continuation (``None``: too short to save much)."""
    if context.max_new_tokens < 2 * tokens or not context.data.sequences:
        return None
    starts = list(context.data.starts)
    cut = [sequence[: start + tokens] for sequence, start in zip(context.data.sequences, starts, strict=True)]
    data = Continuations(cut, starts)
    matches = {layer: [hits[:tokens] for hits in rows] for layer, rows in context.matches.items()}
    return replace(context, data=data, matches=matches, max_new_tokens=tokens)  # best_exit: of the pilot


def _free_bar(pilot: MeasureContext, methods: Sequence[str] | None) -> float:
    """What a measured drafter must beat on the pilot: the best candidate that measures nothing, or plain's margin."""
    speeds = [PLAIN_MARGIN]
    for name, hooks in _plannable():
        if name == PLAIN or type(hooks).measure is not DrafterCalibration.measure:
            continue
        if methods is None or name in methods:
            speeds += [c.speedup for c in hooks.candidates(name, pilot, None)]
    return max(speeds)


def measure_drafters(
    context: MeasureContext,
    methods: Sequence[str] | None = None,
    deadline: Deadline | None = None,
    dropped: list[str] | None = None,
    need: float = 0.0,
) -> dict[str, Any]:
    """Each drafter's own measurement, once per ``figures_key`` (shared by the drafters that declare it).

    With a ``deadline``, in order of expected value, and a measurement that would start past it,
    or with less than ``need`` seconds left (about what one measurement takes: calibration passes
    the continuations' time, a decode of the prompt mix), is skipped (its key recorded in
    ``deadline.skipped``): the budget is exceeded by one measurement at most.

    With ``dropped`` (a list, filled in place), a drafter whose cheap estimate
    (:meth:`~selfspec.drafting.planning.DrafterCalibration.expected_speedup`: the layer-skip
    subset's is the best early exit's) is already :data:`DROP_SLACK` below the bar (the best
    candidate that needs no measurement: prompt lookup, the early exit, the hybrid; or plain
    decoding's margin) is first measured on a pilot (:func:`pilot_context`: the first
    :data:`PILOT_TOKENS` new tokens of every continuation), its candidates replayed there beside
    the bar's, replayed on the same pilot text. When its best is slower than that bar by
    :data:`DROP_SLACK` (25%) there too, its acceptance cannot pay on this verify curve: it is
    measured no further, offers no candidate, and its figures key is listed in ``dropped`` (its
    pilot figures are saved, so a head is not measured again at every load). Otherwise it is
    measured on everything, as without a pilot (which then cost it ``PILOT_TOKENS /
    max_new_tokens`` more: 12 of 32 on a first load). A drafter without an estimate (a learned
    head, whose worth only its measurement shows) is measured on everything at once: a pilot
    would cost more where it survives than it saves where it is dropped.

    Why this never drops a drafter that clearly wins: the pilot is the same text for every
    candidate, the start of every answer of the mix, 12 of 32 tokens (37%) on a first load. Speeds
    combine harmonically by tokens, so a drafter 25% slower than the bar on the pilot beats it by
    10% on the whole mix only if it is at least 42% faster than the bar on the rest of the same
    answers: a swing of 1.78x between an answer's first tokens and its later ones, which neither a
    per-position acceptance nor a fixed draft cost makes. A drafter that wins by less than that
    was not clearly the winner (and the online guard, :mod:`selfspec.decoding.controller`,
    falls back where a plan does not pay).
    """
    figures: dict[str, Any] = {}
    pilot = pilot_context(context) if dropped is not None else None
    bar = _free_bar(pilot, methods) if pilot is not None else 0.0  # on the pilot
    free_bar = _free_bar(context, methods) if pilot is not None else 0.0  # on everything
    for name, hooks in _measure_order(context):
        key = hooks.figures_key or name
        if key in figures or not _wanted(key, methods):
            continue
        if type(hooks).measure is DrafterCalibration.measure:  # measures nothing of its own: free
            figures[key] = None
            continue
        if deadline is not None and (deadline.passed() or deadline.remaining() < need):
            if key not in deadline.skipped:  # (drafters sharing a key are skipped once)
                deadline.skip(key)
            continue
        estimate = hooks.expected_speedup(name, context)
        if pilot is not None and dropped is not None and estimate is not None and estimate * DROP_SLACK < free_bar:
            trial = hooks.measure(name, pilot)
            sharing = [(n, h) for n, h in _plannable() if (h.figures_key or n) == key]
            offered = [c for n, h in sharing if methods is None or n in methods for c in h.candidates(n, pilot, trial)]
            best = max((c.speedup for c in offered), default=None)
            if best is not None and best * DROP_SLACK < bar:
                figures[key] = trial
                dropped.append(key)
                logger.info(
                    "calibration drops %s after its pilot: %.2fx there, under %.2fx / %.2f", key, best, bar, DROP_SLACK
                )
                continue
            if deadline is not None and deadline.passed():  # the pilot is all there was time for
                figures[key] = trial  # saved, but no candidate: the pilot's figures cover 12 tokens a prompt
                deadline.skip(key)
                continue
        figures[key] = hooks.measure(name, context)
    return figures


@dataclass
class Deadline:
    """A calibration time budget: when it ends, and what was skipped for it.

    Attributes:
        budget: seconds allowed (``None``: no limit).
        started: ``time.perf_counter()`` at the start.
        skipped: the measurements left out, in order.
    """

    budget: float | None
    started: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def passed(self) -> bool:
        """Whether the budget is spent (a measurement starting now would exceed it)."""
        return self.budget is not None and time.perf_counter() - self.started >= self.budget

    def remaining(self) -> float:
        """Seconds left (infinite without a budget, never negative)."""
        if self.budget is None:
            return math.inf
        return max(0.0, self.budget - (time.perf_counter() - self.started))

    def until(self, share: float) -> float | None:
        """When a phase allowed ``share`` of the remaining time must stop starting work (``None``: no budget)."""
        if self.budget is None:
            return None
        return time.perf_counter() + share * self.remaining()

    def bounded(self, estimate: float, share: float) -> float:
        """A phase's estimate, at most its ``share`` of the remaining time (what it announces)."""
        return min(estimate, share * self.remaining())

    def cut(self, what: str) -> None:
        """Record (and log) a measurement cut short for the budget (it ran, on less)."""
        self.skipped.append(what)
        logger.warning("calibration budget of %.0f s: measured only %s", self.budget, what)

    def skip(self, what: str) -> None:
        """Record (and log) a measurement left out for the budget."""
        self.skipped.append(what)
        logger.warning(
            "calibration budget of %.0f s spent: skipping %s (pass a larger calibration_budget, or "
            "--calibration-budget, to measure it)",
            self.budget, what,
        )  # fmt: skip


#: The share of the calibration budget the continuations may take (the first prompt always runs).
CONTINUATIONS_SHARE = 0.25
#: The share of the time left after the acceptance that the cost timings may take (one turn always runs).
COSTS_SHARE = 0.5
#: Interleaved timing turns of the cost curves (doubled once when a curve is not monotonic).
COST_REPEATS = 7
#: About how many tokens of a teacher-forced forward cost one plain step (CPU, float32): for estimates.
PREFILL_TOKENS_PER_STEP = 8.0
#: About how many plain steps the precision comparison and the tree race take: for estimates.
PRECISION_STEPS = 280.0
TREE_STEPS = 500.0


class _PhaseTimer:
    """``with _PhaseTimer(phases, name):`` records the block's seconds as ``phases[name]``."""

    def __init__(self, phases: dict[str, float], name: str) -> None:
        self.phases, self.name = phases, name

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.phases[self.name] = time.perf_counter() - self.started


def _probe_step(runner: Any) -> float:
    """Seconds of one plain one-token step with a short cache (after one warm-up): the estimates' unit."""
    with torch.inference_mode():
        cache = runner.new_cache(4)
        seconds = math.inf
        for position in range(2):
            token = torch.tensor([[1]], device=runner.device)
            started = time.perf_counter()
            at = torch.tensor([position], device=runner.device)
            hidden = runner.run_layers(runner.embed(token), 0, runner.num_layers, at, cache)
            runner.logits(hidden)
            seconds = time.perf_counter() - started
    return seconds


def _turn_steps(runner: Any, layers: Sequence[int], draft_lengths: Sequence[int]) -> float:
    """About how many plain steps one turn of :func:`measure_costs` takes (for its estimate)."""
    verify = sum(1.0 + (k + 1) / PREFILL_TOKENS_PER_STEP for k in draft_lengths)
    screened = runner.argmax_screen and runner.argmax_head is not None
    return 1.0 + sum(layers) / runner.num_layers + verify * (2 if screened else 1)


def _measuring(context: MeasureContext, methods: Sequence[str] | None) -> list[str]:
    """The figures keys :func:`measure_drafters` would measure (what the phase line names)."""
    keys: list[str] = []
    for name, hooks in _measure_order(context):
        key = hooks.figures_key or name
        if key not in keys and _wanted(key, methods) and type(hooks).measure is not DrafterCalibration.measure:
            keys.append(key)
    return keys


def rank_candidates(context: MeasureContext, figures: dict[str, Any], skipped: Sequence[str] = ()) -> list[Candidate]:
    """Every registered drafter's candidates, replayed over the continuations (none for a ``skipped`` figures key)."""
    found: list[Candidate] = []
    for name, hooks in _plannable():
        if name == PLAIN or (hooks.figures_key or name) in skipped:
            continue
        found += hooks.candidates(name, context, figures.get(hooks.figures_key or name))
    return found


def pick(candidates: list[Candidate], methods: Sequence[str] | None = None) -> tuple[Plan, Candidate | None]:
    """The fastest candidate's plan; plain decoding unless one beats it by :data:`PLAIN_MARGIN`."""
    options = [c for c in candidates if methods is None or c.method in methods]
    if not options:
        options = [Candidate(PLAIN, {}, 0.0, PLAIN)]
    best = max(options, key=lambda c: c.speedup)
    if best.speedup < PLAIN_MARGIN:
        reason = f"no method beats plain decoding here (best: {best.method} at {best.speedup:.2f}x)"
        return Plan(PLAIN, reason=reason, predicted_speedup=1.0), None
    runner_up = max((c.speedup for c in options if c is not best), default=1.0)
    reason = f"predicted {best.speedup:.2f}x plain decoding (next best {max(runner_up, 1.0):.2f}x)"
    return Plan(best.method, dict(best.settings), round(best.speedup, 3), reason), best


def choose_plan(
    data: Continuations,
    matches: dict[int, list[list[bool]]],
    draft_cost: dict[int, float],
    verify_cost: dict[int, float],
    *,
    figures: dict[str, Any] | None = None,
    exit_adapter_layer: int | None = None,
    methods: Sequence[str] | None = None,
) -> tuple[Plan, dict[str, float], tuple[int, int, float]]:
    """Replay every registered drafter's candidates and pick the fastest (plain decoding unless one pays).

    Args:
        data: the model's own continuations.
        matches: per exit layer, per position, whether the early exit's token was the model's.
        draft_cost: a draft step's cost per exit layer (relative to a plain step).
        verify_cost: verifying ``k`` drafts, per ``k``.
        figures: the drafters' own measurements by ``figures_key`` (else the drafter's name; :func:`measure_drafters`).
        exit_adapter_layer: the layer an exit adapter reads (a plan at that layer then uses it).
        methods: consider only these plan methods (plain decoding always); ``None``: all.

    Returns:
        ``(plan, {candidate label: predicted speedup}, (best early-exit layer, its k, its speedup))``.
    """
    context = MeasureContext(data, matches, draft_cost, verify_cost, exit_adapter_layer=exit_adapter_layer)
    candidates = rank_candidates(context, figures or {})
    plan, _ = pick(candidates, methods)
    return plan, {PLAIN: 1.0, **{c.label: c.speedup for c in candidates}}, context.best_exit


#: The temperature calibration samples at to measure sampled acceptance (lower than greedy's).
SAMPLED_TEMPERATURE = 0.7


def measure_sampled_plan(
    engine: SpeculativeEngine,
    plan: Plan,
    chosen: Candidate | None,
    context: MeasureContext,
    calibration: dict[str, Any],
    temperature: float = SAMPLED_TEMPERATURE,
    *,
    until: float | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
) -> Plan:
    """The plan for sampling requests: ``plan`` run on the model's own sampled continuations.

    Each calibration prompt is decoded at ``temperature`` (fixed seeds) with the plan's drafter at
    its fixed draft length; the rounds' accepted lengths are exact counts of lossless rejection
    sampling (no timing). Their predicted speed on the calibrated costs (the candidate's draft
    cost, the verify curve of rounds that read every logit) decides: plain decoding unless it beats it by
    :data:`~selfspec.drafting.auto.PLAIN_MARGIN`.

    Args:
        engine: the calibrated engine (its model is only read).
        plan: the greedy plan.
        chosen: its candidate (for the draft cost), ``None`` for plain decoding.
        context: what calibration measured (prompts, verify costs).
        calibration: the drafters' saved figures (what the plan's drafter reads, e.g. a head).
        temperature: the sampling temperature.
        until: a ``time.perf_counter()`` time after which no further prompt is decoded (the
            first always is): the calibration budget.
        on_prompt: called with ``(done, total)`` after each prompt.

    The prompts stop early once the verdict is clear: when even the prompts left, every round
    fully accepted (fewer than ``j + 2`` tokens a round priced at ``j`` drafts), could not
    lift the speedup to :data:`~selfspec.drafting.auto.PLAIN_MARGIN`, or even every draft rejected
    (one token a round, at the dearest round cost) could not sink it below (the reason says after
    how many prompts it was decided). Either bound holds whatever the prompts left accept, so the
    plan is the one all the prompts would have given.
    """
    if plan.method == PLAIN or chosen is None:
        return Plan(PLAIN, predicted_speedup=1.0, reason="the greedy plan is plain decoding")
    k = plan.num_draft_tokens
    sampling = SpeculativeEngine(
        engine.model,
        engine.tokenizer,
        drafter="auto",
        num_draft_tokens=k,
        exit_adapter=engine.config.exit_adapter,
        calibration={**calibration, "plan": plan.to_json()},
    )
    costs = CostModel(chosen.draft_cost, context.sampled_verify_cost or context.verify_cost)
    tokens = drafted = accepted = 0
    cost = 0.0
    decided = ""
    # a prompt's tokens cost at least (all drafts accepted) and at most (none) this much each
    best = min(1.0, *(costs.round_cost(j) / (j + 2) for j in range(1, k + 1)))
    worst = max(1.0, *(costs.round_cost(j) for j in range(1, k + 1)))
    started = time.perf_counter()
    for seed, ids in enumerate(context.prompt_ids):
        mean = (time.perf_counter() - started) / max(seed, 1)
        if seed and until is not None and time.perf_counter() + mean >= until:  # it would end past it
            break
        left = (len(context.prompt_ids) - seed) * max(context.max_new_tokens - 1, 0)
        highest, lowest = (tokens + left) / (cost + left * best), (tokens + left) / (cost + left * worst)
        if seed and (highest < PLAIN_MARGIN or lowest >= PLAIN_MARGIN):
            decided = f", decided after {seed} of {len(context.prompt_ids)} prompts"
            break
        out = sampling.generate_ids(ids, max_new_tokens=context.max_new_tokens, temperature=temperature, seed=seed)
        rounds = max(out.stats.target_forwards - 1, 1)
        per_round = out.stats.num_drafted / rounds
        # a round's cost at the mean draft length (rounds that drafted nothing are plain steps)
        cost += rounds * costs.round_cost(max(1, min(k, round(per_round)))) if per_round else rounds
        tokens += len(out.token_ids) - 1  # the prefill's token costs no round
        drafted += out.stats.num_drafted
        accepted += out.stats.num_accepted
        if on_prompt is not None:
            on_prompt(seed + 1, len(context.prompt_ids))
    speedup = tokens / cost if cost else 1.0
    rate = accepted / drafted if drafted else 0.0
    if speedup < PLAIN_MARGIN:
        reason = (
            f"sampled drafts (T={temperature}) accepted {rate:.2f}: {plan.method} predicted {speedup:.2f}x, "
            f"so plain decoding when sampling{decided}"
        )
        return Plan(PLAIN, predicted_speedup=round(speedup, 3), reason=reason)
    reason = f"sampled drafts (T={temperature}) accepted {rate:.2f}: predicted {speedup:.2f}x plain decoding{decided}"
    return Plan(plan.method, dict(plan.settings), round(speedup, 3), reason)


def _prompt_ids(engine: SpeculativeEngine, prompt: Any) -> list[int]:
    """A prompt's token ids: text and chat messages are encoded, ids pass through."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        return engine.encode_prompt(prompt)
    return [int(t) for t in prompt]


def calibrate(
    engine: SpeculativeEngine,
    prompts: Sequence[str] | Sequence[list[int]] | Sequence[Any] | None = None,
    *,
    max_new_tokens: int = 48,
    max_exit_layer: int | None = None,
    max_draft_tokens: int = 8,
    save: bool = True,
    progress: bool | ProgressMode = True,
    trees: bool = False,
    methods: Sequence[str] | None = None,
    budget: float | None = None,
    **options: Any,
) -> CalibrationResult:
    """Measure every candidate on this model and hardware, choose the plan, save it.

    The early exit's agreement per layer and the draft and verify costs are measured here; every
    registered drafter whose registration declares a ``calibration`` then measures itself and
    offers its candidates (:class:`~selfspec.drafting.planning.DrafterCalibration`).

    Args:
        engine: the engine to calibrate (its model is only read).
        prompts: calibration prompts (text, chat messages, or token ids); by default the
            built-in mix of :func:`default_prompts`.
        max_new_tokens: tokens generated per prompt to measure acceptance on.
        max_exit_layer: the deepest exit layer to consider (default: half the layers).
        max_draft_tokens: the longest draft length to consider.
        save: write ``selfspec.json`` (beside a local model folder, else in the user cache).
        progress: ``True`` or ``"bar"``: a progress bar; ``"lines"``: a line per phase with its
            estimate and a line every few seconds while one runs; ``False`` or ``"off"``: nothing
            (:mod:`~selfspec.calibration.progress`).
        trees: also race early-exit token trees of :data:`TREE_CANDIDATES` nodes against
            the chain at the best exit layer and draft length, and save the fastest as
            ``tree_nodes`` (``None``: the chain), which ``tree_nodes="auto"`` uses.
        methods: let the plan choose only among these methods (and plain decoding);
            ``None``: every measured one.
        budget: a time budget in seconds (``None``: no limit) that bounds every phase. The
            essentials are measured first, each on a share of the time: the continuations on
            :data:`CONTINUATIONS_SHARE` of it (prompt by prompt, the first always), the exit
            layers' acceptance (one forward per continuation), the costs on :data:`COSTS_SHARE`
            of what is left (turn by turn, the warm-up turn always); then the drafters' own
            measurements in order of expected value, the sampled plan (prompt by prompt) and the
            tree race. What is cut short or skipped is logged and listed in ``skipped``; the
            budget is exceeded by one prompt, timing turn or drafter measurement at most.
        **options: options of the drafters' calibrations, each documented by the drafter that
            reads it (its calibration's ``options``); an option no registered drafter reads is an error.

    Returns:
        The measurements and the choice. The engine itself is not changed; a new engine
        (or ``engine.configure(result.to_json())``) uses them.

    Raises:
        ConfigurationError: an option no registered drafter's calibration reads.
    """
    known = {option for _, hooks in _plannable() for option in hooks.options}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigurationError(
            f"calibrate() got unknown drafter option(s) {', '.join(unknown)}; the registered drafters read "
            f"{', '.join(sorted(known)) or 'none'}"
        )
    runner = engine.runner
    num_layers = runner.num_layers
    deepest = max_exit_layer or max(1, num_layers // 2)
    layers = list(range(1, min(deepest, num_layers - 1) + 1))
    if prompts is None:
        prompts = default_prompts(engine)
    window = engine.context_window or 10**9
    # a prompt longer than a small model's window keeps its end, leaving room for a continuation
    longest = window - max(2, min(max_new_tokens, window // 4)) - 1
    prompt_ids = [ids[-longest:] for ids in (_prompt_ids(engine, p) for p in prompts)]
    max_new_tokens = max(2, min(max_new_tokens, window - max(len(p) for p in prompt_ids) - 1))
    exit_adapter = engine.config.exit_adapter
    deadline = Deadline(budget)
    reason = precision_skip_reason(engine)  # (a float32 model has no precision to compare)
    show = CalibrationProgress(progress_mode(progress), phases=5 + (reason is None) + trees)
    phases: dict[str, float] = {}
    show.step_seconds = step = _probe_step(runner)
    sizes = [len(ids) for ids in prompt_ids]

    def timed(name: str) -> _PhaseTimer:
        return _PhaseTimer(phases, name)

    # 1. the model's own continuations (a share of the budget: the rest needs time too)
    until = deadline.until(CONTINUATIONS_SHARE)
    show.phase(
        f"the model's own greedy continuations of {len(prompt_ids)} prompts",
        deadline.bounded(step * sum(max_new_tokens + n / PREFILL_TOKENS_PER_STEP for n in sizes), CONTINUATIONS_SHARE),
    )
    with timed("continuations"):
        data = generate_continuations(
            engine, prompt_ids, max_new_tokens, until=until, on_prompt=lambda d, t: show.advance(d, t, "prompts")
        )
    if len(data.sequences) < len(prompt_ids):
        deadline.cut(f"continuations of {len(data.sequences)} of {len(prompt_ids)} prompts")
        prompt_ids = prompt_ids[: len(data.sequences)]
    if data.num_tokens:
        step = max(step, phases["continuations"] / data.num_tokens)  # the measured pace, prefills included

    # 2. the exit layers' acceptance (one teacher-forced forward per continuation)
    forwards = sum(len(sequence) for sequence in data.sequences) / PREFILL_TOKENS_PER_STEP
    show.phase("acceptance per exit layer", step * max(1.0, forwards))
    with timed("acceptance"):
        matches, _ = exit_matches(engine, data, layers, exit_adapter)
    agreement = {layer: agreement_of(matches[layer]) for layer in layers}

    # 3. the draft and verify costs (repeated interleaved timings, a share of what is left)
    draft_lengths = verify_lengths(max_draft_tokens, window)
    cost_prompt = (prompt_ids[0] * (200 // len(prompt_ids[0]) + 1))[: min(200, window - max(draft_lengths) - 2)]
    checks: dict[str, Any] = {}
    sampled_verify_cost: dict[int, float] = {}
    per_turn = step * _turn_steps(runner, layers, draft_lengths)
    show.phase("draft and verify costs", deadline.bounded(per_turn * (COST_REPEATS + 1), COSTS_SHARE))
    with timed("costs"):
        draft_cost, verify_cost, step_seconds = measure_costs(
            engine,
            cost_prompt,
            layers,
            draft_lengths,
            repeats=COST_REPEATS,
            checks=checks,
            sampled=sampled_verify_cost,
            until=deadline.until(COSTS_SHARE),
            on_turn=lambda d, t: show.advance(d, t, "timing rounds"),
        )
    if checks.get("turns_cut"):  # (timings that settled before COST_REPEATS turns were not cut)
        turns = checks["turns"]
        deadline.cut(f"cost timings ({f'{turns} of {COST_REPEATS} rounds' if turns else 'the warm-up round only'})")
    if checks.get("untimed"):
        deadline.cut(f"the essential cost points ({checks['untimed']} draft, long-verify and sampled points untimed)")
    if checks.get("remeasure_skipped"):
        deadline.cut("re-measuring the non-monotonic cost curves")

    # 4. the drafters' own measurements, in order of expected value
    context = MeasureContext(
        data,
        matches,
        draft_cost,
        verify_cost,
        engine=engine,
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        max_draft_tokens=max_draft_tokens,
        step_seconds=step_seconds,
        exit_adapter_layer=None if exit_adapter is None else exit_adapter.exit_layer,
        options=options,
        sampled_verify_cost=sampled_verify_cost,
    )
    measuring = _measuring(context, methods)
    show.phase(
        f"the drafters' own measurements ({', '.join(measuring) or 'none needed'})",
        deadline.bounded(len(measuring) * phases["acceptance"] * 2, 1.0),
    )
    with timed("drafters"):
        dropped: list[str] = []
        figures = measure_drafters(context, methods, deadline, dropped, need=phases["continuations"])
    candidates = rank_candidates(context, figures, [*deadline.skipped, *dropped])
    plan, chosen = pick(candidates, methods)
    plan = replace(plan, measured=checks["path"])  # which forwards priced it (the static round's, issue 40)
    saved, notes = _saved(figures, candidates)

    # 5. the plan on sampled continuations (free for plain decoding)
    sampled_plan: Plan | None = None
    if plan.method != PLAIN and deadline.remaining() < phases["continuations"] / len(prompt_ids):
        deadline.skip("sampled acceptance")  # (not even one prompt's decode fits)
    else:
        free = plan.method == PLAIN
        show.phase(
            "acceptance when sampling" + (" (none: the plan is plain decoding)" if free else ""),
            0.0 if free else deadline.bounded(phases["continuations"], 1.0),
        )
        with timed("sampled"):
            sampled_plan = measure_sampled_plan(
                engine,
                plan,
                chosen,
                context,
                saved,
                until=deadline.until(1.0),
                on_prompt=lambda d, t: show.advance(d, t, "prompts"),
            )
        sampled_plan = replace(sampled_plan, measured=checks["path"])

    # 6. half precision against float32 (CPU, half-precision models only)
    if reason is not None:
        precision: dict[str, Any] = {"skipped": reason}
    elif deadline.passed():
        precision = {"skipped": "time budget"}
        deadline.skip("half precision against float32")
    else:
        show.phase("half precision against float32", step * PRECISION_STEPS)
        with timed("precision"):
            precision = measure_precision(engine, prompt_ids[0])

    # 7. with trees=True: token trees raced against the chain
    exit_layer, num_draft_tokens, exit_speed = context.best_exit
    tree_speed: dict[str, float] = {}
    if trees and deadline.passed():
        deadline.skip("token trees")
    elif trees:
        show.phase("token trees against the chain", step * TREE_STEPS)
        with timed("trees"):
            tree_speed = measure_tree_speed(engine, prompt_ids[:3], exit_layer, num_draft_tokens)
    show.close()
    result = CalibrationResult(
        exit_layer=exit_layer,
        num_draft_tokens=num_draft_tokens,
        expected_speedup=exit_speed,
        agreement=agreement,
        draft_cost=draft_cost,
        verify_cost=verify_cost,
        sampled_verify_cost=sampled_verify_cost,
        step_seconds=step_seconds,
        figures=saved,
        notes=notes,
        tree_speed=tree_speed,
        tree_nodes=choose_tree_nodes(tree_speed),
        plan=plan,
        plan_draft_cost=chosen.draft_cost if chosen is not None else 0.0,
        candidates={PLAIN: 1.0, **{c.label: c.speedup for c in candidates}},
        cost_checks=checks,
        device=str(runner.device),
        dtype=str(runner.dtype).replace("torch.", ""),
        sampled_plan=sampled_plan,
        calibration_budget=budget,
        seconds=time.perf_counter() - deadline.started,
        skipped=list(deadline.skipped),
        precision=precision,
        phase_seconds=phases,
        dropped=dropped,
    )
    logger.info("calibrated %s: %s", engine.name_or_path or "the model", plan.summary())
    if sampled_plan is not None:
        logger.info("when sampling: %s", sampled_plan.summary())
    if save and engine.name_or_path:  # kept in memory for the process when the cache cannot be written
        save_or_keep_calibration(engine.name_or_path, result.to_json())
    return result


def head_found_since(engine: SpeculativeEngine) -> bool:
    """Whether an EAGLE head exists for the model now that its saved calibration never measured.

    ``selfspec train-eagle`` saves a head where :func:`~selfspec.drafting.eagle.head.find_eagle_head`
    looks; the next load of the model with ``drafter="auto"`` then measures again, so the plan
    considers the head with no other argument.
    """
    from ..drafting.eagle.head import find_eagle_head

    if engine.config.drafter != "auto" or not engine.name_or_path or engine.calibration.get("eagle"):
        return False
    return find_eagle_head(engine.name_or_path, engine.runner.model) is not None


def show_progress() -> ProgressMode:
    """How first-load calibration shows its progress (:mod:`.progress`).

    A bar on a terminal, lines off one (a log, a CI job, ``make demo | tee``), nothing when
    logging silences the ``selfspec`` logger's warnings.
    """
    import sys

    if logging.getLogger("selfspec").getEffectiveLevel() > logging.WARNING:
        return "off"
    return "bar" if sys.stderr.isatty() else "lines"


def _saved(figures: dict[str, Any], candidates: list[Candidate]) -> tuple[dict[str, Any], list[str]]:
    """What each drafter saves in ``selfspec.json`` (once per ``figures_key``) and its line for the CLI."""
    saved: dict[str, Any] = {}
    notes: list[str] = []
    done: set[str] = set()
    for name, hooks in _plannable():
        key = hooks.figures_key or name
        if key in done:
            continue
        done.add(key)
        sharing = {n for n, h in _plannable() if (h.figures_key or n) == key}
        entries = hooks.saved(figures.get(key), [c for c in candidates if c.method in sharing])
        saved.update(entries)
        note = hooks.note(entries)
        if note:
            notes.append(note)
    return saved, notes


def calibrate_on_first_load(
    engine: SpeculativeEngine, *, trees: bool = False, budget: float | None = DEFAULT_CALIBRATION_BUDGET
) -> None:
    """The loader's first-load step: measure a model without a saved calibration, save it, use it.

    Says once (a ``WARNING`` of the ``selfspec`` logger, which Python prints by default) what is
    measured, that it happens once, and where the result is saved; then each phase with its
    estimate, and how far it is (a bar on a terminal, a line every few seconds off one:
    :func:`show_progress`, :mod:`~selfspec.calibration.progress`); then how long it took and the
    plan. Shorter continuations than :func:`calibrate`'s default; ``engine`` is reconfigured in
    place from what was measured. ``budget`` bounds the time of every phase (seconds, ``None``: no
    limit; see :func:`calibrate`).

    One process at a time measures a model (:func:`~selfspec.calibration.store.calibration_lock`):
    a second one says that the first is measuring, waits, and uses the plan it saved.
    """
    from .store import calibration_lock

    runner = engine.runner
    with calibration_lock(engine.name_or_path, runner.device, runner.dtype) as lock:
        if lock.waited and _measured_meanwhile(engine, lock.holder_pid):
            return
        _measure_on_first_load(engine, trees=trees, budget=budget)


def _measured_meanwhile(engine: SpeculativeEngine, holder_pid: int | None) -> bool:
    """Configure ``engine`` from the calibration another process saved while this one waited, if it did."""
    from .store import load_calibration

    saved = load_calibration(engine.name_or_path, device=engine.runner.device, dtype=engine.runner.dtype)
    if saved is None:
        return False
    engine.configure(saved)
    if head_found_since(engine):  # the other process measured without a head this one sees
        return False
    measured_by = f"pid {holder_pid}" if holder_pid else "another process"
    plan = engine.plan.summary() if engine.plan is not None else "no plan"
    logger.warning("using the calibration %s measured: %s", measured_by, plan)
    return True


def _measure_on_first_load(engine: SpeculativeEngine, *, trees: bool, budget: float | None) -> None:
    """Measure, save and configure (:func:`calibrate_on_first_load` once it holds the lock)."""
    import time

    from .store import calibration_path

    runner = engine.runner
    where = calibration_path(engine.name_or_path, runner.device, runner.dtype)
    name = engine.model_name if engine.name_or_path else "the model"  # a real model's short name, not its file
    logger.warning(
        "first load of %s on %s %s: measuring which drafter is fastest here (acceptance of each candidate on a "
        "few built-in prompts, draft and verify costs); this happens once, and the plan is saved to %s",
        name, runner.device.type, str(runner.dtype).replace("torch.", ""), where or "nowhere (the model has no name)",
    )  # fmt: skip
    start = time.perf_counter()
    measured = calibrate(
        engine, max_new_tokens=32, max_draft_tokens=6, trees=trees, progress=show_progress(), budget=budget
    )
    engine.configure(measured.to_json())
    skipped = f" (skipped for the {budget:.0f} s budget: {', '.join(measured.skipped)})" if measured.skipped else ""
    speed = describe_precision(measured.precision)
    logger.warning(
        "calibrated %s in %.0f s: %s%s%s",
        name, time.perf_counter() - start, measured.plan.summary(), skipped, f"; {speed}" if speed else "",
    )  # fmt: skip
