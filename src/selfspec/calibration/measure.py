"""Calibration: measure every applicable method on this model and hardware, and choose a plan.

On the model's own greedy continuations of a small built-in prompt mix it measures, per
position, whether each exit layer's greedy token (through an exit adapter where one is
present), a layer-skip subset's, and a prompt-lookup copy would have been accepted; and on
this hardware, with repeated interleaved timings taken as medians and checked for
monotonicity (re-measured when they are not), the cost of a draft step at each exit layer and
of verifying ``k`` drafts, relative to one plain step. A replay of the continuations then
predicts each candidate's speed (tokens per plain-step cost): plain decoding (1.0), early exit
per layer and draft length, layer skip, prompt lookup, hybrid (lookup where the text
repeats, else the early exit), and, when an EAGLE head fits the model
(:func:`~selfspec.drafting.eagle.head.find_eagle_head`), the head's chains alone and with lookup copies where
the text repeats (``eagle`` / ``eagle_hybrid``): their acceptance is measured by decoding the prompts with
the head (a chain's accepted length per round), their draft cost from the same runs. The
fastest becomes the :class:`~selfspec.drafting.auto.Plan` that ``drafter="auto"`` runs,
and plain decoding when nothing beats it by a margin.

The classic estimate is kept as :func:`expected_speedup`: with per-token acceptance ``a``,
draft length ``k``, draft cost ``c`` and verify cost ``v_k``, a round emits on average
``(1 - a^(k+1)) / (1 - a)`` tokens for ``k c + v_k`` step-costs (Leviathan et al. 2023).
"""

from __future__ import annotations

import itertools
import logging
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..core.speed import CostModel, expected_tokens
from ..drafting.auto import PLAIN_MARGIN, Plan
from .store import machine_fingerprint, save_calibration

if TYPE_CHECKING:
    from ..decoding.engine import SpeculativeEngine

logger = logging.getLogger(__name__)

#: Prose openings: the prompt mix for models without a chat template (and the demo model's).
DEFAULT_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    '"My dear Mr. Bennet," said his lady to him one day, "have you heard that',
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement,",
    "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be",
)

_NOTE = (
    "The museum opens at 9 am and closes at 5 pm from Tuesday to Sunday. It is closed on Mondays. "
    "Entry is free for children under twelve; adults pay eight euros. Guided tours start every hour "
    "at the main entrance and last forty-five minutes."
)
_STORY = (
    "Maria planted tomatoes, beans and basil in her small garden in April. In June the beans grew "
    "faster than she expected, so she built a trellis from old bamboo sticks. By August she had more "
    "tomatoes than her family could eat, and she gave the rest to her neighbours."
)

#: The prompt mix for chat models: something to copy (RAG, summary, code edit) and open chat.
CHAT_CALIBRATION_PROMPTS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": f"Context:\n{_NOTE}\n\nQuestion: When is the museum open, and what does entry cost?"}],
    [{"role": "user", "content": f"Summarize this story in two sentences.\n\n{_STORY}"}],
    [
        {
            "role": "user",
            "content": "Add a docstring to this function:\n\ndef area(width, height):\n    return width * height\n",
        }
    ],
    [{"role": "user", "content": "What should I pack for a weekend hiking trip?"}],
    [{"role": "user", "content": "Explain in simple words why the sky is blue."}],
    [{"role": "user", "content": "Write a short, friendly message inviting a colleague to lunch."}],
)


def default_prompts(engine: SpeculativeEngine) -> list[Any]:
    """The built-in prompt mix for ``engine``'s model (token ids when it has no tokenizer)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return [[1, 2, 3, 4, 5, 6, 7, 8], [5, 9, 5, 9, 11, 5, 9, 5]]
    if getattr(tokenizer, "chat_template", None) is None:
        return list(DEFAULT_CALIBRATION_PROMPTS)
    from ..modeling.loading import DEMO_MODEL, demo_model_path

    if engine.name_or_path in (DEMO_MODEL, str(demo_model_path())):  # trained on Austen: its own kind of text
        from ..prompts import PASSAGES

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
        exit_layer: the best early-exit layer (what ``drafter="early_exit"`` with ``"auto"`` uses).
        num_draft_tokens: its draft length.
        expected_speedup: that early exit's predicted speedup over plain decoding (may be < 1).
        agreement: greedy agreement of each exit layer with the last layer.
        draft_cost: cost of one draft step at each exit layer, relative to a plain step.
        verify_cost: cost of verifying ``k`` drafts (``k + 1`` tokens), relative to a plain step.
        step_seconds: median seconds of one plain one-token step.
        layer_skip: the layer-skip drafter's layers (``layer_skip_layers``), agreement, draft
            length and predicted speedup.
        tree_speed: with ``trees=True``: measured greedy tokens per second of the chain and
            of each early-exit tree node budget.
        tree_nodes: with ``trees=True``: the fastest, ``None`` when the chain was fastest.
        plan: what ``drafter="auto"`` runs (:class:`~selfspec.drafting.auto.Plan`).
        candidates: every candidate's predicted speedup over plain decoding.
        cost_checks: how many times the cost curves were re-measured for not being monotonic,
            and whether they were finally made monotonic by hand.
        eagle: when an EAGLE head fits the model: its folder, draft cost per token, the
            accepted length per round of its full-length chains, and its tau (else empty).
    """

    exit_layer: int
    num_draft_tokens: int
    expected_speedup: float
    agreement: dict[int, float] = field(default_factory=dict)
    draft_cost: dict[int, float] = field(default_factory=dict)
    verify_cost: dict[int, float] = field(default_factory=dict)
    step_seconds: float = 0.0
    layer_skip: dict[str, Any] = field(default_factory=dict)
    tree_speed: dict[str, float] = field(default_factory=dict)
    tree_nodes: int | None = None
    plan: Plan = field(default_factory=Plan)
    candidates: dict[str, float] = field(default_factory=dict)
    cost_checks: dict[str, Any] = field(default_factory=dict)
    eagle: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    dtype: str = ""

    @property
    def predicted_tokens_per_second(self) -> dict[str, float]:
        """Each candidate's predicted tokens per second on this hardware."""
        if self.step_seconds <= 0:
            return {}
        return {name: speed / self.step_seconds for name, speed in self.candidates.items()}

    def to_json(self) -> dict[str, Any]:
        """The calibration file's content (``selfspec.json``)."""
        data = asdict(self)
        data.update(data.pop("layer_skip"))
        if not self.tree_speed:  # not measured: "auto" falls back to the default
            del data["tree_speed"], data["tree_nodes"]
        else:
            data["tree_speed"] = {k: round(v, 2) for k, v in self.tree_speed.items()}
        for key in ("agreement", "draft_cost", "verify_cost"):
            data[key] = {str(k): round(v, 4) for k, v in data[key].items()}
        data["expected_speedup"] = round(self.expected_speedup, 3)
        data["plan"] = self.plan.to_json()
        data["candidates"] = {k: round(v, 3) for k, v in sorted(self.candidates.items(), key=lambda kv: -kv[1])}
        data["predicted_tokens_per_second"] = {k: round(v, 1) for k, v in self.predicted_tokens_per_second.items()}
        data["costs"] = plan_costs(self.plan, self.draft_cost, self.verify_cost, self.layer_skip, self.eagle)
        data["source"] = "calibrate"
        data["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data["hardware"] = f"{platform.machine()} {self.device} {self.dtype} {torch.get_num_threads()} threads"
        data["machine"] = machine_fingerprint()
        return data


def plan_costs(
    plan: Plan,
    draft_cost: dict[int, float],
    verify_cost: dict[int, float],
    layer_skip: dict[str, Any],
    eagle: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The online guard's cost model for ``plan``: its draft cost per token and the verify curve."""
    if plan.method in ("early_exit", "hybrid") and plan.exit_layer in draft_cost:
        draft = draft_cost[plan.exit_layer]
    elif plan.method in ("eagle", "eagle_hybrid"):
        draft = float((eagle or {}).get("draft_cost", 1.0))
    elif plan.method == "layer_skip":
        draft = float(layer_skip.get("layer_skip_draft_cost", 1.0))
    else:
        draft = 0.0  # prompt lookup drafts for free
    return {"draft": round(draft, 4), "verify": {str(k): round(v, 4) for k, v in verify_cost.items()}}


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
    engine: SpeculativeEngine, prompt_ids: Sequence[list[int]], max_new_tokens: int
) -> Continuations:
    """Plain greedy continuations of each prompt (what any lossless method must reproduce)."""
    engine_class = type(engine)  # sibling engines of the caller's class: no import back to selfspec.decoding.engine

    plain = engine_class(engine.model, engine.tokenizer, drafter="none", calibration={})
    sequences = [ids + plain.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids for ids in prompt_ids]
    return Continuations(sequences, [len(ids) for ids in prompt_ids])


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


def _interleaved_medians(variants: dict[Any, Callable[[], None]], repeats: int) -> dict[Any, float]:
    """Median seconds of each variant, timed round-robin (machine noise hits all alike)."""
    for fn in variants.values():
        fn()  # warm up
    times: dict[Any, list[float]] = {key: [] for key in variants}
    for turn in range(repeats):
        keys = list(variants)
        keys = keys[turn % len(keys) :] + keys[: turn % len(keys)]
        for key in keys:
            started = time.perf_counter()
            variants[key]()
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in times.items()}


def _monotonic(values: dict[int, float], tolerance: float = 0.03) -> bool:
    ordered = [values[k] for k in sorted(values)]
    return all(b >= a * (1 - tolerance) for a, b in itertools.pairwise(ordered))


def _running_max(values: dict[int, float]) -> dict[int, float]:
    out, top = {}, 0.0
    for key in sorted(values):
        top = max(top, values[key])
        out[key] = top
    return out


def measure_costs(
    engine: SpeculativeEngine,
    prompt_ids: list[int],
    layers: Sequence[int],
    draft_lengths: Sequence[int],
    repeats: int = 7,
    retries: int = 2,
    checks: dict[str, Any] | None = None,
) -> tuple[dict[int, float], dict[int, float], float]:
    """Relative costs of a draft step per exit layer and of a verify per draft length.

    Timings are interleaved medians of ``repeats`` runs. A curve that is not monotonic
    (deeper exits and longer verifies must not be cheaper, beyond 3% noise) is measured again
    with more repeats, up to ``retries`` times, then made monotonic (running maximum); what
    happened is recorded in ``checks``.
    """
    runner = engine.runner
    device = runner.device
    length = len(prompt_ids)
    cache = runner.new_cache(length + max(draft_lengths) + 2)
    checks = checks if checks is not None else {}
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=device)
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(length, device=device), cache)

        def step(end_layer: int, num_tokens: int) -> Callable[[], None]:
            def run() -> None:
                tokens = torch.tensor([prompt_ids[-num_tokens:]], device=device)
                positions = torch.arange(length, length + num_tokens, device=device)
                hidden = runner.run_layers(runner.embed(tokens), 0, end_layer, positions, cache)
                runner.logits(hidden)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                cache.crop_to(length)

            return run

        variants: dict[Any, Callable[[], None]] = {("full", 1): step(runner.num_layers, 1)}
        variants.update({("draft", layer): step(layer, 1) for layer in layers})
        variants.update({("verify", k): step(runner.num_layers, k + 1) for k in draft_lengths})
        checks.setdefault("remeasured", 0)
        for attempt in range(retries + 1):
            seconds = _interleaved_medians(variants, repeats * (attempt + 1))
            full = seconds[("full", 1)]
            draft = {layer: seconds[("draft", layer)] / full for layer in layers}
            verify = {k: seconds[("verify", k)] / full for k in draft_lengths}
            verify_with_one = {0: 1.0, **verify}
            if _monotonic(draft) and _monotonic(verify_with_one):
                checks["monotonic"] = True
                return draft, verify, full
            checks["remeasured"] += 1
            logger.info("cost curves not monotonic (attempt %d); measuring again", attempt + 1)
    checks["monotonic"] = False
    checks["made_monotonic"] = True
    verify = {k: v for k, v in _running_max({0: 1.0, **verify}).items() if k > 0}
    return _running_max(draft), verify, full


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
    max_draft_tokens: int = 8,
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
    only in rounds without a copy (``eagle_hybrid``'s copy-only rounds). An adaptive draft
    grows up to ``max_draft_tokens``.
    """
    from ..drafting.prompt_lookup import NgramIndex

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
                if accepted == len(draft):
                    current = min(current + 1, max_draft_tokens)
                elif accepted < len(draft) // 2:
                    current = max(current - 1, 1)
    return result


# ----------------------------------------------------------------------------- EAGLE heads


def measure_eagle(
    engine: SpeculativeEngine,
    prompt_ids: Sequence[list[int]],
    max_new_tokens: int,
    step_seconds: float,
    head: Any = None,
    num_draft_tokens: int = 4,
) -> dict[str, Any]:
    """An EAGLE head's acceptance and draft cost on this model and hardware (empty: no head fits).

    Decodes each prompt greedily with the head's fixed-length chains (no confidence stop) and
    records how many tokens each full-length round accepted (for shorter drafts the greedy
    chain is a prefix, so it accepts ``min(n, k)``) and the drafting seconds per drafted token,
    relative to one plain step (``step_seconds``); the per-prompt median is kept.

    Args:
        engine: the calibrated engine (its model is only read).
        prompt_ids: the calibration prompts' ids.
        max_new_tokens: tokens generated per prompt.
        step_seconds: one plain step's seconds (:func:`measure_costs`).
        head: a head folder or loaded :class:`~selfspec.drafting.eagle.head.EagleHead`; ``None`` looks for one
            (:func:`~selfspec.drafting.eagle.head.find_eagle_head`).
        num_draft_tokens: the chains' length.
    """
    from ..drafting.eagle.head import find_eagle_head
    from ..errors import ConfigurationError, ModelNotFoundError

    if head is None:
        found = find_eagle_head(engine.name_or_path, engine.runner.model) if engine.name_or_path else None
        if found is None:
            return {}
        head = str(found)
    engine_class = type(engine)  # sibling engines of the caller's class: no import back to selfspec.decoding.engine
    try:
        eagle = engine_class(
            engine.model,
            engine.tokenizer,
            drafter="eagle",
            eagle_head=head,
            num_draft_tokens=num_draft_tokens,
            calibration={},
        )
    except (ConfigurationError, ModelNotFoundError) as error:
        logger.warning("calibration skips the EAGLE head %s: %s", head, error)
        return {}
    accepted: list[int] = []
    costs: list[float] = []
    tokens = rounds = 0
    for ids in prompt_ids:
        out = eagle.generate_ids(ids, max_new_tokens=max_new_tokens)
        stats = out.stats
        # every round (the last one of a generation may draft less than the full chain)
        accepted += [n for n, count in enumerate(stats.accepted_length_histogram) for _ in range(count)]
        if stats.num_drafted and step_seconds > 0:
            costs.append(stats.draft_seconds / stats.num_drafted / step_seconds)
        tokens += len(out.token_ids)
        rounds += max(0, stats.target_forwards - 1)
    if not accepted or not costs:
        return {}
    return {
        "head": head if isinstance(head, str) else getattr(head.head_config, "target", "a loaded head"),
        "num_draft_tokens": num_draft_tokens,
        "draft_cost": round(statistics.median(costs), 4),
        "accepted_per_round": accepted,
        "tau": round((tokens - len(prompt_ids)) / max(rounds, 1), 3),
        "acceptance_rate": round(sum(accepted) / (len(accepted) * num_draft_tokens), 4),
    }


# ----------------------------------------------------------------------------- layer skip search


def _subset_agreement(
    engine: SpeculativeEngine, sequences: list[tuple[torch.Tensor, int]], layers: list[int], targets: list[torch.Tensor]
) -> float:
    """Teacher-forced greedy agreement of a layer subset with the full model."""
    from ..drafting import contiguous_runs

    adapter = engine.runner
    matches = total = 0
    with torch.inference_mode():
        for (sequence, start), target in zip(sequences, targets, strict=True):
            cache = adapter.new_cache(sequence.shape[1])
            positions = torch.arange(sequence.shape[1], device=adapter.device)
            hidden = adapter.embed(sequence)
            for run_start, run_end in contiguous_runs(layers):
                hidden = adapter.run_layers(hidden, run_start, run_end, positions, cache)
            tokens = adapter.logits(hidden[:, start:-1]).argmax(-1)
            matches += int((tokens == target).sum())
            total += int(target.numel())
    return matches / max(total, 1)


def search_skip_layers(
    engine: SpeculativeEngine,
    prompt_ids: Sequence[list[int]],
    draft_cost: dict[int, float],
    verify_cost: dict[int, float],
    max_new_tokens: int = 32,
) -> tuple[list[int], float, int, float]:
    """Greedy search for the layer-skip drafter's layers (Draft & Verify / SWIFT style).

    Starting from every layer, it drops the layer whose removal costs the least agreement,
    one at a time, and keeps the subset (and draft length) with the best expected speed. A
    draft step's cost is interpolated from the measured cost per early-exit depth.

    Returns:
        ``(layers, agreement, num_draft_tokens, expected speedup)``.
    """
    engine_class = type(engine)  # sibling engines of the caller's class: no import back to selfspec.decoding.engine

    adapter = engine.runner
    plain = engine_class(engine.model, engine.tokenizer, drafter="none")
    sequences, targets = [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            new = plain.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids
            sequence = torch.tensor([ids + new], device=adapter.device)
            sequences.append((sequence, len(ids) - 1))
    for sequence, start in sequences:
        targets.append(adapter.logits(_full(adapter, sequence)[:, start:-1]).argmax(-1))
    depths = sorted(draft_cost)
    per_layer = (draft_cost[depths[-1]] - draft_cost[depths[0]]) / max(1, depths[-1] - depths[0])
    head = max(0.0, draft_cost[depths[0]] - per_layer * depths[0])

    def speed(layers: list[int], agreement: float) -> tuple[float, int]:
        cost = head + per_layer * len(layers)
        return max((expected_speedup(agreement, cost, v, k), k) for k, v in verify_cost.items())

    layers = list(range(adapter.num_layers))
    best = (0.0, layers, 1.0, 1)
    while len(layers) > 1:
        candidates = [[x for x in layers if x != drop] for drop in layers if drop != layers[-1]]
        scored = [(_subset_agreement(engine, sequences, c, targets), c) for c in candidates]
        agreement, layers = max(scored, key=lambda item: item[0])
        value, k = speed(layers, agreement)
        if value > best[0]:
            best = (value, layers, agreement, k)
    value, layers, agreement, k = best
    return layers, agreement, k, value


def _full(adapter: Any, sequence: torch.Tensor) -> torch.Tensor:
    cache = adapter.new_cache(sequence.shape[1])
    positions = torch.arange(sequence.shape[1], device=adapter.device)
    with torch.inference_mode():
        return adapter.run_layers(adapter.embed(sequence), 0, adapter.num_layers, positions, cache)


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
    engine_class = type(engine)  # sibling engines of the caller's class: no import back to selfspec.decoding.engine

    variants = [("chain", None), *((str(n), n) for n in candidates)]
    engines = {
        name: engine_class(
            engine.model,
            engine.tokenizer,
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


def layer_skip_matches(engine: SpeculativeEngine, data: Continuations, layers: list[int]) -> list[list[bool]]:
    """Per position: does the layer subset's greedy token equal the model's (teacher-forced)?"""
    from ..drafting.layer_skip import contiguous_runs

    runner = engine.runner
    out = []
    with torch.inference_mode():
        for sequence, start in zip(data.sequences, data.starts, strict=True):
            ids = torch.tensor([sequence], device=runner.device)
            cache = runner.new_cache(ids.shape[1])
            positions = torch.arange(ids.shape[1], device=runner.device)
            hidden = runner.embed(ids)
            for run_start, run_end in contiguous_runs(layers):
                hidden = runner.run_layers(hidden, run_start, run_end, positions, cache)
            tokens = runner.logits(hidden[:, start - 1 : -1]).argmax(-1)
            out.append((tokens == torch.tensor(sequence[start:], device=runner.device)).tolist())
    return out


def _layer_skip_cost(draft_cost: dict[int, float], num_kept: int) -> float:
    """A draft step through ``num_kept`` layers, interpolated from the early-exit costs."""
    depths = sorted(draft_cost)
    per_layer = (draft_cost[depths[-1]] - draft_cost[depths[0]]) / max(1, depths[-1] - depths[0])
    head = max(0.0, draft_cost[depths[0]] - per_layer * depths[0])
    return head + per_layer * num_kept


def choose_plan(
    data: Continuations,
    matches: dict[int, list[list[bool]]],
    draft_cost: dict[int, float],
    verify_cost: dict[int, float],
    *,
    skip: tuple[list[int], list[list[bool]], float] | None = None,
    exit_adapter_layer: int | None = None,
    eagle: dict[str, Any] | None = None,
    methods: Sequence[str] | None = None,
) -> tuple[Plan, dict[str, float], tuple[int, int, float]]:
    """Replay every candidate and pick the fastest; plain decoding unless one beats it by :data:`PLAIN_MARGIN`.

    Args:
        data: the model's own continuations.
        matches: per exit layer, per position, whether the early exit's token was the model's.
        draft_cost: a draft step's cost per exit layer (relative to a plain step).
        verify_cost: verifying ``k`` drafts, per ``k``.
        skip: the layer-skip subset, its per-position matches and its draft cost.
        exit_adapter_layer: the layer an exit adapter reads (the plan then uses it).
        eagle: :func:`measure_eagle`'s figures (``eagle`` and ``eagle_hybrid`` candidates).
        methods: consider only these plan methods (plain decoding always); ``None``: all.

    Returns:
        ``(plan, {candidate: predicted speedup}, (best early-exit layer, its k, its speedup))``.
    """
    lengths = sorted(verify_cost)
    candidates: dict[str, float] = {"none": 1.0}
    best_exit = (min(matches) if matches else 1, lengths[0], 0.0)
    for layer, hits in matches.items():
        costs = CostModel(draft_cost[layer], verify_cost)
        for k in lengths:
            speed = replay(data, costs, k, matches=hits).speedup
            if speed > best_exit[2]:
                best_exit = (layer, k, speed)
    exit_layer, exit_k, exit_speed = best_exit
    if matches:
        candidates[f"early_exit(E={exit_layer},k={exit_k})"] = exit_speed
    lookup_best = (2, 4, 0.0)
    for min_ngram in (1, 2):
        for k in [k for k in lengths if k <= 6] or lengths:
            speed = replay(data, CostModel(0.0, verify_cost), k, lookup=(min_ngram, 3)).speedup
            if speed > lookup_best[2]:
                lookup_best = (min_ngram, k, speed)
    min_ngram, lookup_k, lookup_speed = lookup_best
    candidates[f"prompt_lookup(min_ngram={min_ngram})"] = lookup_speed
    hybrid_speed = 0.0
    if matches:
        costs = CostModel(draft_cost[exit_layer], verify_cost)
        hybrid_speed = replay(data, costs, exit_k, matches=matches[exit_layer], lookup=(2, 3)).speedup
        candidates[f"hybrid(E={exit_layer},k={exit_k})"] = hybrid_speed
    skip_speed, skip_k = 0.0, 1
    if skip is not None:
        layers, hits, cost = skip
        for k in lengths:
            speed = replay(data, CostModel(cost, verify_cost), k, matches=hits).speedup
            if speed > skip_speed:
                skip_speed, skip_k = speed, k
        candidates[f"layer_skip({len(layers)} layers,k={skip_k})"] = skip_speed
    options = [
        (lookup_speed, Plan("prompt_lookup", num_draft_tokens=lookup_k, min_ngram=min_ngram)),
        (exit_speed, Plan("early_exit", exit_layer=exit_layer, num_draft_tokens=exit_k)),
        (hybrid_speed, Plan("hybrid", exit_layer=exit_layer, num_draft_tokens=exit_k, min_ngram=2)),
    ]
    if skip is not None:
        options.append((skip_speed, Plan("layer_skip", num_draft_tokens=skip_k, layers=skip[0])))
    if eagle and eagle.get("accepted_per_round"):
        costs = CostModel(float(eagle["draft_cost"]), verify_cost)
        longest = int(eagle.get("num_draft_tokens", lengths[-1]))
        head = str(eagle.get("head")) if eagle.get("head") else None
        for method, copies in (("eagle", False), ("eagle_hybrid", True)):
            best = (0.0, 1)
            for k in [k for k in lengths if k <= longest]:
                run = replay(
                    data,
                    costs,
                    k,
                    lookup=(2, 3) if copies else None,  # eagle_hybrid: copy-only rounds where the text repeats
                    accepted_per_round=eagle["accepted_per_round"],
                    max_draft_tokens=longest,  # measured chains were this long
                )
                best = max(best, (run.speedup, k))
            candidates[f"{method}(k={best[1]})"] = best[0]
            options.append((best[0], Plan(method, num_draft_tokens=best[1], min_ngram=2, eagle_head=head)))
    if methods is not None:
        options = [(s, p) for s, p in options if p.method in methods] or [(0.0, Plan("none"))]
    speed, plan = max(options, key=lambda item: item[0])
    if speed < PLAIN_MARGIN:
        plan = Plan("none", reason=f"no method beats plain decoding here (best: {plan.method} at {speed:.2f}x)")
        speed = 1.0
    else:
        runner_up = max((s for s, p in options if p is not plan), default=1.0)
        plan.reason = f"predicted {speed:.2f}x plain decoding (next best {max(runner_up, 1.0):.2f}x)"
    if exit_adapter_layer is not None and plan.method in ("early_exit", "hybrid"):
        plan.exit_adapter = True
    plan.predicted_speedup = round(speed, 3)
    return plan, candidates, best_exit


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
    progress: bool = True,
    layer_skip: bool = False,
    trees: bool = False,
    eagle_head: Any = None,
    methods: Sequence[str] | None = None,
) -> CalibrationResult:
    """Measure every candidate on this model and hardware, choose the plan, save it.

    Args:
        engine: the engine to calibrate (its model is only read).
        prompts: calibration prompts (text, chat messages, or token ids); by default the
            built-in mix of :func:`default_prompts`.
        max_new_tokens: tokens generated per prompt to measure acceptance on.
        max_exit_layer: the deepest exit layer to consider (default: half the layers).
        max_draft_tokens: the longest draft length to consider.
        save: write ``selfspec.json`` (beside a local model folder, else in the user cache).
        progress: show a progress bar.
        layer_skip: search the layer-skip drafter's layers greedily (slow: quadratic in the
            depth); without it the default subset is measured.
        trees: also race early-exit token trees of :data:`TREE_CANDIDATES` nodes against
            the chain at the best exit layer and draft length, and save the fastest as
            ``tree_nodes`` (``None``: the chain), which ``tree_nodes="auto"`` uses.
        eagle_head: an EAGLE head (folder or loaded head) to measure; ``None`` measures the
            one :func:`~selfspec.drafting.eagle.head.find_eagle_head` finds for the model, if any;
            ``False`` skips EAGLE.
        methods: let the plan choose only among these methods (and plain decoding);
            ``None``: every measured one.

    Returns:
        The measurements and the choice. The engine itself is not changed; a new engine
        (or ``engine.configure(result.to_json())``) uses them.
    """
    from ..drafting.layer_skip import default_skip_layers

    runner = engine.runner
    num_layers = runner.num_layers
    deepest = max_exit_layer or max(1, num_layers // 2)
    layers = list(range(1, min(deepest, num_layers - 1) + 1))
    draft_lengths = list(range(1, max_draft_tokens + 1))
    if prompts is None:
        prompts = default_prompts(engine)
    window = engine.context_window or 10**9
    # a prompt longer than a small model's window keeps its end, leaving room for a continuation
    longest = window - max(2, min(max_new_tokens, window // 4)) - 1
    prompt_ids = [ids[-longest:] for ids in (_prompt_ids(engine, p) for p in prompts)]
    max_new_tokens = max(2, min(max_new_tokens, window - max(len(p) for p in prompt_ids) - 1))
    exit_adapter = engine.config.exit_adapter

    bar = tqdm(total=5, desc="calibrating", disable=not progress, leave=False)
    bar.set_postfix_str("the model's own continuations")
    data = generate_continuations(engine, prompt_ids, max_new_tokens)
    bar.update()
    bar.set_postfix_str("acceptance per exit layer")
    matches, _ = exit_matches(engine, data, layers, exit_adapter)
    agreement = {layer: agreement_of(matches[layer]) for layer in layers}
    bar.update()
    bar.set_postfix_str("draft and verify costs")
    cost_prompt = (prompt_ids[0] * (200 // len(prompt_ids[0]) + 1))[: min(200, window - max_draft_tokens - 2)]
    checks: dict[str, Any] = {}
    draft_cost, verify_cost, step_seconds = measure_costs(engine, cost_prompt, layers, draft_lengths, checks=checks)
    bar.update()
    bar.set_postfix_str("layer skip and the plan")
    if layer_skip:
        kept, _, _, _ = search_skip_layers(engine, prompt_ids, draft_cost, verify_cost, max_new_tokens)
    else:
        kept = default_skip_layers(num_layers)
    skip_cost = _layer_skip_cost(draft_cost, len(kept))
    skip_hits = layer_skip_matches(engine, data, kept)
    bar.update()
    bar.set_postfix_str("EAGLE head")
    eagle: dict[str, Any] = {}
    if eagle_head is not False and (methods is None or {"eagle", "eagle_hybrid"} & set(methods)):
        eagle = measure_eagle(
            engine, prompt_ids, max_new_tokens, step_seconds, head=eagle_head, num_draft_tokens=min(4, max_draft_tokens)
        )
    plan, candidates, (exit_layer, num_draft_tokens, exit_speed) = choose_plan(
        data,
        matches,
        draft_cost,
        verify_cost,
        skip=(kept, skip_hits, skip_cost),
        exit_adapter_layer=None if exit_adapter is None else exit_adapter.exit_layer,
        eagle=eagle,
        methods=methods,
    )
    skip_name = next((k for k in candidates if k.startswith("layer_skip")), "")
    skip_k = int(skip_name.split("k=")[1].rstrip(")")) if skip_name else 1
    skip = {
        "layer_skip_layers": kept,
        "layer_skip_agreement": round(agreement_of(skip_hits), 4),
        "layer_skip_num_draft_tokens": skip_k,
        "layer_skip_expected_speedup": round(candidates.get(skip_name, 0.0), 3),
        "layer_skip_draft_cost": round(skip_cost, 4),
    }
    bar.update()
    bar.close()
    tree_speed: dict[str, float] = {}
    if trees:
        tree_speed = measure_tree_speed(engine, prompt_ids[:3], exit_layer, num_draft_tokens)
    result = CalibrationResult(
        exit_layer=exit_layer,
        num_draft_tokens=num_draft_tokens,
        expected_speedup=exit_speed,
        agreement=agreement,
        draft_cost=draft_cost,
        verify_cost=verify_cost,
        step_seconds=step_seconds,
        layer_skip=skip,
        tree_speed=tree_speed,
        tree_nodes=choose_tree_nodes(tree_speed),
        plan=plan,
        candidates=candidates,
        cost_checks=checks,
        eagle=eagle,
        device=str(runner.device),
        dtype=str(runner.dtype).replace("torch.", ""),
    )
    logger.info("calibrated %s: %s", engine.name_or_path or "the model", plan.summary())
    if save and engine.name_or_path:
        save_calibration(engine.name_or_path, result.to_json())
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


def show_progress() -> bool:
    """Whether first-load calibration shows its progress bar: on a terminal, unless logging silences selfspec."""
    import sys

    return sys.stderr.isatty() and logging.getLogger("selfspec").getEffectiveLevel() <= logging.WARNING


def calibrate_on_first_load(engine: SpeculativeEngine, *, trees: bool = False) -> None:
    """The loader's first-load step: measure a model without a saved calibration, save it, use it.

    Says once (a ``WARNING`` of the ``selfspec`` logger, which Python prints by default) what is
    measured, that it happens once, and where the result is saved; then how long it took and the
    plan. The progress bar shows on a terminal only (:func:`show_progress`). Shorter continuations
    than :func:`calibrate`'s default; ``engine`` is reconfigured in place from what was measured.
    """
    import time

    from .store import calibration_path

    runner = engine.runner
    where = calibration_path(engine.name_or_path, runner.device, runner.dtype)
    name = engine.name_or_path or "the model"
    logger.warning(
        "first load of %s on %s %s: measuring which drafter is fastest here (acceptance of each candidate on a "
        "few built-in prompts, draft and verify costs); this happens once, and the plan is saved to %s",
        name, runner.device.type, str(runner.dtype).replace("torch.", ""), where or "nowhere (the model has no name)",
    )  # fmt: skip
    start = time.perf_counter()
    measured = calibrate(engine, max_new_tokens=32, max_draft_tokens=6, trees=trees, progress=show_progress())
    engine.configure(measured.to_json())
    logger.warning("calibrated %s in %.0f s: %s", name, time.perf_counter() - start, measured.plan.summary())
