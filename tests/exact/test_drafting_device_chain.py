"""Chain drafts computed on the device (issue 26): a fixed width, the real length a device tensor, no host read.

:func:`~selfspec.drafting.base.draft_chain_on_device` drafts ``width`` tokens and decides on the device
where the host loop (:func:`~selfspec.drafting.base.draft_autoregressively`) would have stopped (cost
gate, confidence stop, end-of-sequence). Checked here: on random logit tables the greedy lengths and
tokens equal the host loop's exactly; the EAGLE drafter's :meth:`propose_device` equals its
:meth:`propose` round by round inside real generations (greedy, gated, confident, with EOS in the
draft); sampled first tokens follow the head's processed distribution (chi-square) and
``draft_probs`` holds the distributions used; and :meth:`propose_device` makes no host read at all.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from read_counter import counting
from scipy.stats import chisquare
from test_core_acceptance import make_distribution_model
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.core.sampling import SamplingParams, logits_to_probs
from selfspec.core.speed import CostModel, worth_drafting
from selfspec.drafting import DecodeState, DeviceDraft, Draft, Drafter, draft_autoregressively, draft_chain_on_device
from selfspec.drafting.eagle.drafter import EagleDrafter
from selfspec.drafting.eagle.head import EagleHead
from selfspec.drafting.eagle.train import EagleTrainConfig, train_eagle_head

PROMPT = [5, 9, 3, 17, 4, 8]
WIDTHS = (1, 4, 8)
#: round costs of a calibrated head (draft 0.05 a token) and of a harsh one: the gate cuts chains at various depths
CALIBRATED = CostModel(0.05, {1: 1.15, 2: 1.3, 3: 1.45, 4: 1.6, 8: 2.2})
HARSH = CostModel(0.2, {1: 1.5, 2: 1.9})


# ----------------------------------------------------------------------------- helpers
def table_state(params: SamplingParams, eos: frozenset[int], generator: torch.Generator | None = None) -> DecodeState:
    """A state for drafting from a logit table: only the device, the last token, params and eos are read."""
    runner: Any = SimpleNamespace(device=torch.device("cpu"))
    return DecodeState(runner, None, 3, 1, [0, 4, 1], params, generator, eos_token_ids=eos)


def table_logits(table: torch.Tensor) -> tuple[Callable[[int, int], torch.Tensor], Callable[[Any, int], torch.Tensor]]:
    """Both loops' ``next_logits`` from a ``[width, vocab, vocab]`` table: step ``j``'s row for the previous token."""

    def host(token: int, j: int) -> torch.Tensor:
        return table[j, token]

    def device(token: torch.Tensor, j: int) -> torch.Tensor:
        return table[j].index_select(0, token.view(1))[0]

    return host, device


def host_length(draft: DeviceDraft, eos: frozenset[int], confidence: float, costs: CostModel | None) -> int:
    """The host loop's stopping rule, replayed on a sampled device draft's own tokens and distributions."""
    assert draft.draft_probs is not None
    width, reach, expected = draft.width, 1.0, 1.0
    for j in range(width):
        top = float(draft.draft_probs[j].max())
        if costs is not None:
            if not worth_drafting(reach * top, expected, j, costs.round_cost):
                return j
            reach *= top
            expected += reach
        if int(draft.tokens[j]) in eos or (confidence > 0 and j + 1 < width and top < confidence):
            return j + 1
    return width


def count_reads(call: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    """``call()`` and its host reads (:mod:`read_counter`)."""
    with counting(monkeypatch) as counter:
        result = call()
    return result, counter.reads


@dataclass
class Comparison:
    """One round's drafts of one width: the device chain (cut to its length) and the host chain."""

    width: int
    device: list[int]
    host: list[int]
    eos: frozenset[int]
    reads: int = 0


@dataclass
class Snapshot:
    """What a catch-up changes (the pending features, the head memory's settled entries), to replay a round."""

    pending: torch.Tensor | None
    memory: Any
    settled: int = 0
    next_position: int = 0


def snapshot(drafter: Drafter, state: DecodeState) -> Snapshot:
    memory = state._memory.get(id(drafter))
    if memory is None:
        return Snapshot(state.pending_hidden, None)
    return Snapshot(state.pending_hidden, memory, memory.settled, memory.next_position)


def restore(drafter: Drafter, state: DecodeState, snap: Snapshot) -> None:
    """Undo a catch-up and a draft: the memory cropped back to its settled entries, the features handed back."""
    state.pending_hidden = snap.pending
    if snap.memory is None:
        state._memory.pop(id(drafter), None)
        return
    snap.memory.cache.crop_to(snap.settled)
    snap.memory.settled, snap.memory.next_position = snap.settled, snap.next_position


class ComparingDrafter(EagleDrafter):
    """Drafts the loop's chain with :meth:`propose`, after comparing both drafting paths at every width.

    Each comparison replays the round from the same head memory: the catch-up is undone (the
    memory cropped back to its settled entries, the pending features handed back) before the next.
    """

    def __init__(self, head: EagleHead, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> None:
        super().__init__(head, **kwargs)
        self.monkeypatch = monkeypatch
        self.comparisons: list[Comparison] = []
        self.host_reads: list[int] = []

    def compare(self, state: DecodeState, width: int, eos: frozenset[int]) -> Comparison:
        snap, own_eos = snapshot(self, state), state.eos_token_ids
        state.eos_token_ids = eos
        try:
            device, reads = count_reads(lambda: self.propose_device(state, width), self.monkeypatch)
            restore(self, state, snap)
            host, host_reads = count_reads(
                lambda: super(ComparingDrafter, self).propose(state, width), self.monkeypatch
            )
            restore(self, state, snap)
        finally:
            state.eos_token_ids = own_eos
        assert device.tokens.shape == (width,) and device.length.dim() == 0 and device.draft_probs is None
        self.host_reads.append(host_reads)
        length = int(device.length)
        return Comparison(width, device.tokens[:length].tolist(), host.tokens, eos, reads)

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        room = self._memory(state).cache.max_length
        for width in WIDTHS:
            if state.position + width - 1 > room:  # past what the target cache verifies (propose would overflow too)
                with pytest.raises(ValueError, match="head's cache"):
                    self.propose_device(state, width)
                continue
            found = self.compare(state, width, state.eos_token_ids)
            self.comparisons.append(found)
            if len(found.host) >= 2:  # again, with an end-of-sequence token mid-chain
                self.comparisons.append(self.compare(state, width, frozenset({found.host[-2]})))
        return super().propose(state, max_tokens)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny() -> Any:
    """A float64 tiny Llama whose early exits agree with it (its features are predictable)."""
    return make_model("llama", agreeing=True)


@pytest.fixture(scope="module")
def sharp_head(tiny) -> EagleHead:
    """A head trained briefly on the tiny model's own text, its logits sharpened x30.

    After 40 steps the head's argmax is often right but its distribution nearly flat; the
    sharpening spreads its top probabilities over (0, 1], so gates and confidence stops cut
    chains at every depth.
    """
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts: list[tuple[str, Any]] = [
        ("ids", torch.randint(3, 96, (6,), generator=generator).tolist()) for _ in range(16)
    ]
    config = EagleTrainConfig(
        max_seconds=60, new_tokens=24, batch_size=16, draft_vocab_size=64, max_steps=40, eval_every=40, lr=3e-3,
        unroll_after=0.0,
    )  # fmt: skip
    trained = train_eagle_head(model, None, config, prompts=prompts, progress=False).head
    head = EagleHead(tiny, trained.head_config, draft_token_ids=trained.draft_token_ids)
    head.load_state_dict(trained.state_dict())
    head.eval().requires_grad_(False)
    full_logits = head.full_logits
    head.full_logits = lambda predicted: full_logits(predicted) * 30  # type: ignore[method-assign]
    return head


# ----------------------------------------------------------------------------- the shared loop, on tables
@pytest.mark.parametrize("width", WIDTHS)
def test_greedy_lengths_and_tokens_equal_the_host_loop(width) -> None:
    """Random logit tables: every stop (gate, confidence, EOS) lands where the host loop stops."""
    generator = torch.Generator().manual_seed(width)
    vocab, lengths, stops = 10, Tally[int](), Tally[str]()
    for case in range(400):
        scale = float(torch.empty(()).uniform_(0.3, 8.0, generator=generator))
        table = torch.randn(width, vocab, vocab, generator=generator, dtype=torch.float32) * scale
        eos = frozenset({case % vocab}) if case % 3 else frozenset()
        confidence = (0.0, 0.35, 0.7)[case % 3]
        costs = (None, CALIBRATED, HARSH, CALIBRATED)[case % 4]
        params = SamplingParams()
        host_next, device_next = table_logits(table)
        host = draft_autoregressively(
            table_state(params, eos), width, host_next, confidence, costs.round_cost if costs else None
        )
        device = draft_chain_on_device(
            table_state(params, eos), width, device_next, confidence, costs.round_cost if costs else None
        )
        assert device.tokens.shape == (width,) and device.tokens.dtype == torch.long and device.draft_probs is None
        length = int(device.length)
        assert length == len(host.tokens) and device.tokens[:length].tolist() == host.tokens, case
        lengths[length] += 1
        if length < width:
            last = host.tokens[-1] if host.tokens else None
            stops["eos" if last in eos else "gate" if costs and length == 0 else "other"] += 1
    # the cases are not trivial: full chains, cut chains, empty (gated) rounds and EOS stops all occur
    assert lengths[width] > 20 and lengths[0] > 20, lengths
    if width > 1:
        assert sum(n for k, n in lengths.items() if 0 < k < width) > 20 and stops["eos"] > 5, (lengths, stops)


@pytest.mark.parametrize("width", [1, 4])
def test_sampled_draft_carries_its_distributions_and_host_stops(width) -> None:
    """Sampled: ``draft_probs`` are the processed rows used, tokens lie in their support, lengths follow the host rule.

    On this torch, ``torch.multinomial``'s one-sample path is the same exponential race, drawn from the
    same generator: then the device chain equals the host loop's token for token, as checked too.
    """
    probe = torch.softmax(torch.randn(16, generator=torch.Generator().manual_seed(0)), -1)
    same_stream = [
        int(torch.multinomial(probe[None], 1, generator=torch.Generator().manual_seed(s))[0]) for s in range(20)
    ]
    race_stream = [
        int((probe / torch.empty_like(probe).exponential_(1.0, generator=torch.Generator().manual_seed(s))).argmax())
        for s in range(20)
    ]
    generator = torch.Generator().manual_seed(10 + width)
    vocab, lengths = 10, Tally[int]()
    for case in range(200):
        params = SamplingParams(1.0) if case % 2 else SamplingParams(0.7, top_k=4, top_p=0.9)
        scale = float(torch.empty(()).uniform_(0.3, 6.0, generator=generator))
        table = torch.randn(width, vocab, vocab, generator=generator) * scale
        eos = frozenset({case % vocab})
        confidence = (0.0, 0.4)[case % 2]
        costs = (None, CALIBRATED)[(case // 2) % 2]
        host_next, device_next = table_logits(table)
        seeded = torch.Generator().manual_seed(case)
        draft = draft_chain_on_device(
            table_state(params, eos, seeded), width, device_next, confidence, costs.round_cost if costs else None
        )
        assert draft.draft_probs is not None and draft.draft_probs.shape == (width, vocab)
        previous = 1
        for j in range(width):
            expected = logits_to_probs(table[j, previous], params)
            torch.testing.assert_close(draft.draft_probs[j], expected, rtol=0, atol=0)
            assert expected[int(draft.tokens[j])] > 0  # never a token outside the processed support
            previous = int(draft.tokens[j])
        length = int(draft.length)
        assert length == host_length(draft, eos, confidence, costs)
        lengths[length] += 1
        if same_stream == race_stream:  # the host loop draws the same tokens from the same seed
            host = draft_autoregressively(
                table_state(params, eos, torch.Generator().manual_seed(case)),
                width,
                host_next,
                confidence,
                costs.round_cost if costs else None,
            )
            assert host.tokens == draft.tokens[:length].tolist(), case
            assert host.draft_probs is not None or length == 0
            if host.draft_probs is not None:
                assert torch.equal(host.draft_probs, draft.draft_probs[:length])
    assert lengths[width] > 10 and (width == 1 or len(lengths) > 2), lengths


def test_exponential_race_follows_the_distribution() -> None:
    """Frequencies of the race over a distribution with zeros (chi-square; zeros never drawn)."""
    from selfspec.drafting.base import exponential_race

    probs = torch.tensor([0.0, 0.05, 0.1, 0.0, 0.25, 0.6])
    generator = torch.Generator().manual_seed(0)
    samples = 20000
    counts = torch.bincount(torch.stack([exponential_race(probs, generator) for _ in range(samples)]), minlength=6)
    assert counts[0] == 0 and counts[3] == 0
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * samples
    assert chisquare(counts[support].double().numpy(), expected.numpy()).pvalue > 1e-3


def test_bad_input_is_refused_before_drafting() -> None:
    calls: list[int] = []

    def next_logits(token: torch.Tensor, j: int) -> torch.Tensor:
        calls.append(j)
        return torch.zeros(4)

    with pytest.raises(ValueError, match="width"):
        draft_chain_on_device(table_state(SamplingParams(), frozenset()), 0, next_logits)
    state = table_state(SamplingParams(), frozenset())
    state.constraint = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="grammar"):
        draft_chain_on_device(state, 4, next_logits)
    assert calls == []

    class HostOnly(Drafter):
        name = "host_only"

        def propose(self, state: DecodeState, max_tokens: int) -> Draft:
            return Draft()

    assert not HostOnly.supports_device_chain
    with pytest.raises(NotImplementedError, match="host_only"):
        HostOnly().propose_device(state, 4)


# ----------------------------------------------------------------------------- the EAGLE chain
@pytest.mark.parametrize(
    "confidence, costs",
    [(0.0, None), (0.5, None), (0.0, CALIBRATED), (0.3, HARSH)],
    ids=["plain", "confidence", "gate", "harsh-gate+confidence"],
)
def test_eagle_device_chain_equals_propose(tiny, sharp_head, monkeypatch, confidence, costs) -> None:
    """Every round of real generations: the device chain cut to its length is ``propose``'s chain; no host read."""
    drafter = ComparingDrafter(sharp_head, monkeypatch, confidence=confidence, costs=costs)
    assert drafter.supports_device_chain
    engine = SpeculativeEngine(tiny, drafter=drafter, num_draft_tokens=4, calibration={})
    for prompt in (PROMPT, [7, 7, 1, 30]):
        out = engine.generate_ids(prompt, max_new_tokens=24)
        assert out.token_ids == reference_greedy(tiny, prompt, 24)
    found = drafter.comparisons
    assert len(found) > 30
    for comparison in found:
        assert comparison.device == comparison.host, comparison
        assert comparison.reads == 0, comparison
    assert sum(drafter.host_reads) > len(found)  # the counter sees the host loop's reads (it can fail)
    cut = [c for c in found if len(c.host) < c.width]
    with_eos = [c for c in found if c.eos and c.host and c.host[-1] in c.eos and len(c.host) < c.width]
    lengths = Tally(len(c.host) for c in found)
    assert len(cut) > 5 and len(lengths) > 1, lengths
    if costs is not HARSH:  # chains of every kind, some long (the harsh gate drafts at most one token)
        assert lengths[0] + lengths[1] < len(found) and len(with_eos) > 3, (lengths, len(with_eos))
    if costs is not None:  # the gate empties some rounds
        assert lengths[0] > 0, lengths


def test_eagle_device_chain_only_for_chains(tiny, sharp_head) -> None:
    assert not EagleDrafter(sharp_head, tree_nodes=6).supports_device_chain
    assert not EagleDrafter(sharp_head, lookup=True).supports_device_chain
    state = table_state(SamplingParams(), frozenset())
    with pytest.raises(NotImplementedError, match="eagle"):
        EagleDrafter(sharp_head, tree_nodes=6).propose_device(state, 4)
    with pytest.raises(NotImplementedError, match="eagle_hybrid"):
        EagleDrafter(sharp_head, lookup=True).propose_device(state, 4)
    pending = torch.zeros(1, 3, 32)
    state.pending_hidden = pending
    state.constraint = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match="grammar"):
        EagleDrafter(sharp_head).propose_device(state, 4)
    assert state.pending_hidden is pending  # refused before the catch-up: the round can still go to propose


class SamplingProbe(EagleDrafter):
    """At the first round, samples the device chain many times from the same state; then drafts nothing."""

    def __init__(self, head: EagleHead, samples: int, width: int, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(head)
        self.samples, self.width, self.monkeypatch = samples, width, monkeypatch
        self.first: Tally[int] = Tally()
        self.draft: DeviceDraft | None = None
        self.expected: list[torch.Tensor] = []
        self.reads: list[int] = []

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        if self.draft is not None:
            return super().propose(state, max_tokens)
        snap = snapshot(self, state)
        for i in range(self.samples):
            counted = i < 3
            if counted:
                draft, reads = count_reads(lambda: self.propose_device(state, self.width), self.monkeypatch)
                self.reads.append(reads)
            else:
                draft = self.propose_device(state, self.width)
            self.first[int(draft.tokens[0])] += 1
            self.draft = draft
            restore(self, state, snap)
        # the distributions the rows should hold, recomputed from the head: root, then each drafted token fed back
        assert self.draft is not None
        memory, feature = self._root_feature(state)
        for j in range(self.width):
            if j > 0:
                token = self.draft.tokens[j - 1].view(1, 1)
                feature = self.head(feature, token, torch.full((1, 1), state.position + j - 1), memory.cache)
            self.expected.append(logits_to_probs(self.head.full_logits(feature)[0, 0], state.params))
        memory.cache.crop_to(memory.settled)
        return Draft()


@pytest.mark.slow
@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(1.5, top_k=5, top_p=0.95)], ids=["t1", "t1.5-topk5-topp0.95"]
)
def test_eagle_sampled_first_token_follows_the_head(params, monkeypatch) -> None:
    """Chi-square of 6,000 first tokens against the head's processed distribution (8-token model); no host read."""
    model = make_distribution_model()
    torch.manual_seed(1)
    head = EagleHead(model)
    probe = SamplingProbe(head, samples=6000, width=3, monkeypatch=monkeypatch)
    engine = SpeculativeEngine(model, drafter=probe, num_draft_tokens=3, calibration={})
    engine.generate_ids([3, 1, 4], max_new_tokens=6, temperature=params.temperature, top_k=params.top_k,
                        top_p=params.top_p, seed=0)  # fmt: skip
    draft = probe.draft
    assert draft is not None and draft.draft_probs is not None and draft.draft_probs.shape == (3, 8)
    for row, expected in zip(draft.draft_probs, probe.expected, strict=True):
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=1e-7)
    first = probe.expected[0].double()
    counts = torch.tensor([probe.first[t] for t in range(8)], dtype=torch.float64)
    support = first > 0
    assert counts[~support].sum() == 0  # never a token the processed distribution excludes
    assert support.sum() > 2 and (params.top_k is None or support.sum() <= params.top_k)
    expected = first[support] * counts.sum() / first[support].sum()
    assert (expected >= 5).all(), expected  # every cell big enough for the chi-square
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
    assert probe.reads == [0, 0, 0]
