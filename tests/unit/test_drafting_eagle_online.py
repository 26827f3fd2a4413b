"""The online learner's bounds and judgement without a model: the buffer's bound, the guard's swap and rollback."""

from __future__ import annotations

import pytest
import torch

from selfspec.drafting.eagle.online import AcceptanceGuard, FeatureBuffer, OnlineSequence, OnlineSettings
from selfspec.errors import ConfigurationError


def feed(buffer: FeatureBuffer, sequence: OnlineSequence, start: int, count: int) -> None:
    """A round's ``count`` states from position ``start`` and the tokens ``x_start .. x_{start+count}``."""
    buffer.append(sequence, torch.full((count, 4), float(start)), list(range(start, start + count + 1)))


def test_a_sequence_pairs_each_feature_with_the_next_token() -> None:
    buffer, sequence = FeatureBuffer(100, 100), OnlineSequence()
    feed(buffer, sequence, 0, 5)  # the prompt's catch-up
    feed(buffer, sequence, 5, 2)  # a round that committed 2 tokens
    assert sequence.positions == 7 and sequence.prompt_length == 5
    assert sequence.tokens == list(range(8))  # one token more than features: entry t pairs f_t with x_{t+1}
    assert [c.dtype for c in sequence.chunks] == [torch.float16, torch.float16]  # float32 states stored in half
    assert [s.tokens for s in buffer.snapshot()] == [list(range(8))]


def test_the_buffer_holds_at_most_its_bound_dropping_the_oldest_generation() -> None:
    buffer = FeatureBuffer(max_positions=20, sequence_positions=8)
    sequences = [OnlineSequence() for _ in range(5)]
    for sequence in sequences:
        feed(buffer, sequence, 0, 6)
        feed(buffer, sequence, 6, 6)  # capped at 8 positions per generation
    assert all(s.positions == 8 for s in sequences)
    assert buffer.positions <= 20 and buffer.positions == sum(s.positions for s in buffer.sequences)
    assert list(buffer.sequences) == sequences[-2:] and buffer.dropped == 24
    assert all(len(s.tokens) == s.positions + 1 for s in sequences)


def test_no_swap_before_the_frozen_head_is_measured_and_rollback_below_the_margin() -> None:
    guard = AcceptanceGuard(judge_rounds=4, margin=0.1, ema_decay=0.5)
    for _ in range(3):
        guard.record(3, learned=False)
    assert not guard.may_swap()
    guard.record(3, learned=False)
    assert guard.may_swap() and guard.frozen_tau == 3.0
    guard.swapped()
    for _ in range(3):
        guard.record(2, learned=True)  # 2 < 0.9 * 3, but not judged yet
    assert not guard.falls_short()
    guard.record(2, learned=True)
    assert guard.falls_short()
    guard.rolled_back()
    assert guard.rollbacks == 1 and guard.learned_rounds == 0 and not guard.falls_short()


def test_a_learned_head_within_the_margin_stays() -> None:
    guard = AcceptanceGuard(judge_rounds=2, margin=0.1, ema_decay=0.0)
    guard.record(3, learned=False)
    guard.record(3, learned=False)
    guard.swapped()
    guard.record(3, learned=True)
    guard.record(2.8, learned=True)  # 2.8 >= 0.9 * 3
    assert not guard.falls_short()


@pytest.mark.parametrize(
    "bad", [{"buffer_positions": 0}, {"window": 1}, {"margin": 1.0}, {"step_interval": -1.0}, {"lr": 0.0}]
)
def test_bad_settings_are_refused(bad) -> None:
    with pytest.raises(ConfigurationError, match="online learning"):
        OnlineSettings(**bad)
