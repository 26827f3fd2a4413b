"""``drafter="eagle"``: an EAGLE-style feature head drafts chains or EAGLE-2 dynamic trees.

The head (:class:`~selfspec.drafting.eagle.head.EagleHead`: ``fc`` + one decoder layer over the target's own
features, sharing its embedding, final norm and LM head) keeps its own KV cache per
generation, one entry per position ``t`` for the pair ``(f_t, x_{t+1})``. Each round:

1. **Catch up.** The verifier of the previous round (or the prefill) computed the target's last
   layer at every position it committed; the loop hands those states over
   (``state.pending_hidden``), so the head's cache is rebuilt from *true* target features for the
   accepted text. Entries the head wrote for its own draft last round are dropped first (the
   cache is cropped to the settled entries): no stale draft entry survives a round. No extra
   target work is done: the features come from the forward that already ran.
2. **Draft.** The last entry's output is the predicted feature ``f̂_P`` of the root
   (``state.last_token``'s position); its logits give the first draft token. Each further
   token feeds ``(f̂, token)`` back into the head (a chain), or, with ``tree_nodes``, every node
   chosen for expansion at a depth goes through the head in one forward with a tree attention
   mask (EAGLE-2: expand the most probable nodes, rerank all to the node budget).

Lossless as every drafter: greedy drafts are verified by exact match; sampled drafts carry the
head's own processed distribution ``q`` (zero outside the head's draft vocabulary) and go
through the rejection sampler; trees grow with the early-exit tree's grower
(:mod:`selfspec.drafting.tree_grower`: a sampled first child, deterministic extras).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core.speed import CostModel
from ...core.tree import default_tree_width
from ...errors import ConfigurationError
from ...modeling.transfer import device_ids
from ..base import (
    DecodeState,
    DeviceDraft,
    Draft,
    Drafter,
    StaticDrafting,
    draft_autoregressively,
    draft_chain_on_device,
)
from ..prompt_lookup import PromptLookupDrafter
from ..registry import register_drafter
from ..tree_grower import ROOT, TreeGrower, grow_tree
from .calibration import EagleCalibration
from .head import EagleHead, HeadCache, StaticHeadCache, check_fits, find_eagle_head, load_eagle_head
from .online import OnlineLearner, OnlineSequence, OnlineSettings, online_head_folder
from .options import OPTIONS


@dataclass
class _HeadMemory:
    """One generation's head state: the head it drafts with, its KV cache and how many entries hold true features."""

    cache: HeadCache | StaticHeadCache
    head: EagleHead  # kept for the whole generation: an online swap never lands mid-generation
    settled: int = 0  # cache slots built from the target's own features (the accepted text)
    next_position: int = 0  # the position of the next true entry
    rounds: int = 0  # catch-ups so far (the first one is the prompt's)
    sequence: OnlineSequence | None = None  # with learn_online: this generation's text in the learner's buffer


class EagleDrafter(Drafter):
    """Drafts with an EAGLE-style head over the target's own features.

    Args:
        head: the loaded :class:`~selfspec.drafting.eagle.head.EagleHead` (on the target's device and dtype).
        tree_nodes: ``None`` drafts a chain; an int drafts an EAGLE-2 dynamic tree of at most
            that many nodes (and at most ``max_tokens`` levels).
        confidence: chains stop drafting once the head's top probability falls below this.
        tree_width: children per expanded node and nodes expanded per depth (default
            :func:`~selfspec.core.tree.default_tree_width`).
        costs: the calibrated cost model (:class:`~selfspec.core.speed.CostModel`: the
            head's draft step and the verify curve, relative to a plain step). With it a chain
            drafts a token only while that raises the round's expected tokens per unit of cost,
            judged on the head's own top probabilities (well calibrated on SmolLM2: a top
            probability of 0.2-0.3 was accepted 26% of the time, 0.8-1.0 94%), so a round
            where the head is unsure drafts nothing and costs a plain step.
        lookup: also look the text's last n-gram up in the prompt and output (prompt lookup):
            in a greedy chain round where the text repeats, the round drafts the copied
            continuation alone (at least :attr:`COPY_TOKENS` tokens) and the head drafts only
            where nothing repeats (``drafter="eagle_hybrid"``). Verifying the head's chain beside
            a copy costs more rows than it saves on CPU (measured on SmolLM2-135M: summarization
            24.7-25.3 tok/s with copy-only rounds, 21.4-21.8 with the chain grafted beside).
        learner: with ``learn_online=True``, the :class:`~selfspec.drafting.eagle.online.OnlineLearner`
            fed every round's committed features; each generation drafts with the head it gives
            at the generation's first round (``head`` is then the frozen fallback). Chains draft on
            the host then (the static round's compiled head step would bake one head's weights in).
    """

    name = "eagle"
    #: The shortest copy a lookup round drafts (the head's calibrated chain is often 1-2 tokens).
    COPY_TOKENS = 4
    needs_hidden = True
    needs_committed_hidden = True

    def __init__(
        self,
        head: EagleHead,
        *,
        tree_nodes: int | None = None,
        confidence: float = 0.0,
        tree_width: int | None = None,
        costs: CostModel | None = None,
        lookup: bool = False,
        learner: OnlineLearner | None = None,
    ) -> None:
        self.head = head
        self.learner = learner
        self.tree_nodes = tree_nodes
        self.confidence = confidence
        self.tree_width = tree_width
        self.costs = costs
        self.lookup = PromptLookupDrafter(max_ngram=3, min_ngram=2) if lookup else None
        self.feature_layers = head.capture_layers  # EAGLE-3: the target layers whose inputs the verifier keeps
        # the static round verifies its chains (EAGLE-3's too: its verify hands back the tapped states)
        self.chain_only = not tree_nodes
        if lookup:
            self.name = "eagle_hybrid"
        #: chains (no tree, no prompt lookup) draft on the device too (:meth:`propose_device`)
        self.supports_device_chain = tree_nodes is None and not lookup and learner is None
        #: whether :meth:`propose_device` drafts through the static head step (:meth:`compile_device_chain`)
        self.static_chain = False
        self.backend: str | None = None
        #: the head's one-query draft step per :class:`StaticHeadCache` size (compiled with :attr:`backend`)
        self.compiled_steps: dict[int, Callable[..., Any]] = {}
        self._static_cache: StaticHeadCache | None = None
        self._static_owner = object()  # the key of a generation's memory on the static path

    def __repr__(self) -> str:
        tree = f", tree_nodes={self.tree_nodes}" if self.tree_nodes else ""
        lookup = ", lookup=True" if self.lookup is not None else ""
        return f"EagleDrafter({self.head!r}{tree}{lookup})"

    @property
    def static_drafting(self) -> StaticDrafting:
        """Chains on the device (:meth:`propose_device`); with prompt lookup, host chains; trees: the eager loop.

        An EAGLE-3 head (:attr:`feature_layers`) drafts there too: the static verify hands back
        the tapped layers' inputs, and its draft step (the draft vocabulary mapped to the target's
        on the device) compiles like an EAGLE-1 head's.
        """
        if self.tree_nodes:
            return StaticDrafting.NONE
        return StaticDrafting.DEVICE if self.supports_device_chain else StaticDrafting.HOST

    def _generation_head(self) -> EagleHead:
        """The head a new generation drafts with: the learner's choice, else the loaded head."""
        return self.head if self.learner is None else self.learner.head_for_generation()

    def compile_device_chain(self, backend: str | None) -> None:
        """Draft device chains through the static head step, compiled with ``backend`` (``None``: eagerly).

        From then on :meth:`propose_device` keeps the head's entries in a :class:`StaticHeadCache`
        (one per drafter, as big as the target's cache, reused by every call) and runs each draft
        step after the first (the head over one query, then its logits) through one function of
        fixed shapes: ``torch.compile(fullgraph=True, dynamic=False)``, once per cache size, so
        no round recompiles. The catch-up (as many rows as the round accepted) runs eagerly on
        the same cache. :meth:`propose` and trees keep their own :class:`HeadCache`.
        """
        if backend != self.backend:
            self.compiled_steps.clear()
        self.static_chain, self.backend = True, backend

    # ------------------------------------------------------------------ step 1: catch up
    def _memory(self, state: DecodeState) -> _HeadMemory:
        """This generation's head memory (its cache holds the target cache's positions, a tree's nodes and 2)."""
        room = int(getattr(state.cache, "max_length", 0)) + (self.tree_nodes or 0) + 2
        return state.memory(self, lambda: _HeadMemory(HeadCache(room), self._generation_head()))

    def _static_memory(self, state: DecodeState) -> _HeadMemory:
        """This generation's memory on the static path: the drafter's :class:`StaticHeadCache`."""
        size, device = int(state.cache.max_length), state.runner.device
        cache = self._static_cache
        if cache is None or cache.max_length < size or cache.length.device != device:
            cache = self._static_cache = StaticHeadCache(size, device)
            self.compiled_steps.clear()  # new buffers: new graphs
        return state.memory(self._static_owner, lambda: _HeadMemory(cache, self.head))

    def _root_feature(self, state: DecodeState, memory: _HeadMemory | None = None) -> tuple[_HeadMemory, torch.Tensor]:
        """Feed the newly committed positions' true features; return ``f̂_P`` ``[1, 1, H]``."""
        memory = memory or self._memory(state)
        head, cache = memory.head, memory.cache
        pending = state.pending_hidden
        if pending is None or pending.shape[1] == 0:
            raise ConfigurationError(
                "the EAGLE drafter needs the target's features of the accepted text (state.pending_hidden); "
                "it runs only inside the engine's loop"
            )
        tokens, state.pending_hidden, state.pending_tokens = state.pending_tokens, None, None
        count = pending.shape[1]
        start = state.position - count  # the first pending position
        device = pending.device
        if start < memory.next_position:  # never happens in the loop; keep the newest view
            raise ConfigurationError(f"EAGLE head out of step: features from {start}, expected {memory.next_position}")
        features = head.target_features(pending)  # [1, m, H] after the final norm
        if tokens is not None and tokens.shape[0] == count:  # already on the device (the static round)
            next_tokens = tokens[None]
        else:
            next_tokens = device_ids([state.token_ids[start + 1 : state.position + 1]], device)  # no blocking copy
        positions = torch.arange(start, state.position, device=device)[None]
        allowed = None
        if isinstance(cache, StaticHeadCache):  # slot t holds position t: drop last round's draft entries
            cache.length.fill_(start)
            allowed = cache.allowed(count)
        else:
            cache.crop_to(memory.settled)  # drop last round's draft entries
        out = head(features.to(head.fc.weight.dtype), next_tokens, positions, cache, allowed=allowed)
        memory.settled = state.position if isinstance(cache, StaticHeadCache) else cache.length
        memory.next_position = state.position
        if self.learner is not None:
            self._learn(memory, state, pending[0], start)
        # the root as a fresh [1, 1, H] (the same strides every round: a compiled step's input)
        return memory, out[:, -1:].clone(memory_format=torch.contiguous_format)

    def _learn(self, memory: _HeadMemory, state: DecodeState, states: torch.Tensor, start: int) -> None:
        """Hand the committed states ``[m, H]`` (from ``start``) to the learner; count the last round's tokens."""
        learner = self.learner
        assert learner is not None
        if memory.rounds:  # the first catch-up is the prompt's, not a round's
            learner.record_round(memory.head, int(states.shape[0]))
        memory.rounds += 1
        if memory.sequence is None:
            memory.sequence = OnlineSequence()
        learner.observe(memory.sequence, states, state.token_ids[start : state.position + 1])

    # ------------------------------------------------------------------ step 2: draft
    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens (a chain) or tree levels (with ``tree_nodes``)."""
        memory, root = self._root_feature(state)
        if max_tokens <= 0:
            return Draft()
        if self.tree_nodes and state.constraint is None:
            return self._tree(state, memory, root, max_tokens)
        if self.lookup is not None and state.params.greedy and state.constraint is None:
            copied = self.lookup.lookup(state, max(max_tokens, self.COPY_TOKENS))
            if copied:  # the text repeats: a copy-only round
                return Draft(tokens=copied)
        head, position = memory.head, state.position
        device = root.device
        feature = [root]

        def next_logits(token: int, j: int) -> torch.Tensor:
            if j > 0:  # the entry (f̂ at P + j - 1, the token drafted there)
                ids = torch.full((1, 1), token, device=device)
                feature[0] = head(feature[0], ids, torch.full((1, 1), position + j - 1, device=device), memory.cache)
            return head.full_logits(feature[0])[0, 0]

        round_cost = self.costs.round_cost if self.costs is not None else None
        return draft_autoregressively(state, max_tokens, next_logits, self.confidence, round_cost)

    def propose_device(self, state: DecodeState, width: int) -> DeviceDraft:
        """A chain of exactly ``width`` tokens with its length decided on the device (no host read).

        The catch-up of :meth:`propose` (which reads only host ints), then
        :func:`~selfspec.drafting.base.draft_chain_on_device` with the same gate, confidence stop
        and head steps: the greedy chain's first ``length`` tokens are :meth:`propose`'s. The head
        runs all ``width`` steps, so its cache needs room for ``width - 1`` draft entries past the
        settled ones (they are dropped at the next catch-up, like :meth:`propose`'s).

        Raises:
            NotImplementedError: the drafter drafts trees or prompt-lookup copies.
            ValueError: ``width < 1``, a grammar-constrained state, or a chain the head's cache cannot
                hold (checked before the catch-up, so the state is untouched and the round can go to
                :meth:`propose`).
        """
        if self.tree_nodes or self.lookup is not None:
            return super().propose_device(state, width)
        if width < 1 or state.constraint is not None:
            reason = f"width {width} < 1" if width < 1 else "a grammar-constrained round drafts on the host (propose)"
            raise ValueError(f"no device chain for this round: {reason}")
        static = self.static_chain
        room = int(state.cache.max_length) if static else self._memory(state).cache.max_length
        if state.position + width - 1 > room:  # the settled entries and width - 1 draft entries
            raise ValueError(
                f"no device chain for this round: the head's cache holds {room} entries, the chain "
                f"needs {state.position + width - 1} (a target cache sized for the full width fits)"
            )
        memory, root = self._root_feature(state, self._static_memory(state) if static else None)
        head, position = memory.head, state.position
        device = root.device
        feature = [root]
        cache = memory.cache
        static_step = self._static_step(cache) if isinstance(cache, StaticHeadCache) else None

        def next_logits(token: torch.Tensor, j: int) -> torch.Tensor:
            if j > 0 and static_step is not None:  # the entry at the cache's length, P + j - 1
                feature[0], logits = static_step(feature[0], token)
                return logits
            if j > 0:  # the entry (f̂ at P + j - 1, the token drafted there)
                positions = torch.full((1, 1), position + j - 1, device=device)
                feature[0] = head(feature[0], token.view(1, 1), positions, cache)
            return head.full_logits(feature[0])[0, 0]

        round_cost = self.costs.round_cost if self.costs is not None else None
        return draft_chain_on_device(state, width, next_logits, self.confidence, round_cost)

    def _static_step(self, cache: StaticHeadCache) -> Callable[..., Any]:
        """The one-query draft step over ``cache``: ``(f̂ [1, 1, H], token 0-d) -> (next f̂, [vocab] logits)``.

        Its position is the cache's device length (no Python int in the graph); compiled with
        :attr:`backend` once per cache size.
        """
        key = cache.max_length
        if key not in self.compiled_steps:
            head = self.head

            def step(feature: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                positions = cache.length.reshape(1, 1).clone()  # the write below moves the length
                predicted = head(feature, token.view(1, 1), positions, cache, allowed=cache.allowed(1))
                return predicted, head.full_logits(predicted)[0, 0]

            self.compiled_steps[key] = step if self.backend is None else compile_step(step, self.backend)
        return self.compiled_steps[key]

    def _tree(self, state: DecodeState, memory: _HeadMemory, root_feature: torch.Tensor, max_depth: int) -> Draft:
        """An EAGLE-2 dynamic tree: expand the most probable nodes depth by depth, rerank to the budget."""
        head, cache = memory.head, memory.cache
        assert self.tree_nodes is not None and isinstance(cache, HeadCache)  # trees keep the Python-length cache
        tree_nodes = self.tree_nodes
        width = min(self.tree_width or default_tree_width(tree_nodes), tree_nodes)
        grower = TreeGrower(state, tree_nodes, width, static=False, max_depth=max_depth)
        nodes = grower.nodes
        device, start = root_feature.device, state.position
        node_features: dict[int, torch.Tensor] = {ROOT: root_feature[0, 0]}  # expanded node -> its predicted f̂ [H]
        ancestors: dict[int, list[int]] = {ROOT: []}  # node -> head cache slots of its expanded ancestors

        def expand(frontier: list[int], depth: int) -> tuple[list[int], torch.Tensor]:
            """One head forward over the nodes to expand (as many as the head's cache holds)."""
            if frontier == [ROOT]:
                return frontier, head.full_logits(root_feature)[0]  # [1, vocab]: the root's children
            frontier = frontier[: cache.max_length - cache.length]
            if not frontier:
                return frontier, torch.empty(0)
            # entry (parent's f̂, node token) at P + depth - 2: the node sits at P + depth - 1
            parent_features = torch.stack([node_features[nodes[i].parent] for i in frontier])[None]  # [1, q, H]
            base = cache.length
            allowed = torch.zeros(len(frontier), base + len(frontier), dtype=torch.bool, device=device)
            allowed[:, : memory.settled] = True
            for row, i in enumerate(frontier):
                nodes[i].slot = base + row
                ancestors[i] = [*ancestors[nodes[i].parent], base + row]
                allowed[row, ancestors[i]] = True
            ids = torch.tensor([[nodes[i].token for i in frontier]], device=device)
            positions = torch.full((1, len(frontier)), start + depth - 2, device=device)
            predicted = head(parent_features, ids, positions, cache, allowed=allowed[None])  # [1, q, H]
            for row, i in enumerate(frontier):
                node_features[i] = predicted[0, row]
            return frontier, head.full_logits(predicted)[0]  # [q, vocab]

        grow_tree(grower, expand)
        cache.crop_to(memory.settled)
        return grower.draft(grower.reranked() if grower.over_budget() else range(len(nodes)))


def compile_step(step: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``torch.compile(fullgraph=True, dynamic=False)`` of a head step (no CUDA graphs: untried on a GPU)."""
    if torch._dynamo.config.recompile_limit < 64:  # one graph per cache size, beside the target's steps
        torch._dynamo.config.recompile_limit = 64
    return torch.compile(step, backend=backend, fullgraph=True, dynamic=False)


def engine_eagle_head(engine: Any, eagle_head: Any = None) -> EagleHead:
    """The head for ``drafter="eagle"``, checked against the model.

    ``eagle_head=`` is a folder, a loaded :class:`~selfspec.drafting.eagle.head.EagleHead`, or ``"auto"`` /
    ``None`` (:func:`~selfspec.drafting.eagle.head.find_eagle_head`).
    """
    runner = engine.runner  # the heads reach the target's modules through it
    choice = eagle_head if eagle_head is not None else getattr(engine.config, "eagle_head", None)
    if choice is None or choice == "auto":
        folder = find_eagle_head(engine.name_or_path, runner)
        if folder is None:
            from .catalog import explain_missing_head  # raises a refused published head's reason

            published = explain_missing_head(engine.name_or_path, runner)
            where = "in the user cache, beside this model (its eagle_head/ folder), or among the heads selfspec ships"
            raise ConfigurationError(
                f"drafter='eagle' needs a trained head: none was found {where}. Train one with "
                "`selfspec train-eagle --model M` (a few minutes), or pass eagle_head= the folder of a head "
                f"trained for this model.{f' Or: {published}.' if published else ''}"
            )
        choice = folder
    if isinstance(choice, EagleHead):
        check_fits(choice.head_config, runner)
        return choice.to(device=runner.device, dtype=runner.dtype)
    if not isinstance(choice, (str, os.PathLike)):
        raise ConfigurationError(f"eagle_head must be a folder, a loaded EagleHead or 'auto', got {choice!r}")
    from .published import is_published_head, load_published_head

    if is_published_head(choice):  # a published EAGLE-1/EAGLE-2 head folder (config.json + model.safetensors)
        return load_published_head(choice, runner)
    return load_eagle_head(choice, runner)


def make_eagle(engine: Any, **options: Any) -> EagleDrafter:
    """The EAGLE drafter: the engine's head (``eagle_head=``), a tree with ``tree_nodes``."""
    head = engine_eagle_head(engine, options.pop("eagle_head", None))
    settings = engine.config
    online = options.pop("online", None)  # OnlineSettings for learn_online (drafter_options={"online": ...})
    options = {
        "tree_nodes": settings.tree_nodes,
        "confidence": settings.draft_confidence,
        "costs": eagle_costs(settings.calibration),
        **options,
    }
    learner = None
    if getattr(settings, "learn_online", False):
        if online is not None and not isinstance(online, OnlineSettings):
            raise ConfigurationError(f"drafter_options['online'] must be an OnlineSettings, got {online!r}")
        folder = online_head_folder(engine.name_or_path) if engine.name_or_path else None
        learner = OnlineLearner(head, online, save_folder=folder)
    drafter = EagleDrafter(head, learner=learner, **options)
    if learner is not None:
        weakref.finalize(drafter, learner.close)  # stops the thread and saves when the drafter goes (or at exit)
        learner.start()
    return drafter


def eagle_costs(calibration: dict[str, Any] | None) -> CostModel | None:
    """The head's cost model from a calibration (its measured draft step and verify curve), if it has one."""
    calibration = calibration or {}
    eagle = calibration.get("eagle")
    verify = calibration.get("verify_cost")
    if not isinstance(eagle, dict) or not isinstance(verify, dict) or not verify:
        return None
    return CostModel.from_json({"draft": eagle.get("draft_cost"), "verify": verify})


def make_eagle_hybrid(engine: Any, **options: Any) -> EagleDrafter:
    """The EAGLE drafter with prompt-lookup copies where the text repeats (``lookup=True``)."""
    return make_eagle(engine, **{"lookup": True, **options})


register_drafter(
    "eagle",
    make_eagle,
    description="an EAGLE-style feature head trained on the model's own text (eagle_head=, selfspec train-eagle)",
    trees=True,
    options=OPTIONS,
    calibration=EagleCalibration(),
)
register_drafter(
    "eagle_hybrid",
    make_eagle_hybrid,
    description="prompt-lookup copies where the text repeats, else the EAGLE head (eagle_head=)",
    trees=True,
    options=OPTIONS,
    calibration=EagleCalibration(lookup=True),
)
