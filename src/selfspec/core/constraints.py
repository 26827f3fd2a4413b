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


def draft_masks(constraint: TokenConstraint | None, tokens: list[int]) -> list[torch.Tensor] | None:
    """The constraint's allowed-token masks at each verified position of a chain (``None``: no constraint).

    Walks the draft through the constraint and stops at the first forbidden token (the draft is
    cut there: one mask per kept draft token plus one for the token after them), then rolls
    the constraint back.
    """
    if constraint is None:
        return None
    masks: list[torch.Tensor] = []
    consumed = 0
    for token in tokens:
        allowed = constraint.allowed_tokens()
        masks.append(allowed)
        if token >= allowed.shape[-1] or not bool(allowed[token]):
            break
        constraint.advance(token)
        consumed += 1
    else:
        masks.append(constraint.allowed_tokens())
    constraint.rollback(consumed)
    return masks
