"""The layer-skip drafter: a subset of the target's layers drafts (Draft & Verify; SWIFT)."""

from __future__ import annotations

from typing import Any

import torch

from .base import DecodeState, Draft, Drafter, draft_autoregressively
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


register_drafter("layer_skip", make_layer_skip, description="a subset of the target's layers (calibrated)")
