"""The round's steps 3-4 (accept, commit) with a fake drafter and cache: no model runs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from selfspec.core.sampling import SamplingParams
from selfspec.decoding.controller import DraftController
from selfspec.decoding.loop import RoundTimes, Row, accept_draft, commit
from selfspec.decoding.outputs import GenerationStats
from selfspec.drafting.base import DecodeState, Draft, Drafter

VOCAB = 16
EOS = 2


class FakeCache:
    """Records the rollbacks the loop asks for."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.crops: list[int] = []

    def crop_to(self, length: int) -> None:
        self.crops.append(length)
        self.length = min(self.length, length)


class Recorder(Drafter):
    name = "recorder"

    def __init__(self) -> None:
        self.observed: list[tuple[int, int]] = []

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        return Draft()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.observed.append((num_drafted, num_accepted))


def logits_choosing(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits whose argmax at row ``i`` is ``tokens[i]``."""
    logits = torch.zeros(len(tokens), VOCAB)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def row(max_new_tokens: int = 20, position: int = 5) -> Row:
    state = DecodeState(
        runner=None,  # type: ignore[arg-type]
        cache=FakeCache(position + 4),
        position=position,
        last_token=9,
        token_ids=[1, 3, 4, 5, 6, 9],
        params=SamplingParams(),
        generator=None,
        eos_token_ids=frozenset({EOS}),
    )
    run = SimpleNamespace(stats=GenerationStats(), controller=DraftController(3), max_new_tokens=max_new_tokens)
    return Row(state, run)  # type: ignore[arg-type]


def times() -> RoundTimes:
    return RoundTimes(0.0, 0.0, 0.0)


def one_round(r: Row, draft: Draft, targets: list[int]) -> list[int]:
    """Steps 3 and 4 for ``draft`` against logits choosing ``targets``."""
    return commit(Recorder(), r, draft, accept_draft(r.state, draft, logits_choosing(targets)), times())


def test_greedy_keeps_the_matching_prefix_and_the_targets_next_token() -> None:
    r, drafter = row(), Recorder()
    draft = Draft(tokens=[3, 4, 5])
    acceptance = accept_draft(r.state, draft, logits_choosing([3, 4, 7, 8]))
    assert acceptance.num_accepted == 2
    emitted = commit(drafter, r, draft, acceptance, times())
    assert emitted == [3, 4, 7]  # two drafts, then the target's correction
    assert r.state.cache.crops == [5 + 2 + 1] and r.state.position == 8  # rolled back to the accepted text
    assert r.state.last_token == 7 and r.state.token_ids[-3:] == [3, 4, 7]
    assert drafter.observed == [(3, 2)]
    stats = r.run.stats
    assert (stats.num_drafted, stats.num_accepted, stats.target_forwards) == (3, 2, 1)
    assert stats.accepted_length_histogram == [0, 0, 1]


def test_a_fully_accepted_draft_earns_the_bonus_token() -> None:
    assert one_round(row(), Draft(tokens=[3, 4]), [3, 4, 11]) == [3, 4, 11]


def test_emission_stops_after_end_of_sequence_and_at_the_budget() -> None:
    assert one_round(row(), Draft(tokens=[3, EOS, 5]), [3, EOS, 5, 6]) == [3, EOS]
    short = row(max_new_tokens=2)  # one token was emitted at the prefill: room for one more
    assert one_round(short, Draft(tokens=[3, 4]), [3, 4, 5]) == [3]


def test_an_empty_draft_is_a_plain_step() -> None:
    r = row()
    assert one_round(r, Draft(), [12]) == [12]
    assert r.state.position == 6 and r.run.stats.num_drafted == 0


# ------------------------------------------------------------------------------- log-probabilities
def test_token_logprobs_are_the_rows_log_softmax_and_top() -> None:
    from selfspec.decoding.loop import token_logprobs

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    entries = token_logprobs(logits, [4, 7, 1], top=3)
    reference = logits.log_softmax(-1)
    for row, (entry, token) in enumerate(zip(entries, [4, 7, 1], strict=True)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(reference[row, token])) < 1e-6
        assert entry.top_token_ids == reference[row].topk(3).indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), reference[row].topk(3).values)
    assert token_logprobs(logits, [4, 7, 1], top=0)[0].top_token_ids == []
    half = token_logprobs(logits.bfloat16(), [4, 7, 1], top=1)  # computed in float32, whatever the model's dtype
    assert abs(half[0].logprob - float(logits.bfloat16().float().log_softmax(-1)[0, 4])) < 1e-6


def test_emitted_rows_follow_the_chain_or_the_tree_path() -> None:
    from selfspec.core.acceptance import Acceptance
    from selfspec.core.tree import TreeAcceptance
    from selfspec.decoding.loop import emitted_rows

    state = row().state
    chain = accept_draft(state, Draft(tokens=[5, 6, 9]), logits_choosing([5, 6, 3, 8]))  # two kept, a correction
    assert isinstance(chain, Acceptance) and emitted_rows(chain) == [0, 1, 2]
    tree = accept_draft(state, Draft(tokens=[5, 9, 6], parents=[-1, -1, 0]), logits_choosing([5, 6, 1, 4]))
    assert isinstance(tree, TreeAcceptance) and list(tree.path) == [0, 2]
    assert emitted_rows(tree) == [0, 1, 3]  # root, node 0 (row 1), node 2 (row 3)
