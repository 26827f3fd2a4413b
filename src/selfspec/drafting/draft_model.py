"""The draft-model drafter: a separate, smaller model that shares the target's tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigurationError
from ..modeling.cache import StaticKVCache
from ..modeling.runner import ModelRunner
from .base import DecodeState, Draft, Drafter, draft_autoregressively
from .draft_model_options import OPTIONS
from .planning import BenchContext, BenchRow, DrafterBench
from .registry import register_drafter


class DraftModelDrafter(Drafter):
    """Drafts with a separate, smaller model that shares the target's tokenizer.

    The classic scheme (Leviathan et al. 2023; Chen et al. 2023). The draft model keeps its
    own KV cache per generation, kept in step with the target's: before each round it is
    cropped to the accepted text and catches up on the tokens it has not seen (the prompt at
    first, then the target's recovered or bonus token). Its logits are processed exactly
    like the target's, so sampling stays lossless.

    Args:
        draft_model: a loaded causal LM of a supported architecture, on the target's device.
        vocab_size: the target's vocabulary size (draft logits are cut or padded to it).
    """

    name = "draft_model"

    def __init__(self, draft_model: Any, vocab_size: int) -> None:
        self.runner = ModelRunner(draft_model)
        self.vocab_size = vocab_size

    @property
    def adapter(self) -> ModelRunner:
        """The draft model's runner (the name before ``runner``)."""
        return self.runner

    def __repr__(self) -> str:
        config = self.runner.config
        return f"DraftModelDrafter({config.model_type}, num_layers={self.runner.num_layers})"

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.runner.logits(hidden)[0]  # [draft vocab]
        if logits.shape[-1] >= self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((self.vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Catch the draft cache up to the accepted text, then draft ``max_tokens`` tokens."""
        if max_tokens <= 0:
            return Draft()
        runner, device = self.runner, self.runner.device
        assert isinstance(state.cache, StaticKVCache)
        cache = state.memory(self, lambda: runner.new_cache(state.cache.max_length + 1))
        cache.crop_to(state.position)  # keep only positions of the accepted text
        seen = cache.lengths[0]
        if seen < state.position:  # tokens the draft model has not processed yet
            missing = torch.tensor([state.token_ids[seen : state.position]], device=device)
            positions = torch.arange(seen, state.position, device=device)
            runner.run_layers(runner.embed(missing), 0, runner.num_layers, positions, cache)
        positions = torch.arange(state.position, state.position + max_tokens, device=device)

        def next_logits(token: int, j: int) -> torch.Tensor:
            ids = torch.full((1, 1), token, device=device)
            return self._logits(runner.run_layers(runner.embed(ids), 0, runner.num_layers, positions[j : j + 1], cache))

        return draft_autoregressively(state, max_tokens, next_logits)


def check_draft_model(engine: Any, draft_model: Any, draft_tokenizer: Any) -> None:
    """Raise :class:`ConfigurationError` unless ``draft_model`` can draft for the engine's target."""
    runner = engine.runner
    if draft_model is None or isinstance(draft_model, (str, os.PathLike)):
        raise ConfigurationError(
            "drafter='draft_model' needs draft_model= a loaded model (from_pretrained also takes a name)"
        )
    if engine.tokenizer is not None and draft_tokenizer is not None:
        same = engine.tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    else:
        same = int(draft_model.config.vocab_size) == runner.vocab_size
    if not same:
        raise ConfigurationError(
            "the draft model's vocabulary differs from the target's; a draft model must share the target's tokenizer"
        )
    draft_device = draft_model.get_input_embeddings().weight.device
    if draft_device != runner.device:
        raise ConfigurationError(f"the draft model is on {draft_device}, the target on {runner.device}")


def make_draft_model(engine: Any, **options: Any) -> DraftModelDrafter:
    """The draft-model drafter for the engine's ``draft_model`` (checked against the target)."""
    settings = engine.config
    check_draft_model(engine, settings.draft_model, settings.draft_tokenizer)
    return DraftModelDrafter(settings.draft_model, engine.runner.vocab_size, **options)


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    """With a loaded draft model (sharing the tokenizer): a fixed-length row."""
    if context.draft_model is None:
        return []
    k = context.num_draft_tokens
    engine = context.engine(drafter=name, draft_model=context.draft_model, num_draft_tokens=k)
    model = context.draft_model
    shown = Path(getattr(model.config, "_name_or_path", "") or type(model).__name__).name
    return [BenchRow(f"selfspec_{name}", engine, f"separate draft model {shown}, {k} drafts, fixed", name)]


register_drafter(
    "draft_model",
    make_draft_model,
    description="a separate small model sharing the tokenizer (draft_model=)",
    options=OPTIONS,
    bench=DrafterBench(_rows, {"draft_model": "selfspec_draft_model (when a draft model is given)"}),
)
