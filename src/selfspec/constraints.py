"""Token constraints: restrict which tokens may come next (grammars, forced formats).

A constraint is applied to the draft and the target alike: drafters never propose a token
the constraint forbids, and the verifier masks the target's logits with the same masks, so
speculation stays lossless with respect to the constrained distribution.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenConstraint(Protocol):
    """What the engine needs from a constraint (for example a JSON-schema grammar matcher)."""

    def allowed_tokens(self) -> torch.Tensor:
        """A ``[vocab]`` bool tensor (on any device): which tokens may come next."""
        ...

    def advance(self, token_id: int) -> None:
        """Consume one token (it must be allowed)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens."""
        ...


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Set the logits of forbidden tokens to ``-inf``.

    Args:
        logits: ``[..., vocab]`` logits.
        allowed: ``[..., n]`` bool mask, ``n <= vocab``; tokens past ``n`` are forbidden
            (model vocabularies are often padded beyond the tokenizer's).
    """
    vocab = logits.shape[-1]
    full = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    n = min(vocab, allowed.shape[-1])
    full[..., :n] = allowed[..., :n].to(logits.device)
    return logits.masked_fill(~full, float("-inf"))
