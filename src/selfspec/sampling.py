"""Logits processing and sampling, shared by drafters and verification.

The lossless rule needs the draft and target distributions to be processed identically, so
both sides go through :func:`logits_to_probs`. The warpers mirror transformers'
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` (applied in that
order, as ``generate`` does), so that a sampled token follows the same distribution as
``model.generate(do_sample=True, ...)`` with the same settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    Attributes:
        temperature: ``0`` is greedy decoding; a positive value divides the logits.
        top_k: keep only the ``top_k`` most likely tokens (``None`` or ``0``: keep all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``
            (``None`` or ``1.0``: keep all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise SamplingError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise SamplingError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise SamplingError(f"top_k must be an integer >= 0 (0 or None: off), got {self.top_k!r}")
        if self.top_p is not None and (not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1] (1 or None: off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax rather than sampled."""
        return self.temperature == 0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits, as transformers' warpers do.

    Args:
        logits: ``[..., vocab]`` raw logits (any float dtype; computed in float32 or wider).
        params: the sampling parameters. Greedy params return the logits unchanged.

    Returns:
        ``[..., vocab]`` processed logits, with removed tokens set to ``-inf``.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if params.greedy:
        return logits
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if params.top_k:
        top_k = min(params.top_k, vocab)
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_scores, sorted_index = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - params.top_p)
        sorted_remove[..., -1:] = False  # keep at least the most likely token
        remove = sorted_remove.scatter(-1, sorted_index, sorted_remove)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the processed distribution that tokens are sampled from.

    Args:
        logits: ``[..., vocab]`` raw logits.
        params: sampling parameters; must not be greedy.

    Returns:
        ``[..., vocab]`` probabilities summing to one.
    """
    return torch.softmax(process_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` (``[rows, vocab]`` -> ``[rows]``)."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
