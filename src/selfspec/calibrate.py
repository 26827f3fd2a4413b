"""Calibration: choose the exit layer and draft length by measurement on this hardware.

It measures how well each exit layer drafts and what drafting costs here, then picks the
exit layer and draft length with the highest expected speed. With per-token acceptance
``a`` at exit layer ``E``, draft length ``k``, the cost of one draft step relative to a
full one-token step ``c_E`` and the cost of a ``k + 1``-token verify relative to a
one-token step ``v_k``, one round emits on average ``(1 - a^(k+1)) / (1 - a)`` tokens for
``k c_E + v_k`` step-costs (Leviathan et al. 2023, with the verify cost measured rather
than assumed to be 1).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .calibration import save_calibration

if TYPE_CHECKING:
    from .engine import SpeculativeEngine

#: Prompts used when none are given: prose, dialogue and a chat turn.
DEFAULT_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    '"My dear Mr. Bennet," said his lady to him one day, "have you heard that',
    "The family of Dashwood had long been settled in Sussex. Their estate was large, and",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement,",
    "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be",
)


@dataclass
class CalibrationResult:
    """What calibration measured and chose.

    Attributes:
        exit_layer: the chosen exit layer.
        num_draft_tokens: the chosen draft length.
        expected_speedup: the model's predicted speedup for that choice.
        agreement: greedy agreement of each exit layer with the last layer.
        draft_cost: cost of one draft step at each exit layer, relative to a full step.
        verify_cost: cost of verifying ``k`` drafts (``k + 1`` tokens), relative to a full step.
        step_seconds: median seconds of one full one-token step.
        layer_skip: with ``layer_skip=True``: the searched layers (``layer_skip_layers``),
            their agreement, draft length and expected speedup.
        tree_speed: with ``trees=True``: measured greedy tokens per second of the chain
            (``"chain"``) and of each early-exit tree node budget.
        tree_nodes: with ``trees=True``: the fastest, ``None`` when the chain was fastest
            (what ``tree_nodes="auto"`` uses).
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
        data["source"] = "calibrate"
        data["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data["hardware"] = f"{platform.machine()} {torch.get_num_threads()} threads"
        return data


def expected_speedup(agreement: float, draft_cost: float, verify_cost: float, num_draft: int) -> float:
    """Expected tokens per unit of plain-step cost: ``(1 - a^(k+1)) / ((1 - a)(k c + v))``."""
    a = min(max(agreement, 0.0), 0.999)
    tokens_per_round = (1 - a ** (num_draft + 1)) / (1 - a)
    return tokens_per_round / (num_draft * draft_cost + verify_cost)


def choose(
    agreement: dict[int, float], draft_cost: dict[int, float], verify_cost: dict[int, float]
) -> tuple[int, int, float]:
    """The ``(exit_layer, num_draft_tokens, expected speedup)`` that maximises expected speed."""
    best = (min(agreement), 1, 0.0)
    for layer, a in agreement.items():
        for k, v in verify_cost.items():
            speed = expected_speedup(a, draft_cost[layer], v, k)
            if speed > best[2]:
                best = (layer, k, speed)
    return best


def measure_agreement(
    engine: SpeculativeEngine, prompt_ids: Sequence[list[int]], layers: Sequence[int], max_new_tokens: int
) -> dict[int, float]:
    """Greedy agreement of each exit layer with the last layer, on the model's own continuations."""
    from .engine import SpeculativeEngine

    adapter = engine.adapter
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none")
    matches = dict.fromkeys(layers, 0)
    total = 0
    with torch.inference_mode():
        for ids in prompt_ids:
            new = plain.generate_ids(ids, max_new_tokens=max_new_tokens).token_ids
            sequence = torch.tensor([ids + new], device=adapter.device)
            start = len(ids) - 1  # positions whose next token was generated
            cache = adapter.new_cache(sequence.shape[1])
            hidden = adapter.embed(sequence)
            positions = torch.arange(sequence.shape[1], device=adapter.device)
            exits: dict[int, torch.Tensor] = {}
            done = 0
            for layer in sorted(layers):
                hidden = adapter.run_layers(hidden, done, layer, positions, cache)
                done = layer
                exits[layer] = adapter.logits(hidden[:, start:-1]).argmax(-1)
            final = adapter.run_layers(hidden, done, adapter.num_layers, positions, cache)
            target = adapter.logits(final[:, start:-1]).argmax(-1)
            total += int(target.numel())
            for layer, tokens in exits.items():
                matches[layer] += int((tokens == target).sum())
    return {layer: matches[layer] / max(total, 1) for layer in layers}


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_costs(
    engine: SpeculativeEngine,
    prompt_ids: list[int],
    layers: Sequence[int],
    draft_lengths: Sequence[int],
    repeats: int = 7,
) -> tuple[dict[int, float], dict[int, float], float]:
    """Relative costs of a draft step per exit layer and of a verify per draft length."""
    adapter = engine.adapter
    device = adapter.device
    length = len(prompt_ids)
    cache = adapter.new_cache(length + max(draft_lengths) + 2)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=device)
        adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, torch.arange(length, device=device), cache)

        def step(start_layer: int, end_layer: int, num_tokens: int, head: bool) -> None:
            tokens = torch.tensor([prompt_ids[-num_tokens:]], device=device)
            positions = torch.arange(length, length + num_tokens, device=device)
            hidden = adapter.run_layers(adapter.embed(tokens), start_layer, end_layer, positions, cache)
            if head:
                adapter.logits(hidden)
            if device.type == "cuda":
                torch.cuda.synchronize()
            cache.crop_to(length)

        full = _median_seconds(lambda: step(0, adapter.num_layers, 1, True), repeats)
        draft = {
            layer: _median_seconds(lambda layer=layer: step(0, layer, 1, True), repeats) / full for layer in layers
        }
        verify = {
            k: _median_seconds(lambda k=k: step(0, adapter.num_layers, k + 1, True), repeats) / full
            for k in draft_lengths
        }
    return draft, verify, full


def _subset_agreement(
    engine: SpeculativeEngine, sequences: list[tuple[torch.Tensor, int]], layers: list[int], targets: list[torch.Tensor]
) -> float:
    """Teacher-forced greedy agreement of a layer subset with the full model."""
    from .drafting import contiguous_runs

    adapter = engine.adapter
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
    from .engine import SpeculativeEngine

    adapter = engine.adapter
    plain = SpeculativeEngine(engine.model, engine.tokenizer, drafter="none")
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
    from .engine import SpeculativeEngine

    variants = [("chain", None), *((str(n), n) for n in candidates)]
    engines = {
        name: SpeculativeEngine(
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


def calibrate(
    engine: SpeculativeEngine,
    prompts: Sequence[str] | Sequence[list[int]] | None = None,
    *,
    max_new_tokens: int = 48,
    max_exit_layer: int | None = None,
    max_draft_tokens: int = 8,
    save: bool = True,
    progress: bool = True,
    layer_skip: bool = False,
    trees: bool = False,
) -> CalibrationResult:
    """Measure agreement and costs, choose ``exit_layer`` and ``num_draft_tokens``, save them.

    Args:
        engine: the engine to calibrate (its model is only read).
        prompts: calibration prompts (text, or token ids); defaults to a few prose openings.
        max_new_tokens: tokens generated per prompt to measure agreement on.
        max_exit_layer: the deepest exit layer to consider (default: half the layers).
        max_draft_tokens: the longest draft length to consider.
        save: write ``selfspec.json`` beside the model (or in the user cache for a hub model).
        progress: show a progress bar.
        layer_skip: also search the layer-skip drafter's layers (slower: a greedy search).
        trees: also race early-exit token trees of :data:`TREE_CANDIDATES` nodes against
            the chain at the chosen exit layer and draft length, and save the fastest as
            ``tree_nodes`` (``None``: the chain), which ``tree_nodes="auto"`` uses.

    Returns:
        The measurements and the choice. The engine itself is not changed; a new engine
        with ``exit_layer="auto"`` picks the saved values up.
    """
    num_layers = engine.adapter.num_layers
    deepest = max_exit_layer or max(1, num_layers // 2)
    layers = list(range(1, min(deepest, num_layers - 1) + 1))
    draft_lengths = list(range(1, max_draft_tokens + 1))
    if prompts is None:
        prompts = DEFAULT_CALIBRATION_PROMPTS if engine.tokenizer is not None else [[1, 2, 3, 4, 5, 6, 7, 8]]
    prompt_ids = [engine.encode_prompt(p) if isinstance(p, str) else list(p) for p in prompts]
    window = engine.context_window or 10**9
    max_new_tokens = max(1, min(max_new_tokens, window - max(len(p) for p in prompt_ids) - 1))

    bar = tqdm(total=2, desc="calibrating", disable=not progress, leave=False)
    bar.set_postfix_str("agreement per exit layer")
    agreement = measure_agreement(engine, prompt_ids, layers, max_new_tokens)
    bar.update()
    bar.set_postfix_str("draft and verify costs")
    cost_prompt = (prompt_ids[0] * (200 // len(prompt_ids[0]) + 1))[: min(200, window - max_draft_tokens - 2)]
    draft_cost, verify_cost, step_seconds = measure_costs(engine, cost_prompt, layers, draft_lengths)
    bar.update()
    bar.close()

    exit_layer, num_draft_tokens, speedup = choose(agreement, draft_cost, verify_cost)
    skip: dict[str, Any] = {}
    if layer_skip:
        layers_kept, skip_agreement, skip_k, skip_speed = search_skip_layers(
            engine, prompt_ids, draft_cost, verify_cost, max_new_tokens
        )
        skip = {
            "layer_skip_layers": layers_kept,
            "layer_skip_agreement": round(skip_agreement, 4),
            "layer_skip_num_draft_tokens": skip_k,
            "layer_skip_expected_speedup": round(skip_speed, 3),
        }
    tree_speed: dict[str, float] = {}
    if trees:
        tree_speed = measure_tree_speed(engine, prompt_ids[:3], exit_layer, num_draft_tokens)
    result = CalibrationResult(
        exit_layer=exit_layer,
        num_draft_tokens=num_draft_tokens,
        expected_speedup=speedup,
        agreement=agreement,
        draft_cost=draft_cost,
        verify_cost=verify_cost,
        step_seconds=step_seconds,
        layer_skip=skip,
        tree_speed=tree_speed,
        tree_nodes=choose_tree_nodes(tree_speed),
    )
    if save and engine.name_or_path:
        save_calibration(engine.name_or_path, result.to_json())
    return result
