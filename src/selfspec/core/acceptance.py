"""Acceptance: decide how much of a draft the target keeps.

Pure functions over tensors, with no model code, so they are tested on their own.

Vocabulary (one round with ``k`` draft tokens ``d_1 .. d_k``):

* ``target_probs[i]`` is the target's processed distribution for the token after the
  ``i``-th position of the round, so ``target_probs[i]`` judges ``d_{i+1}`` and
  ``target_probs[k]`` gives the bonus token. Shape ``[k + 1, vocab]``.
* ``draft_probs[i]`` is the distribution ``d_{i+1}`` was drawn from, processed the same way.
  Shape ``[k, vocab]``; ``None`` for a deterministic drafter (prompt lookup), which is the
  same as a one-hot ``draft_probs``.
* **accepted** tokens are the draft prefix the target keeps; the **recovered** token replaces
  the first rejected draft token; the **bonus** token follows a fully accepted draft. Every
  round emits the accepted tokens plus exactly one recovered or bonus token.

Greedy acceptance keeps ``d_i`` while it equals the target's argmax. Sampling uses the
rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023 ("Accelerating Large Language Model Decoding with
Speculative Sampling"): accept ``d_i`` with probability ``min(1, target(d_i) / draft(d_i))``;
on rejection sample from ``normalize(max(0, target - draft))``. The emitted tokens then
follow the target distribution exactly, whatever the draft distribution is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample


@dataclass(frozen=True)
class Acceptance:
    """The outcome of one verification round.

    Attributes:
        num_accepted: how many draft tokens were kept (``0 .. k``).
        next_token: the recovered token (after a rejection) or bonus token (all accepted).
    """

    num_accepted: int
    next_token: int

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        """The tokens this round adds to the text: accepted drafts, then ``next_token``."""
        return [*draft_tokens[: self.num_accepted], self.next_token]


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance: keep drafts while they equal the target's argmax.

    Args:
        draft_tokens: ``[k]`` draft token ids.
        target_logits: ``[k + 1, vocab]`` target logits (or probabilities: only the argmax
            is read).

    Returns:
        The accepted count and the target's argmax at the first mismatch (or the bonus).
    """
    num_draft = draft_tokens.shape[0]
    target_tokens = target_logits.argmax(dim=-1)  # [k + 1]
    if not num_draft:
        return Acceptance(0, int(target_tokens[0].item()))
    matches = (target_tokens[:num_draft] == draft_tokens).long()
    # cumprod zeroes everything after the first mismatch
    num_accepted = matches.cumprod(dim=0).sum().view(1)
    # indexed by a tensor (an int index would read the device), then the round's one read
    accepted, token = torch.cat([num_accepted, target_tokens[num_accepted]]).tolist()
    return Acceptance(accepted, token)


def accept_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Args:
        draft_tokens: ``[k]`` draft token ids, each drawn from the matching ``draft_probs`` row.
        draft_probs: ``[k, vocab]`` draft distributions, or ``None`` when the drafter is
            deterministic (treated as one-hot on ``draft_tokens``).
        target_probs: ``[k + 1, vocab]`` target distributions after the same processing.
        generator: the random source (seed it for reproducible text).

    Returns:
        The accepted count and the recovered or bonus token.
    """
    num_draft = draft_tokens.shape[0]
    if num_draft:
        rows = torch.arange(num_draft, device=target_probs.device)
        target_of_draft = target_probs[rows, draft_tokens]  # [k]
        if draft_probs is None:
            draft_of_draft = torch.ones_like(target_of_draft)
        else:
            draft_of_draft = draft_probs[rows, draft_tokens]  # [k]
        uniform = torch.rand(num_draft, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
        # accept with probability min(1, target / draft), i.e. u * draft < target
        accepted = (uniform * draft_of_draft < target_of_draft).long()
        num_accepted = int(accepted.cumprod(dim=0).sum().item())
    else:
        num_accepted = 0

    if num_accepted == num_draft:  # all accepted: bonus token from the target
        return Acceptance(num_accepted, int(sample(target_probs[num_draft : num_draft + 1], generator)))

    rejected_target = target_probs[num_accepted]  # [vocab]
    if draft_probs is None:
        rejected_draft = torch.zeros_like(rejected_target)
        rejected_draft[draft_tokens[num_accepted]] = 1.0
    else:
        rejected_draft = draft_probs[num_accepted]
    residual = torch.clamp(rejected_target - rejected_draft, min=0)
    total = residual.sum()
    # total == 0 only when target == draft, where rejection has probability zero
    recovered_probs = residual / total if total > 0 else rejected_target
    return Acceptance(num_accepted, int(sample(recovered_probs.unsqueeze(0), generator)))
