"""The drafting contract: what a drafter is given, what it returns, and how it joins a batch.

A drafter proposes; it never decides (``../DESIGN.md``). Each round the loop
(:mod:`selfspec.decoding.loop`) calls :meth:`Drafter.propose` with the generation's
:class:`DecodeState` and a token budget, verifies the returned :class:`Draft` in one target
forward (:mod:`selfspec.decoding.verify`), keeps an accepted prefix (:mod:`selfspec.core.acceptance`) and
tells the drafter how it went (:meth:`Drafter.observe`): the two-method contract of
transformers' candidate generators.

What a :class:`Draft` must hold:

* ``tokens``: the proposed token ids (at most ``max_tokens`` of them for a chain; for a tree,
  at most ``max_tokens`` levels). An empty draft makes the round a plain decoding step.
* ``draft_probs``: when the tokens were *sampled*, the ``[k, vocab]`` distributions they were
  drawn from, processed like the target's (:func:`selfspec.core.sampling.logits_to_probs`); leave
  it ``None`` for deterministic picks (greedy drafts, copies): the verifier then treats them
  as one-hot, which is exact.
* ``parents`` (optional): a token tree, see :mod:`selfspec.core.tree`. A drafter that drafts trees
  sets a ``tree_nodes`` attribute (the most nodes it proposes), so the cache has room.
* ``exit_states`` / ``exit_layer`` (optional): the target's own hidden states after its first
  ``exit_layer`` layers, when the drafter computed them (early exit). The verifier then runs
  only the remaining layers on them. A drafter that does not run the target leaves them unset.

How a drafter reads the target's hidden features: set ``needs_hidden = True`` and the verifier
keeps ``state.last_hidden``, the last decoder layer's output (before the final norm) at the
position that chose ``state.last_token`` (Medusa heads read it). A drafter that also sets
``needs_committed_hidden = True`` gets those states for every position the text commits, in
``state.pending_hidden`` (a feature head such as EAGLE feeds them to its own cache and sets the
field back to ``None``). A drafter that reads other layers' states (an EAGLE-3 head) sets
``feature_layers``: the verifier then keeps, instead of the last layer's output, the states
*entering* those layers (``i == num_layers``: the last layer's output before the final norm),
concatenated in that order, captured during the forwards that run anyway. Per-generation memory (an
n-gram index, a draft model's cache) lives in ``state.memory(self, factory)``, never in the
drafter object, which is shared by every generation of an engine.

Batching: a drafter whose rounds may run in a batch sets ``can_batch = True``. The scheduler
(:mod:`selfspec.decoding.batching`) then calls :meth:`Drafter.propose_batch` with every active row;
the default runs :meth:`Drafter.propose` row by row, which is right for drafters that only
read the token history (their drafts are verified together in one forward). A drafter that
runs the model (the early exit) overrides it to draft every row in the same forwards. A
drafter with ``can_batch = False`` still works on a batching engine: its generations run
alone, each a batch of one.

Rounds of a fixed width (issue 26): a drafter with ``supports_device_chain = True`` also
implements :meth:`Drafter.propose_device`, which drafts exactly ``width`` chain tokens and decides
on the device how many are real (:class:`DeviceDraft`: the tokens and a 0-d length tensor), so a
round can be verified with a single device-to-host read. :func:`draft_chain_on_device` is
:func:`draft_autoregressively`'s twin for it: the same cost gate, confidence stop and
end-of-sequence stop, as device-side masks over the full-width draft.

In the static round (``compile=``, :mod:`selfspec.decoding.static_round`) a drafter is reached
through two members only: :attr:`Drafter.static_drafting`, how the round drafts for it
(:class:`StaticDrafting`: a host chain sent in one copy, a device draft, or not at all: the
eager loop serves its calls), and :meth:`Drafter.draft_static`, the round's draft
(:class:`StaticDraft`: a host chain, or a device chain with, for a drafter that ran the target's
own first layers, their exit states); :meth:`Drafter.prepare_static` compiles the round's steps
it will use ahead of a call. The round never asks which class a drafter is.

Writing one: subclass :class:`Drafter`, implement ``propose``, and register a factory with
:func:`selfspec.register_drafter` (``docs/custom_drafter.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..core.constraints import TokenConstraint, apply_mask
from ..core.sampling import SamplingParams, logits_to_probs, sample
from ..core.speed import worth_drafting
from ..modeling.transfer import device_ids

if TYPE_CHECKING:
    from ..modeling.runner import ModelRunner
    from ..modeling.static_step import StaticStep

T = TypeVar("T")


@dataclass
class DecodeState:
    """The state of one generation between rounds (one row of a batch).

    The cache holds positions ``< position`` in every layer; ``last_token`` is the last
    emitted token, not yet in the cache.

    Attributes:
        runner: the target's :class:`~selfspec.modeling.ModelRunner`.
        cache: the generation's KV cache; in a batched round, the batch's cache (this row is
            ``row`` of it).
        position: positions the cache holds for this generation.
        last_token: the last emitted token.
        token_ids: prompt + emitted tokens, ``last_token`` included.
        params: the sampling parameters (the draft must be processed the same way).
        generator: the generation's random source.
        constraint: a grammar constraint, or ``None``.
        eos_token_ids: end-of-sequence tokens (drafting past one is wasted work).
        last_hidden: ``[1, 1, hidden]`` last decoder layer's output (before the final norm) at
            ``position - 1``, the state that chose ``last_token``; kept only for drafters with
            ``needs_hidden``.
        pending_hidden: ``[1, m, hidden]`` the same states at the ``m`` positions committed since
            the drafter last took them (the prompt after the prefill, then each round's
            ``last_token`` and accepted drafts), ending at ``position - 1``; kept only for
            drafters with ``needs_committed_hidden``, which reset it to ``None`` once read.
        pending_tokens: ``[m]`` on the device, where the loop has them there (the static round):
            the token following each of ``pending_hidden``'s positions (``token_ids`` from the
            first pending position plus one, ``last_token`` last), so a drafter reading them
            makes no copy from the host; ``None``: read ``token_ids``. Reset with ``pending_hidden``.
        row: this generation's row in a batched cache (``0`` alone).
        feature_layers: the drafter's :attr:`Drafter.feature_layers` (``None``: the last layer's
            output is what ``last_hidden`` / ``pending_hidden`` hold).
        argmax_only: only an argmax reads the verifier's logits (greedy, no grammar, no
            log-probabilities): the runner may take it from its exact-argmax head
            (:mod:`selfspec.modeling.argmax_head`).
    """

    runner: ModelRunner
    cache: Any  # a StaticKVCache; in a batched round the batch's BatchedKVCache
    position: int
    last_token: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    constraint: TokenConstraint | None = None
    eos_token_ids: frozenset[int] = frozenset()
    last_hidden: torch.Tensor | None = None
    pending_hidden: torch.Tensor | None = None
    pending_tokens: torch.Tensor | None = None
    row: int = 0
    feature_layers: tuple[int, ...] | None = None
    argmax_only: bool = False
    _memory: dict[int, Any] = field(default_factory=dict, repr=False)

    def memory(self, owner: object, factory: Callable[[], T]) -> T:
        """This generation's memory for ``owner`` (a drafter), created by ``factory`` on first use.

        A drafter object is shared by every generation of its engine; what it learns about
        one generation (an n-gram index, a draft model's KV cache) lives here.
        """
        key = id(owner)
        if key not in self._memory:
            self._memory[key] = factory()
        value: T = self._memory[key]
        return value


@dataclass
class Draft:
    """A drafter's proposal.

    Attributes:
        tokens: ``[k]`` proposed token ids.
        draft_probs: ``[k, vocab]`` distributions the tokens were sampled from, or ``None``
            when greedy or deterministic (then verification is by exact match, or one-hot).
        exit_states: ``[1, k, hidden]`` exit-layer states of positions ``P .. P + k - 1``
            (``last_token`` and the first ``k - 1`` drafts), when the drafter ran the
            target's own first ``exit_layer`` layers; the verifier continues from them (and
            runs the last draft token through those layers itself). A batched drafter may
            hand over all ``k + 1`` states (the last draft's included).
        exit_layer: the layer those states come from.
        parents: ``None`` for a chain; for a token tree (:mod:`selfspec.core.tree`), the index in
            ``tokens`` of each node's parent, or ``-1`` when its parent is the root
            (``last_token``). Nodes are in topological order; node ``i`` sits at position
            ``P + depth(i)``. A tree's ``exit_states`` are ``[1, 1 + m, hidden]``: the root
            and the first ``m`` nodes, whose shallow-layer KV follows the root's in the cache.
        failure: set by a batched drafter when drafting this row failed; the loop raises it
            in this row's caller only.
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0
    parents: list[int] | None = None
    failure: BaseException | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DeviceDraft:
    """A chain draft of a fixed width that never left the device (:meth:`Drafter.propose_device`).

    The drafter always drafts ``width`` tokens; how many of them are real is decided on the
    device (the cost gate, the confidence stop, end-of-sequence), so that a round of a fixed
    width can be verified, accepted and committed with a single device-to-host read.

    Attributes:
        tokens: ``[width]`` long token ids on the model's device. Rows at or after ``length``
            are padding (valid token ids, never to be accepted).
        length: 0-d long tensor on the same device: how many leading ``tokens`` are real
            (``0 <= length <= width``; ``0``: the round is a plain step).
        draft_probs: ``[width, vocab]`` when the tokens were sampled: the processed
            distributions they were drawn from, as :attr:`Draft.draft_probs`; padded rows hold
            finite distributions (those the padding was drawn from). ``None`` when greedy.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """The fixed width (real tokens plus padding)."""
        return int(self.tokens.shape[0])


class StaticDrafting(Enum):
    """How the static round (``compile=``) drafts for a drafter (:attr:`Drafter.static_drafting`).

    Attributes:
        NONE: it cannot (token trees; the target's cache written outside the round's own steps):
            the eager loop serves the drafter's calls, with the same text.
        HOST: chains from :meth:`Drafter.propose`, sent to the device in one non-blocking copy.
        DEVICE: :meth:`Drafter.draft_static` drafts on the device, its real length decided there
            (an EAGLE head's compiled step, the early exit's through the round's own exit steps).
    """

    NONE = "none"
    HOST = "host"
    DEVICE = "device"


@dataclass
class StaticDraft:
    """A static round's draft (:meth:`Drafter.draft_static`): a host chain or a device chain.

    Attributes:
        host: a chain drafted on the host (at most the round's budget; no ``parents``, no
            ``exit_states``), sent to the device with its length in one copy.
        device: a chain of the round's budget drafted on the device, its length there (read
            with the round's result).
        exit_states: with ``device``, when the drafter ran the target's own layers
            ``[0, exit_layer)`` through the round's steps (writing their keys and values): the
            ``[1, k + 1, hidden]`` exit states of the last token and the ``k`` drafts; the verify
            runs layers ``[exit_layer, L)`` on them.
        exit_layer: the layer of ``exit_states``.
        settle: called with the real drafted tokens once the round has read them (before the
            commit), for a drafter that learns from what it drafted (the hybrid's books).
    """

    host: Draft | None = None
    device: DeviceDraft | None = None
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0
    settle: Callable[[list[int]], None] | None = None


class Drafter(ABC):
    """Proposes draft tokens for one round (see the module docstring for the contract)."""

    name: str = "drafter"
    #: whether the verifier must keep ``DecodeState.last_hidden`` for this drafter
    needs_hidden: bool = False
    #: whether the loop must also hand over every committed position's state (``DecodeState.pending_hidden``)
    needs_committed_hidden: bool = False
    #: the target layers whose input states the verifier hands over instead of the last layer's
    #: output, concatenated in this order (EAGLE-3's fused features); ``None``: the last layer's output
    feature_layers: tuple[int, ...] | None = None
    #: whether this drafter's generations may share batched rounds (see :meth:`propose_batch`)
    can_batch: bool = False
    #: whether it proposes only chains (no ``parents``, no ``exit_states``) and never writes the target's
    #: cache: the static round (``compile=``, :mod:`selfspec.decoding.static_round`) then verifies its drafts
    chain_only: bool = False
    #: whether :meth:`propose_device` drafts a fixed-width chain with no host read
    supports_device_chain: bool = False

    @abstractmethod
    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Propose at most ``max_tokens`` tokens to follow ``state.last_token``."""

    def propose_batch(self, states: list[DecodeState], budgets: list[int]) -> list[Draft]:
        """Drafts for every row of a batched round (row by row unless overridden).

        Args:
            states: the rows, in cache-row order (``states[i].row == i``).
            budgets: each row's most draft tokens (``0``: no draft).

        Returns:
            One chain :class:`Draft` per row. Either every draft carries ``k + 1`` exit states
            of the same exit layer, or the verifier runs every layer on the tokens.
        """
        return [self.propose(s, budget) if budget > 0 else Draft() for s, budget in zip(states, budgets, strict=True)]

    def propose_device(self, state: DecodeState, width: int) -> DeviceDraft:
        """A chain of exactly ``width`` tokens, its real length decided on the device (no host read).

        The device twin of :meth:`propose` for rounds of a fixed width; only drafters with
        :attr:`supports_device_chain` implement it. Its first ``length`` tokens are what
        :meth:`propose` would draft with ``max_tokens=width`` (greedy), or follow the same
        distribution (sampled).

        Raises:
            NotImplementedError: the drafter has no device chain (the default).
        """
        raise NotImplementedError(f"the {self.name!r} drafter ({type(self).__name__}) drafts no chain on the device")

    @property
    def static_drafting(self) -> StaticDrafting:
        """How the static round drafts for this drafter (the round's one capability check).

        By default: :attr:`StaticDrafting.DEVICE` with a device chain
        (:attr:`supports_device_chain`), :attr:`StaticDrafting.HOST` for a drafter that proposes
        only chains (:attr:`chain_only`), else :attr:`StaticDrafting.NONE`.
        """
        if self.supports_device_chain:
            return StaticDrafting.DEVICE
        return StaticDrafting.HOST if self.chain_only else StaticDrafting.NONE

    def prepare_static(self, step: StaticStep, slots: int, kinds: tuple[str, ...]) -> None:
        """Compile the static round's steps this drafter's rounds use, for calls of ``slots`` slots.

        The default: the verify of every width over every layer (``kinds``: ``"greedy"`` and,
        for sampled calls, ``"forward"``). A drafter that drafts through the target's own
        layers prepares those steps instead (the early exit). With :attr:`feature_layers`
        (EAGLE-3), the verify steps hand back those layers' inputs.
        """
        step.prepare(slots, kinds=kinds, feature_layers=self.feature_layers)

    def draft_static(self, state: DecodeState, budget: int, step: StaticStep, bucket: int) -> StaticDraft:
        """The static round's draft of at most ``budget`` (``>= 1``) tokens.

        The default: :meth:`propose_device` of exactly ``budget`` tokens with a device chain
        (:attr:`supports_device_chain`), else :meth:`propose` (the round keeps at most
        ``budget`` tokens of it). A drafter that runs the target's own layers draws them from
        ``step`` (:meth:`~selfspec.modeling.static_step.StaticStep.exit_draft` over ``bucket``
        slots, the round's attention span) and hands their states over in the
        :class:`StaticDraft`.

        Args:
            state: the generation's state (its cache is the round's
                :class:`~selfspec.modeling.static_step.DeviceKVCache`).
            budget: the most tokens to draft (a device chain drafts exactly this many).
            step: the round's compiled steps and cache.
            bucket: the slots the round's forwards attend over.
        """
        if self.supports_device_chain:
            return StaticDraft(device=self.propose_device(state, budget))
        return StaticDraft(host=self.propose(state, budget))

    def compile_device_chain(self, backend: str | None) -> None:  # noqa: B027
        """Ask :meth:`propose_device` for steps of fixed shapes, compiled with ``backend`` (``None``: run eagerly).

        The static round (``compile=``) calls it before each call it serves, with its own
        ``torch.compile`` backend; a drafter whose device chain runs a model of its own (the
        EAGLE head) then drafts through a fixed-shape, compiled step. The default does nothing.
        """

    def observe(self, num_drafted: int, num_accepted: int) -> None:  # noqa: B027
        """Learn from how many of the proposed tokens the target accepted."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoDrafter(Drafter):
    """Proposes nothing: the loop becomes plain autoregressive decoding (the baseline)."""

    name = "none"
    can_batch = True
    chain_only = True

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
        return int(logits.argmax()), None
    probs = logits_to_probs(logits, params)
    return int(sample(probs.unsqueeze(0), generator)[0]), probs


def choose_draft_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    constraint: TokenConstraint | None = None,
) -> tuple[int, torch.Tensor | None] | None:
    """:func:`choose_token` for a draft, or ``None`` when the constraint admits no token the draft can propose.

    A drafter's distribution may be zero where the target's is not (an EAGLE head with a reduced
    draft vocabulary gives ``-inf`` logits outside it). Where the grammar admits only such tokens,
    the masked row is all ``-inf``: its argmax would be an arbitrary forbidden token and sampling
    it is undefined, so the draft stops there and the target picks the token itself (exact either
    way). One host read, only under a constraint.
    """
    if constraint is not None:
        logits = apply_mask(logits, constraint.allowed_tokens())
        if not bool(torch.isfinite(logits).any()):
            return None
    return choose_token(logits, params, generator)


def top_probability(logits: torch.Tensor, probs: torch.Tensor | None) -> float:
    """The draft distribution's top probability: of ``probs`` when sampling, else of ``logits`` (one host read)."""
    return float(probs.max() if probs is not None else torch.softmax(logits, dim=-1).max())


def below_confidence(logits: torch.Tensor, probs: torch.Tensor | None, confidence: float) -> bool:
    """Whether the draft distribution's top probability is below ``confidence`` (one host read)."""
    return top_probability(logits, probs) < confidence


def draft_autoregressively(
    state: DecodeState,
    max_tokens: int,
    next_logits: Callable[[int, int], torch.Tensor],
    confidence: float = 0.0,
    round_cost: Callable[[int], float] | None = None,
) -> Draft:
    """The loop every model-based drafter shares: one token at a time from ``next_logits``.

    Args:
        state: the generation's state (sampling parameters, generator, constraint, eos).
        max_tokens: the most tokens to draft.
        next_logits: ``(token, j) -> [vocab] logits`` for the token after ``token``, which
            sits at position ``state.position + j`` (it runs the drafter's model there).
        confidence: stop early once the draft's top probability falls below this.
        round_cost: ``n -> `` the predicted cost of a round that drafts ``n`` tokens, relative
            to a plain step (:meth:`~selfspec.decoding.controller.CostModel.round_cost`). With it,
            a token is drafted only if it raises the round's expected tokens per unit of cost
            (:func:`worth_drafting`, judged on the draft's top probabilities): a round may then
            draft nothing and run as a plain step.

    Returns:
        The tokens and, when sampling, the distributions they were drawn from. Drafting stops
        after an end-of-sequence token; the constraint is left as it was found.
    """
    token, tokens, probs = state.last_token, [], []
    constraint = state.constraint
    reach, expected = 1.0, 1.0  # the chance every token drafted so far is accepted; expected tokens
    for j in range(max_tokens):
        logits = next_logits(token, j)
        choice = choose_draft_token(logits, state.params, state.generator, constraint)
        if choice is None:  # no admissible token in the draft's vocabulary: the target picks it
            break
        token, token_probs = choice
        top = None  # the draft distribution's top probability, read from the host once if needed
        if round_cost is not None:
            # decided from the draft distribution alone, never from the token it drew: lossless
            top = top_probability(logits, token_probs)
            if not worth_drafting(reach * top, expected, j, round_cost):
                break
            reach *= top
            expected += reach
        if constraint is not None:
            constraint.advance(token)
        tokens.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if token in state.eos_token_ids:
            break
        if confidence > 0 and j + 1 < max_tokens:
            if (top_probability(logits, token_probs) if top is None else top) < confidence:
                break
    if constraint is not None:
        constraint.rollback(len(tokens))
    return Draft(tokens=tokens, draft_probs=torch.stack(probs) if probs else None)


def draft_chain_on_device(
    state: DecodeState,
    width: int,
    next_logits: Callable[[torch.Tensor, int], torch.Tensor],
    confidence: float = 0.0,
    round_cost: Callable[[int], float] | None = None,
) -> DeviceDraft:
    """:func:`draft_autoregressively` without a host read: ``width`` tokens, the length on the device.

    Every step runs (``width`` calls of ``next_logits``); the stops :func:`draft_autoregressively`
    takes on the host become a device-side length instead: the cost gate (a token is drafted only
    if it and every earlier one pass :func:`worth_drafting`, judged on the draft distribution's
    top probabilities), the confidence stop (a token whose top probability is below ``confidence``
    is kept, the ones after it are not) and end-of-sequence (kept, nothing after it). Each stop
    reads only the draft distribution, never the target's, so the draft stays exact. The
    arithmetic of the gate is the host's, in float64 (float32 on MPS), so greedy lengths agree.

    Greedy: the first ``length`` tokens equal what :func:`draft_autoregressively` drafts with
    ``max_tokens=width`` for the same state. Sampled: tokens are drawn with the exponential race
    (``argmax(probs / E)``, ``E ~ Exponential(1)`` from ``state.generator``), which follows
    ``probs`` exactly with no host read; the random stream may differ from the host path's, so a
    seeded sampled draft may differ from :func:`draft_autoregressively`'s (same distribution).

    Args:
        state: the generation's state (sampling parameters, generator, eos; the model's device
            is ``state.runner.device``).
        width: the tokens to draft (at least 1).
        next_logits: ``(token, j) -> [vocab] logits`` for the token after ``token`` (a 0-d long
            tensor on the device), which sits at position ``state.position + j``.
        confidence: stop after the first token whose top probability is below this (``0``: never).
        round_cost: ``n ->`` the predicted cost of a round that drafts ``n`` tokens (the cost
            gate, as in :func:`draft_autoregressively`); evaluated on the host for
            ``n = 0 .. width``.

    Returns:
        A :class:`DeviceDraft` of ``width`` tokens and its device-side length.

    Raises:
        ValueError: ``width < 1``, or the state has a grammar constraint (constrained rounds
            draft on the host, :func:`draft_autoregressively`).
    """
    if width < 1:
        raise ValueError(f"a device draft needs a width of at least 1, got {width}")
    if state.constraint is not None:
        raise ValueError("a grammar-constrained round drafts on the host (draft_autoregressively), not on the device")
    device = state.runner.device
    params, generator = state.params, state.generator
    costs = [round_cost(n) for n in range(width + 1)] if round_cost is not None else None
    eos = _eos_on_device(state) if state.eos_token_ids else None
    wide = torch.float32 if device.type == "mps" else torch.float64  # the host's Python floats
    token = torch.full((), state.last_token, dtype=torch.long, device=device)
    alive = torch.ones((), dtype=torch.bool, device=device)  # every token so far drafted, no stop yet
    length = torch.zeros((), dtype=torch.long, device=device)
    reach = torch.ones((), dtype=wide, device=device)  # the chance every drafted token is accepted
    expected = torch.ones((), dtype=wide, device=device)  # the round's expected tokens so far
    tokens, probs = [], []
    for j in range(width):
        logits = next_logits(token, j)
        token_probs = None if params.greedy else logits_to_probs(logits, params)
        token = logits.argmax() if token_probs is None else exponential_race(token_probs, generator)
        tokens.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        keep = alive
        stopping = confidence > 0 and j + 1 < width
        top = None
        if costs is not None or stopping:
            top = (token_probs if token_probs is not None else torch.softmax(logits, dim=-1)).max().to(wide)
        if costs is not None:
            assert top is not None
            reach = reach * top
            # worth_drafting(reach, expected, j, round_cost), with the host's operations in the host's order
            keep = keep & (reach * costs[j] >= (costs[j + 1] - costs[j]) * expected)
            expected = expected + reach
        length = length + keep
        stop = (token == eos).any() if eos is not None else None
        if stopping:
            assert top is not None
            low = top < confidence
            stop = low if stop is None else stop | low
        alive = keep if stop is None else keep & ~stop
    return DeviceDraft(
        tokens=torch.stack(tokens),
        length=length,
        draft_probs=torch.stack(probs) if probs else None,
    )


def _eos_on_device(state: DecodeState) -> torch.Tensor:
    """``state.eos_token_ids`` on the device, copied once per generation (again only if the set changes)."""
    held: dict[frozenset[int], torch.Tensor] = state.memory(_eos_on_device, dict)
    eos = held.get(state.eos_token_ids)
    if eos is None:
        held.clear()
        eos = held[state.eos_token_ids] = device_ids(sorted(state.eos_token_ids), state.runner.device)
    return eos


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token drawn from ``[vocab]`` ``probs`` on the device: ``argmax(probs / E)``, ``E ~ Exponential(1)``.

    Exact in distribution (the smallest of independent ``Exponential(p_i)`` times is at ``i``
    with probability ``p_i``) and free of host reads (``torch.multinomial`` checks its input
    with one). Zero-probability tokens are never drawn.
    """
    race = probs / torch.empty_like(probs).exponential_(1.0, generator=generator)
    return race.masked_fill(probs <= 0, -1.0).argmax()
