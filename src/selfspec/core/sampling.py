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

from .validation import check_temperature, check_top_k, check_top_p


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    Attributes:
        temperature: ``0`` is greedy decoding; a finite positive value divides the logits.
        top_k: keep only the ``top_k`` most likely tokens (``None`` or ``0``: keep all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``
            (``None`` or ``1.0``: keep all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # validated (bool is not a number; temperature is finite) and stored as plain Python
        # numbers, so NumPy or 0-d tensor arguments behave like ints and floats
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        object.__setattr__(self, "top_k", check_top_k(self.top_k))
        object.__setattr__(self, "top_p", check_top_p(self.top_p))

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
