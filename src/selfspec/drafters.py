"""Drafters: propose tokens for the target to verify. A drafter never decides.

Each drafter implements :meth:`Drafter.propose`, which returns a :class:`Draft` of at most
``max_tokens`` tokens, and may learn from the outcome in :meth:`Drafter.observe` (the
two-method contract of transformers' candidate generators).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .adapter import ModelAdapter
from .cache import StaticKVCache
from .constraints import TokenConstraint, apply_mask
from .exit_adapter import ExitAdapter
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
    scratch: dict[str, Any] = field(default_factory=dict)  # per-generation drafter state
    eos_token_ids: frozenset[int] = frozenset()  # drafting past one of these is wasted work
    # [1, 1, hidden] last decoder layer's output (before the final norm) at position - 1, the
    # state that chose last_token; kept by the engine only for drafters with needs_hidden
    last_hidden: torch.Tensor | None = None


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
        parents: ``None`` for a chain; for a token tree (:mod:`selfspec.tree`), the index in
            ``tokens`` of each node's parent, or ``-1`` when its parent is the root
            (``last_token``). Nodes are in topological order; node ``i`` sits at position
            ``P + depth(i)``. A tree's ``exit_states`` are ``[1, 1 + m, hidden]``: the root
            and the first ``m`` nodes, whose shallow-layer KV follows the root's in the cache.
    """

    tokens: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(ABC):
    """Proposes draft tokens for one round."""

    name: str = "drafter"
    #: whether the engine must keep ``DecodeState.last_hidden`` for this drafter
    needs_hidden: bool = False

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


def draft_autoregressively(
    state: DecodeState,
    max_tokens: int,
    next_logits: Callable[[int, int], torch.Tensor],
    confidence: float = 0.0,
) -> Draft:
    """The loop every model-based drafter shares: one token at a time from ``next_logits``.

    Args:
        state: the generation's state (sampling parameters, generator, constraint, eos).
        max_tokens: the most tokens to draft.
        next_logits: ``(token, j) -> [vocab] logits`` for the token after ``token``, which
            sits at position ``state.position + j`` (it runs the drafter's model there).
        confidence: stop early once the draft's top probability falls below this.

    Returns:
        The tokens and, when sampling, the distributions they were drawn from. Drafting stops
        after an end-of-sequence token; the constraint is left as it was found.
    """
    token, tokens, probs = state.last_token, [], []
    constraint = state.constraint
    for j in range(max_tokens):
        logits = next_logits(token, j)
        token, token_probs = choose_token(logits, state.params, state.generator, constraint)
        if constraint is not None:
            constraint.advance(token)
        tokens.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if token in state.eos_token_ids:
            break
        if confidence > 0 and j + 1 < max_tokens:
            top = (token_probs if token_probs is not None else torch.softmax(logits, dim=-1)).max()
            if bool(top < confidence):
                break
    if constraint is not None:
        constraint.rollback(len(tokens))
    return Draft(tokens=tokens, draft_probs=torch.stack(probs) if probs else None)


class NgramIndex:
    """The most recent continuation of every n-gram of a growing token list.

    Updated incrementally (only new tokens are indexed), so a lookup costs O(1) per round
    however long the prompt is.
    """

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.continuation: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are indexed

    def update(self, token_ids: list[int]) -> None:
        """Index the n-grams that end before the last token (their continuation exists)."""
        for end in range(self.indexed, len(token_ids) - 1):
            for n in range(1, self.max_ngram + 1):
                if end - n + 1 < 0:
                    break
                self.continuation[tuple(token_ids[end - n + 1 : end + 1])] = end + 1
        self.indexed = max(self.indexed, len(token_ids) - 1)

    def lookup(self, token_ids: list[int], min_ngram: int, max_tokens: int) -> list[int]:
        """Tokens that followed the longest earlier match of the text's last n-gram."""
        for n in range(min(self.max_ngram, len(token_ids)), min_ngram - 1, -1):
            start = self.continuation.get(tuple(token_ids[-n:]))
            if start is not None:
                return token_ids[start : start + max_tokens]
        return []


class PromptLookupDrafter(Drafter):
    """Drafts by copying: finds the text's last n-gram earlier in the prompt or output.

    Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``): free
    drafts that are often right when the answer copies its context (RAG, summaries, edits).
    Deterministic, so verification is by exact match (greedy) or one-hot rejection sampling.

    Args:
        max_ngram: longest n-gram to match.
        min_ngram: shortest n-gram that counts as a match.
    """

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def __repr__(self) -> str:
        return f"PromptLookupDrafter(max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"

    def lookup(self, state: DecodeState, max_tokens: int) -> list[int]:
        """The copied continuation, or ``[]`` when the last n-gram occurs nowhere earlier."""
        index = state.scratch.get("ngram_index")
        if index is None:
            index = state.scratch["ngram_index"] = NgramIndex(self.max_ngram)
        index.update(state.token_ids)
        return index.lookup(state.token_ids, self.min_ngram, max_tokens)

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Copy up to ``max_tokens`` tokens after the latest match."""
        return Draft(tokens=self.lookup(state, max_tokens)) if max_tokens > 0 else Draft()


class _SourceRecord:
    """Decayed acceptance counts of one draft source within one generation.

    Each drafted token is a trial until the first rejection, so the per-token acceptance is
    estimated as ``accepted / (accepted + rejections)``, with old rounds decaying.
    """

    DECAY = 0.8

    def __init__(self, prior_rate: float, prior_weight: float = 2.0) -> None:
        self.accepted = prior_rate * prior_weight
        self.rejected = (1.0 - prior_rate) * prior_weight

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + num_accepted
        self.rejected = self.rejected * self.DECAY + (1.0 if num_accepted < num_drafted else 0.0)

    @property
    def rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)


def expected_tokens(rate: float, num_drafted: int) -> float:
    """Expected tokens a round emits: accepted drafts plus the corrected or bonus token."""
    rate = min(max(rate, 0.0), 0.999)
    return float((1.0 - rate ** (num_drafted + 1)) / (1.0 - rate))


class GenerationView(Protocol):
    """What :class:`HybridDrafter`'s choice reads of a generation.

    A :class:`DecodeState`, or a row of a batch (:mod:`selfspec.batching`).
    """

    @property
    def adapter(self) -> Any:
        """The model adapter."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt and emitted tokens."""

    @property
    def scratch(self) -> dict[str, Any]:
        """Per-generation drafter state."""


class HybridDrafter(Drafter):
    """Prompt lookup or the early exit, chosen per round by expected tokens per unit of cost.

    When the text's last n-gram occurred before, a copied continuation is a free draft; the
    early exit costs ``exit_layer`` layers plus the head per token but knows fresh text.
    Each round it settles the previous round's draft (how many of its tokens the target
    kept, read from the text itself), keeps a decayed per-token acceptance for each source
    in this generation, and takes the lookup only when its expected tokens per round beat
    the early exit's per unit of cost. So copy-heavy answers (RAG, summaries, code edits)
    get the copies and a model that does not copy its context is not slowed by rejected
    ones. A source that lost is retried every ``PROBE_EVERY`` matches. The choice reads only
    the token history, so it is deterministic, and any choice is lossless.

    When the early exit is chosen over a lookup match in a greedy round, the copied
    continuation is not thrown away: it is grafted onto the early-exit draft as a second
    branch (sharing their common prefix), and the target verifies both in one forward with a
    tree attention mask, keeping the longer matching path (``graft_lookup``).

    Args:
        exit_layer: the early-exit drafter's layer.
        max_ngram: longest n-gram prompt lookup matches.
        min_ngram: shortest n-gram that counts as a match (2 avoids spurious one-token matches).
        exit_agreement: the early exit's expected per-token acceptance before any round is
            seen (the calibrated agreement at ``exit_layer``, else 0.6).
        confidence: the early exit's confidence stop (see :class:`EarlyExitDrafter`).
        exit_adapter: optional trained :class:`~selfspec.exit_adapter.ExitAdapter` for the early exit.
        graft_lookup: verify a rejected lookup continuation beside the early-exit draft (greedy
            rounds without a grammar constraint; the early exit drafting a chain).
    """

    name = "hybrid"
    PROBE_EVERY = 8
    #: Extra cost of verifying one more draft token, relative to a one-token step.
    VERIFY_COST = 0.05

    def __init__(
        self,
        exit_layer: int,
        max_ngram: int = 3,
        min_ngram: int = 2,
        exit_agreement: float = 0.6,
        confidence: float = 0.0,
        exit_adapter: ExitAdapter | None = None,
        graft_lookup: bool = True,
    ) -> None:
        self.lookup_drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.early_exit = EarlyExitDrafter(exit_layer, confidence=confidence, exit_adapter=exit_adapter)
        self.exit_agreement = exit_agreement
        self.graft_lookup = graft_lookup
        self._draft_cost: float | None = None

    @property
    def exit_layer(self) -> int:
        """The early-exit drafter's layer."""
        return self.early_exit.exit_layer

    def __repr__(self) -> str:
        adapter = "" if self.early_exit.exit_adapter is None else f", exit_adapter={self.early_exit.exit_adapter!r}"
        return f"HybridDrafter(exit_layer={self.exit_layer}, max_ngram={self.lookup_drafter.max_ngram}{adapter})"

    def draft_cost(self, adapter: Any) -> float:
        """One early-exit draft token's cost relative to a full step, from parameter counts."""
        if self._draft_cost is None:
            layer = sum(p.numel() for p in adapter.layers[0].parameters())
            head = adapter.vocab_size * int(adapter.config.hidden_size)
            self._draft_cost = (self.exit_layer * layer + head) / (adapter.num_layers * layer + head)
        return self._draft_cost

    def choose(self, state: GenerationView, copied: list[int], max_tokens: int) -> str:
        """``"lookup"`` or ``"early_exit"`` for this round (``copied`` is non-empty)."""
        book = self._book(state)
        lookup, early = book["lookup"], book["early_exit"]
        verify = self.VERIFY_COST
        lookup_gain = expected_tokens(lookup.rate, len(copied)) / (1.0 + verify * len(copied))
        early_cost = 1.0 + max_tokens * (self.draft_cost(state.adapter) + verify)
        early_gain = expected_tokens(early.rate, max_tokens) / early_cost
        if lookup_gain >= early_gain:
            return "lookup"
        book["skipped"] += 1
        return "lookup" if book["skipped"] % self.PROBE_EVERY == 0 else "early_exit"

    def note(self, state: GenerationView, kind: str, tokens: list[int]) -> None:
        """Remember this round's draft (from ``kind``) to settle it from the text that follows."""
        if tokens:
            self._book(state)["pending"].append((kind, list(tokens), len(state.token_ids)))

    def settle(self, state: GenerationView) -> None:
        """Score the last round's drafts against the text that followed them (before choosing)."""
        self._book(state)

    def _book(self, state: GenerationView) -> dict[str, Any]:
        book = state.scratch.get("hybrid")
        if book is None:
            book = state.scratch["hybrid"] = {
                "lookup": _SourceRecord(0.5),
                "early_exit": _SourceRecord(self.exit_agreement),
                "pending": [],
                "skipped": 0,
            }
        for kind, tokens, start in book["pending"]:  # settle the last round from the text that followed it
            emitted = state.token_ids[start:]
            accepted = 0
            while accepted < min(len(tokens), len(emitted)) and tokens[accepted] == emitted[accepted]:
                accepted += 1
            book[kind].record(len(tokens), accepted)
        book["pending"] = []
        return book

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """A lookup draft when it is the better bet this round, else an early-exit draft."""
        if max_tokens <= 0:
            return Draft()
        self.settle(state)
        copied = self.lookup_drafter.lookup(state, max_tokens)
        kind = self.choose(state, copied, max_tokens) if copied else "early_exit"
        draft = Draft(tokens=copied) if kind == "lookup" else self.early_exit.propose(state, max_tokens)
        self.note(state, kind, draft.tokens)
        if kind == "early_exit" and copied and self.graft_lookup and state.params.greedy and state.constraint is None:
            self.note(state, "lookup", copied)
            return graft(draft, copied)
        return draft


def graft(chain: Draft, branch: list[int]) -> Draft:
    """A greedy early-exit chain with ``branch`` grafted on as a second path from the root.

    The two share their common prefix; the branch's remaining tokens hang from the last shared
    node. The chain's nodes come first, so its exit states (the root and its first nodes, whose
    shallow-layer KV is cached) describe the tree too. Returns ``chain`` itself when there is
    nothing to add (the branch is a prefix of the chain, or the chain is empty or a tree).
    """
    if not chain.tokens or chain.parents is not None or chain.draft_probs is not None:
        return chain
    shared = 0
    while shared < min(len(branch), len(chain.tokens)) and branch[shared] == chain.tokens[shared]:
        shared += 1
    if shared == len(branch):
        return chain
    k = len(chain.tokens)
    rest = branch[shared:]
    parents = [i - 1 for i in range(k)] + [shared - 1] + [k + j for j in range(len(rest) - 1)]
    return Draft(
        tokens=[*chain.tokens, *rest], parents=parents, exit_states=chain.exit_states, exit_layer=chain.exit_layer
    )


class DraftModelDrafter(Drafter):
    """Drafts with a separate, smaller model that shares the target's tokenizer.

    The classic scheme (Leviathan et al. 2023; Chen et al. 2023). The draft model keeps its
    own KV cache per generation, kept in step with the target's: before each round it is
    cropped to the accepted text and catches up on the tokens it has not seen (the prompt at
    first, then the target's recovered or bonus token). Its logits are processed exactly
    like the target's, so sampling stays lossless.

    Args:
        draft_model: a loaded causal LM of a supported architecture, on the target's device.
        vocab_size: the target's vocabulary size (draft logits are cut or padded to it).
    """

    name = "draft_model"

    def __init__(self, draft_model: Any, vocab_size: int) -> None:
        self.adapter = ModelAdapter(draft_model)
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        config = self.adapter.config
        return f"DraftModelDrafter({config.model_type}, num_layers={self.adapter.num_layers})"

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.adapter.logits(hidden)[0]  # [draft vocab]
        if logits.shape[-1] >= self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((self.vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Catch the draft cache up to the accepted text, then draft ``max_tokens`` tokens."""
        if max_tokens <= 0:
            return Draft()
        adapter, device = self.adapter, self.adapter.device
        cache = state.scratch.get("draft_cache")
        if cache is None:
            cache = state.scratch["draft_cache"] = adapter.new_cache(state.cache.max_length + 1)
        cache.crop_to(state.position)  # keep only positions of the accepted text
        seen = cache.lengths[0]
        if seen < state.position:  # tokens the draft model has not processed yet
            missing = torch.tensor([state.token_ids[seen : state.position]], device=device)
            positions = torch.arange(seen, state.position, device=device)
            adapter.run_layers(adapter.embed(missing), 0, adapter.num_layers, positions, cache)

        def next_logits(token: int, j: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            positions = torch.tensor([state.position + j], device=device)
            return self._logits(adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, positions, cache))

        return draft_autoregressively(state, max_tokens, next_logits)


def default_skip_layers(num_layers: int) -> list[int]:
    """The layer-skip drafter's layers without calibration (about 3/4 of the model).

    The first half, then every other layer of the second half, and always the last layer.
    """
    half = num_layers // 2
    kept = [*range(half), *range(half, num_layers - 1, 2), num_layers - 1]
    return sorted(set(kept))


def contiguous_runs(layers: list[int]) -> list[tuple[int, int]]:
    """``[0, 1, 2, 5, 6, 9]`` -> ``[(0, 3), (5, 7), (9, 10)]`` (half-open ranges)."""
    runs: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


class LayerSkipDrafter(Drafter):
    """Drafts with a subset of the target's layers (Draft & Verify, Zhang et al. 2024; SWIFT).

    Skipped layers pass the residual stream through unchanged. The kept layers read the
    target's own KV cache for the accepted text and write draft positions into it; those
    entries are rolled back before verification, which runs the full model on the draft, so
    the cache again holds exactly the target's states for the accepted text.

    Args:
        layers: the layers the draft runs (sorted, unique, within the model).
    """

    name = "layer_skip"

    def __init__(self, layers: list[int]) -> None:
        self.layers = sorted(set(layers))
        self.runs = contiguous_runs(self.layers)

    def __repr__(self) -> str:
        return f"LayerSkipDrafter(layers={self.layers})"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft ``max_tokens`` tokens through the kept layers only."""
        if max_tokens <= 0:
            return Draft()
        adapter, device = state.adapter, state.adapter.device

        def next_logits(token: int, j: int) -> torch.Tensor:
            hidden = adapter.embed(torch.tensor([[token]], device=device))
            positions = torch.tensor([state.position + j], device=device)
            for start, end in self.runs:
                hidden = adapter.run_layers(hidden, start, end, positions, state.cache)
            return adapter.logits(hidden)[0]

        draft = draft_autoregressively(state, max_tokens, next_logits)
        state.cache.crop_to(state.position)  # drop the draft's KV: verification recomputes it
        return draft


class EarlyExitDrafter(Drafter):
    """Drafts with the target's own first ``exit_layer`` layers (LayerSkip-style).

    The draft head is the target's final norm and LM head applied to the exit layer's
    state (Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and
    Self-Speculative Decoding"). Drafting writes the shallow layers' KV cache for the draft
    positions and keeps the exit states, so verification starts at ``exit_layer`` and the
    first layers never run twice on the same token.

    Args:
        exit_layer: number of layers the draft runs (``1 .. num_layers - 1``).
        confidence: stop drafting once the draft's top probability falls below this
            (``0`` drafts the full length every round; chains only).
        tree_nodes: ``None`` drafts a chain; an int drafts a token tree of at most that many
            nodes and at most ``max_tokens`` levels (:mod:`selfspec.tree_draft`). A round
            with a grammar constraint drafts a chain.
        tree_shape: ``"dynamic"`` (EAGLE-2: expand the most probable nodes) or ``"static"``.
        exit_adapter: optional trained :class:`~selfspec.exit_adapter.ExitAdapter` (for this
            exit layer) applied before the shared norm and head; it changes the draft logits
            only, never the exit states handed to verification (chains and trees alike).
    """

    name = "early_exit"

    def __init__(
        self,
        exit_layer: int,
        confidence: float = 0.0,
        tree_nodes: int | None = None,
        tree_shape: str = "dynamic",
        exit_adapter: ExitAdapter | None = None,
    ) -> None:
        self.exit_layer = exit_layer
        self.confidence = confidence
        self.tree_nodes = tree_nodes
        self.tree_shape = tree_shape
        self.exit_adapter = exit_adapter

    def __repr__(self) -> str:
        tree = f", tree_nodes={self.tree_nodes}, tree_shape={self.tree_shape!r}" if self.tree_nodes else ""
        adapter = "" if self.exit_adapter is None else f", exit_adapter={self.exit_adapter!r}"
        return f"EarlyExitDrafter(exit_layer={self.exit_layer}, confidence={self.confidence}{tree}{adapter})"

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens (or tree levels) from the exit layer."""
        if max_tokens <= 0:
            return Draft()
        if self.tree_nodes and state.constraint is None:
            from .tree_draft import draft_early_exit_tree

            return draft_early_exit_tree(
                state, self.exit_layer, self.tree_nodes, max_tokens, self.tree_shape, exit_adapter=self.exit_adapter
            )
        adapter, exit_layer, exit_adapter = state.adapter, self.exit_layer, self.exit_adapter
        device = adapter.device
        states: list[torch.Tensor] = []

        def next_logits(token: int, j: int) -> torch.Tensor:
            ids = torch.tensor([[token]], device=device)
            positions = torch.tensor([state.position + j], device=device)
            hidden = adapter.run_layers(adapter.embed(ids), 0, exit_layer, positions, state.cache)
            states.append(hidden)  # the raw h_E: verification continues the target from it
            return adapter.logits(hidden if exit_adapter is None else exit_adapter(hidden))[0]

        draft = draft_autoregressively(state, max_tokens, next_logits, self.confidence)
        draft.exit_states = torch.cat(states, dim=1)  # [1, k, hidden]
        draft.exit_layer = exit_layer
        return draft
