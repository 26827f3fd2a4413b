"""The acceptance functions alone: greedy, rejection, bonus, all-rejected, all-accepted."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.core.acceptance import accept_greedy, accept_sampled


def one_hot_logits(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_all_accepted_gives_bonus() -> None:
    result = accept_greedy(torch.tensor([1, 2, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (result.num_accepted, result.next_token) == (3, 4)
    assert result.emitted([1, 2, 3]) == [1, 2, 3, 4]


def test_greedy_first_mismatch_is_corrected() -> None:
    result = accept_greedy(torch.tensor([1, 5, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (result.num_accepted, result.next_token) == (1, 2)
    assert result.emitted([1, 5, 3]) == [1, 2]


def test_greedy_all_rejected() -> None:
    result = accept_greedy(torch.tensor([0, 2]), one_hot_logits([1, 2, 3]))
    assert (result.num_accepted, result.next_token) == (0, 1)


def test_greedy_empty_draft_is_plain_decoding() -> None:
    result = accept_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([4]))
    assert (result.num_accepted, result.next_token) == (0, 4)


def test_sampled_identical_distributions_accept_everything() -> None:
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        drafts = torch.multinomial(probs[:3], 1, generator=gen).squeeze(-1)
        assert accept_sampled(drafts, probs[:3], probs, gen).num_accepted == 3


def test_sampled_impossible_draft_is_always_rejected_and_recovered_elsewhere() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        result = accept_sampled(torch.tensor([0]), draft, target, gen)
        assert result.num_accepted == 0
        assert result.next_token in (1, 2)  # the residual max(0, target - draft)


def test_sampled_bonus_comes_from_last_target_row() -> None:
    target = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    result = accept_sampled(torch.tensor([1]), None, target, torch.Generator().manual_seed(0))
    assert (result.num_accepted, result.next_token) == (1, 2)


def test_sampled_one_token_marginal_matches_target() -> None:
    """One draft position: the emitted first token follows the target exactly (many draws)."""
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        token = torch.multinomial(draft[0], 1, generator=gen)
        result = accept_sampled(token, draft, target, gen)
        first = int(token) if result.num_accepted else result.next_token
        counts[first] += 1
    assert torch.allclose(counts / n, target[0], atol=0.012)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=5),
    st.lists(st.integers(0, 5), min_size=1, max_size=6),
)
def test_greedy_matches_reference(draft: list[int], target_tokens: list[int]) -> None:
    """Against a plain-Python reference of the greedy rule."""
    target_tokens = (target_tokens * 6)[: len(draft) + 1]
    result = accept_greedy(torch.tensor(draft, dtype=torch.long), one_hot_logits(target_tokens))
    n = 0
    while n < len(draft) and draft[n] == target_tokens[n]:
        n += 1
    assert (result.num_accepted, result.next_token) == (n, target_tokens[n])


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_sampled_never_emits_zero_probability_tokens(num_draft: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(num_draft + 1, 8, generator=gen), -1)
    target[:, 5:] = 0  # tokens 5..7 impossible under the target
    target = target / target.sum(-1, keepdim=True)
    draft = torch.softmax(torch.randn(num_draft, 8, generator=gen), -1)
    tokens = torch.multinomial(draft, 1, generator=gen).squeeze(-1) if num_draft else torch.tensor([], dtype=torch.long)
    result = accept_sampled(tokens, draft, target, gen)
    emitted = result.emitted(tokens.tolist())
    assert all(t < 5 for t in emitted[result.num_accepted :])
    assert all(t < 5 for t in emitted[: result.num_accepted])
