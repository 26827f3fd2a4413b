"""The layer-skip drafter: a subset of the target's layers drafts (Draft & Verify; SWIFT)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.speed import CostModel, expected_tokens
from .base import DecodeState, Draft, Drafter, NoDrafter, draft_autoregressively
from .planning import (
    BenchContext,
    BenchRow,
    CalibrationContext,
    Candidate,
    DrafterBench,
    DrafterCalibration,
    DrafterFactory,
)
from .registry import register_drafter


def default_skip_layers(num_layers: int) -> list[int]:
    """The layer-skip drafter's layers without calibration (about 3/4 of the model).

    The first half, then every other layer of the second half, and always the last layer.
    """
    half = num_layers // 2
    kept = [*range(half), *range(half, num_layers - 1, 2), num_layers - 1]
    return sorted(set(kept))


def contiguous_runs(layers: list[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 6, 9]`` -> ``[(0, 3), (5, 7), (9, 10)]`` (half-open ranges)."""
    runs: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


class LayerSkipDrafter(Drafter):
    """Drafts with a subset of the target's layers (Draft & Verify, Zhang et al. 2024; SWIFT).

    Skipped layers pass the residual stream through unchanged. The kept layers read the
    target's own KV cache for the accepted text and write draft positions into it; those
    entries are rolled back before verification, which runs the full model on the draft, so
    the cache again holds exactly the target's states for the accepted text.

    Args:
        layers: the layers the draft runs (sorted, unique, within the model).
    """

    name = "layer_skip"

    def __init__(self, layers: list[int]) -> None:
        self.layers = sorted(set(layers))
        self.runs = contiguous_runs(self.layers)

    def __repr__(self) -> str:
        return f"LayerSkipDrafter(layers={self.layers})"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft ``max_tokens`` tokens through the kept layers only."""
        if max_tokens <= 0:
            return Draft()
        runner = state.runner
        positions = torch.arange(state.position, state.position + max_tokens, device=runner.device)

        def next_logits(token: int, j: int) -> torch.Tensor:
            hidden = runner.embed(torch.full((1, 1), token, device=runner.device))
            for start, end in self.runs:
                hidden = runner.run_layers(hidden, start, end, positions[j : j + 1], state.cache)
            return runner.logits(hidden)[0]

        draft = draft_autoregressively(state, max_tokens, next_logits)
        state.cache.crop_to(state.position)  # drop the draft's KV: verification recomputes it
        return draft


def make_layer_skip(engine: Any, **options: Any) -> LayerSkipDrafter:
    """The layer-skip drafter with the calibrated layers, else :func:`default_skip_layers`."""
    num_layers = engine.runner.num_layers
    layers = default_skip_layers(num_layers)
    saved = engine.config.calibration.get("layer_skip_layers")
    if isinstance(saved, list) and saved and all(isinstance(i, int) for i in saved):
        layers = [i for i in saved if 0 <= i < num_layers] or layers
    return LayerSkipDrafter(options.pop("layers", layers), **options)


# ----------------------------------------------------------------------------- calibration


def layer_skip_matches(engine: Any, data: Any, layers: list[int]) -> list[list[bool]]:
    """Per position: does the layer subset's greedy token equal the model's (teacher-forced)?"""
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


def layer_skip_cost(draft_cost: dict[int, float], num_kept: int) -> float:
    """A draft step through ``num_kept`` layers, interpolated from the early-exit costs."""
    depths = sorted(draft_cost)
    per_layer = (draft_cost[depths[-1]] - draft_cost[depths[0]]) / max(1, depths[-1] - depths[0])
    head = max(0.0, draft_cost[depths[0]] - per_layer * depths[0])
    return head + per_layer * num_kept


def _subset_agreement(
    engine: Any, sequences: list[tuple[torch.Tensor, int]], layers: list[int], targets: list[torch.Tensor]
) -> float:
    """Teacher-forced greedy agreement of a layer subset with the full model."""
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
    engine: Any,
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
    engine_class = type(engine)  # sibling engines of the caller's class: drafting sits below decoding

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
        return max((expected_tokens(agreement, k) / (k * cost + v), k) for k, v in verify_cost.items())

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


@dataclass
class SkipFigures:
    """What calibration measured for the layer-skip drafter.

    Attributes:
        layers: the kept layers (searched with ``calibrate(layer_skip=True)``, else the default).
        matches: per continuation and generated position, whether the subset's greedy token agreed.
        draft_cost: a draft step through the kept layers (relative to a plain step).
    """

    layers: list[int]
    matches: list[list[bool]]
    draft_cost: float


class LayerSkipCalibration(DrafterCalibration):
    """The kept layers' teacher-forced agreement on the continuations, replayed at each draft length.

    ``calibrate(layer_skip=True)`` searches the layers (slow: quadratic in the depth); without
    it the default subset is measured. The layers are saved as ``layer_skip_layers``, which
    ``drafter="layer_skip"`` reads.
    """

    figures_key = "layer_skip"
    options = ("layer_skip",)

    def measure(self, name: str, context: CalibrationContext) -> SkipFigures:
        """The kept layers, their agreement per position and their draft cost."""
        engine = context.engine
        if context.options.get("layer_skip"):
            kept, _, _, _ = search_skip_layers(
                engine, context.prompt_ids, context.draft_cost, context.verify_cost, context.max_new_tokens
            )
        else:
            kept = default_skip_layers(engine.runner.num_layers)
        cost = layer_skip_cost(context.draft_cost, len(kept))
        return SkipFigures(kept, layer_skip_matches(engine, context.data, kept), cost)

    def expected_speedup(self, name: str, context: CalibrationContext) -> float | None:
        """About the best early exit's (a layer subset costs and agrees like a middle exit)."""
        return context.best_exit[2]

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best draft length for the kept layers."""
        if figures is None:
            return []
        speed, k = 0.0, 1
        for length in context.lengths:
            run = context.replay(CostModel(figures.draft_cost, context.verify_cost), length, matches=figures.matches)
            if run.speedup > speed:
                speed, k = run.speedup, length
        settings = {"num_draft_tokens": k, "layers": figures.layers}
        label = f"{name}({len(figures.layers)} layers,k={k})"
        return [Candidate(name, settings, speed, label, figures.draft_cost)]

    def saved(self, figures: Any, candidates: list[Candidate]) -> dict[str, Any]:
        """``layer_skip_*``: the layers, their agreement, draft length, predicted speedup and draft cost."""
        if figures is None:
            return {}
        best = candidates[0] if candidates else None
        hits = figures.matches
        return {
            "layer_skip_layers": figures.layers,
            "layer_skip_agreement": round(sum(sum(m) for m in hits) / max(sum(len(m) for m in hits), 1), 4),
            "layer_skip_num_draft_tokens": best.settings["num_draft_tokens"] if best else 1,
            "layer_skip_expected_speedup": round(best.speedup if best else 0.0, 3),
            "layer_skip_draft_cost": round(figures.draft_cost, 4),
        }

    def note(self, saved: dict[str, Any]) -> str:
        """The kept layers, their agreement and predicted speedup."""
        if "layer_skip_layers" not in saved:
            return ""
        return (
            f"layer skip: layers {saved['layer_skip_layers']}, agreement {saved['layer_skip_agreement']:.3f}, "
            f"expected speedup {saved['layer_skip_expected_speedup']:.2f}x"
        )

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """How many layers, and the draft length."""
        return f"layer skip ({len(settings.get('layers', []))} layers, k={settings.get('num_draft_tokens', 4)})"

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The plan's layers that exist in the model (plain decoding when none does)."""
        layers = [i for i in settings.get("layers", []) if isinstance(i, int) and 0 <= i < engine.runner.num_layers]
        return LayerSkipDrafter(layers) if layers else NoDrafter()


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    engine = context.engine(drafter=name, num_draft_tokens=3)
    return [BenchRow(f"selfspec_{name}", engine, f"layer skipping ({engine.drafter!r}), 3 drafts", name)]


register_drafter(
    "layer_skip",
    make_layer_skip,
    description="a subset of the target's layers (calibrated)",
    calibration=LayerSkipCalibration(),
    bench=DrafterBench(_rows, {"layer_skip": "selfspec_layer_skip: a subset of the layers drafts"}),
)
