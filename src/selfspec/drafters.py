"""Drafters: propose tokens for the target to verify. A drafter never decides.

Each drafter implements :meth:`Drafter.propose`, which returns a :class:`Draft` of at most
``max_tokens`` tokens, and may learn from the outcome in :meth:`Drafter.observe` (the
two-method contract of transformers' candidate generators).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from .adapter import ModelAdapter
from .cache import StaticKVCache
from .constraints import TokenConstraint, apply_mask
from .sampling import SamplingParams, logits_to_probs, sample


@dataclass
class DecodeState:
    """The state of one generation between rounds.

    The cache holds positions ``< position`` in every layer; ``last_token`` is the last
    emitted token, not yet in the cache.
    """

    adapter: ModelAdapter
    cache: StaticKVCache
    position: int
    last_token: int
    token_ids: list[int]  # prompt + emitted tokens, last_token included
    params: SamplingParams
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None


@dataclass
class Draft:
    """A drafter's proposal.

    Attributes:
        tokens: ``[k]`` proposed token ids.
        draft_probs: ``[k, vocab]`` distributions the tokens were sampled from, or ``None``
            when greedy or deterministic (then verification is by exact match, or one-hot).
        exit_states: ``[1, k, hidden]`` exit-layer states of positions ``P .. P + k - 1``
            (``last_token`` and the first ``k - 1`` drafts), when the drafter ran the
            target's own first ``exit_layer`` layers; the verifier continues from them.
        exit_layer: the layer those states come from.
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Proposes draft tokens for one round."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Propose at most ``max_tokens`` tokens to follow ``state.last_token``."""

    def observe(self, num_drafted: int, num_accepted: int) -> None:  # noqa: B027
        """Learn from how many of the proposed tokens the target accepted."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoDrafter(Drafter):
    """Proposes nothing: the loop becomes plain autoregressive decoding (the baseline)."""

    name = "none"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Return an empty draft."""
        return Draft()


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
) -> tuple[int, torch.Tensor | None]:
    """Pick one token from ``[vocab]`` logits: argmax when greedy, else sample.

    Returns:
        The token and, when sampling, the processed distribution it was drawn from.
    """
    if constraint is not None:
        logits = apply_mask(logits, constraint.allowed_tokens())
    if params.greedy:
        return int(logits.argmax().item()), None
    probs = logits_to_probs(logits, params)
    return int(sample(probs.unsqueeze(0), generator)[0].item()), probs


class EarlyExitDrafter(Drafter):
    """Drafts with the target's own first ``exit_layer`` layers (LayerSkip-style).

    The draft head is the target's final norm and LM head applied to the exit layer's
    state (Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and
    Self-Speculative Decoding"). Drafting writes the shallow layers' KV cache for the draft
    positions and keeps the exit states, so verification starts at ``exit_layer`` and the
    first layers never run twice on the same token.

    Args:
        exit_layer: number of layers the draft runs (``1 .. num_layers - 1``).
    """

    name = "early_exit"

    def __init__(self, exit_layer: int) -> None:
        self.exit_layer = exit_layer

    def __repr__(self) -> str:
        return f"EarlyExitDrafter(exit_layer={self.exit_layer})"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens from the exit layer."""
        if max_tokens <= 0:
            return Draft()
        adapter, exit_layer = state.adapter, self.exit_layer
        device = adapter.device
        token = state.last_token
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        constraint = state.constraint
        for j in range(max_tokens):
            ids = torch.tensor([[token]], device=device)
            positions = torch.tensor([state.position + j], device=device)
            hidden = adapter.run_layers(adapter.embed(ids), 0, exit_layer, positions, state.cache)
            states.append(hidden)
            logits = adapter.logits(hidden)[0]  # [vocab]
            token, token_probs = choose_token(logits, state.params, state.generator, constraint)
            if constraint is not None:
                constraint.advance(token)
            tokens.append(token)
            if token_probs is not None:
                probs.append(token_probs)
        if constraint is not None:
            constraint.rollback(len(tokens))
        return Draft(
            tokens=tokens,
            draft_probs=torch.stack(probs) if probs else None,
            exit_states=torch.cat(states, dim=1),  # [1, k, hidden]
            exit_layer=exit_layer,
        )
