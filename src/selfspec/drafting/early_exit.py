"""The early-exit drafter: the target's own first ``exit_layer`` layers draft (LayerSkip-style).

The draft head is the target's final norm and LM head applied to the exit layer's state
(Elhoushi et al. 2024, "LayerSkip: Enabling Early Exit Inference and Self-Speculative
Decoding"). Drafting writes the shallow layers' KV cache for the draft positions and keeps the
exit states, so verification starts at ``exit_layer`` and the first layers never run twice on
the same token. An optional trained exit adapter (:mod:`selfspec.drafting.exit_adapter.adapter`)
changes the draft logits only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigurationError
from .base import (
    DecodeState,
    Draft,
    Drafter,
    StaticDraft,
    StaticDrafting,
    below_confidence,
    choose_token,
    draft_autoregressively,
    draft_chain_on_device,
)
from .exit_adapter.adapter import ExitAdapter
from .exit_adapter.options import OPTIONS
from .planning import (
    BenchContext,
    BenchRow,
    CalibrationContext,
    Candidate,
    DrafterBench,
    DrafterCalibration,
    DrafterFactory,
    sampled,
    tree_rows,
)
from .registry import register_drafter

if TYPE_CHECKING:
    from ..modeling.cache import BatchedKVCache
    from ..modeling.static_step import StaticStep


class EarlyExitDrafter(Drafter):
    """Drafts with the target's own first ``exit_layer`` layers.

    Args:
        exit_layer: number of layers the draft runs (``1 .. num_layers - 1``).
        confidence: stop drafting once the draft's top probability falls below this
            (``0`` drafts the full length every round; chains only).
        tree_nodes: ``None`` drafts a chain; an int drafts a token tree of at most that many
            nodes and at most ``max_tokens`` levels (:mod:`selfspec.drafting.early_exit_tree`).
            A round with a grammar constraint drafts a chain.
        tree_shape: ``"dynamic"`` (EAGLE-2: expand the most probable nodes) or ``"static"``.
        exit_adapter: optional trained :class:`~selfspec.drafting.exit_adapter.adapter.ExitAdapter`
            (for this exit layer) applied before the shared norm and head; it changes the
            draft logits only, never the exit states handed to verification.
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

    @property
    def can_batch(self) -> bool:  # type: ignore[override]
        """Chains draft in batched rounds; token trees run alone."""
        return not self.tree_nodes

    @property
    def static_drafting(self) -> StaticDrafting:
        """Chains draft on the device through the static round's exit steps; token trees run the eager loop."""
        return StaticDrafting.NONE if self.tree_nodes else StaticDrafting.DEVICE

    def prepare_static(self, step: StaticStep, slots: int, kinds: tuple[str, ...]) -> None:
        """The exit layer's draft steps (through the adapter) and its verify of every width (from the exit layer)."""
        step.prepare(slots, kinds=kinds, exit_layer=self.exit_layer, adapter=self.exit_adapter)

    def draft_static(self, state: DecodeState, budget: int, step: StaticStep, bucket: int) -> StaticDraft:
        """A chain of ``budget`` tokens on the device through ``step``'s exit steps, and every row's exit state.

        Each draft step runs layers ``[0, E)`` on one token (writing their keys and values at its
        slot) and the LM head on the exit state (through the adapter); after the chain one more
        step runs the last drafted token's layers, so the verify continues every row from layer
        ``E``: the first layers never run twice on a token. No host read.
        """
        exit_layer, offsets = self.exit_layer, step.offsets()
        exit_states: list[torch.Tensor] = []

        def next_logits(token: torch.Tensor, j: int) -> torch.Tensor:
            exit_state, logits = step.exit_draft(
                token.view(1, 1), offsets[j], exit_layer, bucket, adapter=self.exit_adapter
            )
            exit_states.append(exit_state)
            assert logits is not None
            return logits

        chain = draft_chain_on_device(state, budget, next_logits, self.confidence)
        last, _ = step.exit_draft(chain.tokens[-1:].view(1, 1), offsets[budget], exit_layer, bucket, logits=False)
        return StaticDraft(device=chain, exit_states=torch.cat([*exit_states, last], dim=1), exit_layer=exit_layer)

    def __repr__(self) -> str:
        tree = f", tree_nodes={self.tree_nodes}, tree_shape={self.tree_shape!r}" if self.tree_nodes else ""
        adapter = "" if self.exit_adapter is None else f", exit_adapter={self.exit_adapter!r}"
        return f"EarlyExitDrafter(exit_layer={self.exit_layer}, confidence={self.confidence}{tree}{adapter})"

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` exit states -> draft logits (through the exit adapter, if any)."""
        return hidden if self.exit_adapter is None else self.exit_adapter(hidden)

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """Draft up to ``max_tokens`` tokens (or tree levels) from the exit layer."""
        if max_tokens <= 0:
            return Draft()
        if self.tree_nodes and state.constraint is None:
            from .early_exit_tree import draft_early_exit_tree

            return draft_early_exit_tree(
                state, self.exit_layer, self.tree_nodes, max_tokens, self.tree_shape, exit_adapter=self.exit_adapter
            )
        runner, exit_layer = state.runner, self.exit_layer
        positions = torch.arange(state.position, state.position + max_tokens, device=runner.device)
        states: list[torch.Tensor] = []

        def next_logits(token: int, j: int) -> torch.Tensor:
            ids = torch.full((1, 1), token, device=runner.device)
            hidden = runner.run_layers(runner.embed(ids), 0, exit_layer, positions[j : j + 1], state.cache)
            states.append(hidden)  # the raw h_E: verification continues the target from it
            return runner.logits(self.draft_logits(hidden))[0]

        draft = draft_autoregressively(state, max_tokens, next_logits, self.confidence)
        draft.exit_states = torch.cat(states, dim=1)  # [1, k, hidden]
        draft.exit_layer = exit_layer
        return draft

    def propose_batch(self, states: list[DecodeState], budgets: list[int]) -> list[Draft]:
        """Draft every row in the same forwards of layers ``[0, E)`` (see :meth:`draft_rows`)."""
        return self.draft_rows(states, budgets, [None] * len(states))

    def draft_rows(self, states: list[DecodeState], budgets: list[int], known: list[list[int] | None]) -> list[Draft]:
        """Early-exit drafting for all rows at once; every draft gets its ``k + 1`` exit states.

        Step ``j`` runs layers ``[0, E)`` on each row's ``j``-th token of the round (its last
        emitted token, then its drafts) at its own position ``P_b + j``. A row that is still
        drafting chooses its next draft token from the step's logits (its own generator, its
        own stop: budget, end-of-sequence, low confidence); a row whose draft is complete, or
        known in advance (``known[b]``, a copied continuation), runs its tokens along and then
        repeats its last one as padding (those outputs are never read). So the verifier runs
        only layers ``[E, L)``, for every row in one forward.
        """
        runner = states[0].runner
        cache: BatchedKVCache = states[0].cache
        device = runner.device
        drafts = [Draft(tokens=list(k) if k is not None else []) for k in known]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        drafting = [k is None and budget > 0 for k, budget in zip(known, budgets, strict=True)]
        base = torch.tensor([state.position for state in states], device=device)  # [m]
        hidden_steps: list[torch.Tensor] = []
        step = 0
        while True:
            # the token each row runs at this step; rows past their last step repeat it
            tokens = [[s.last_token, *d.tokens][min(step, len(d.tokens))] for s, d in zip(states, drafts, strict=True)]
            ids = torch.tensor(tokens, device=device)[:, None]  # [m, 1]
            hidden = runner.run_rows(runner.embed(ids), 0, self.exit_layer, (base + step)[:, None], cache)
            hidden_steps.append(hidden)
            rows = [b for b, on in enumerate(drafting) if on]
            if rows:
                index = torch.tensor(rows, device=device)
                logits = runner.row_logits(self.draft_logits(hidden[index]))[:, 0]  # [d, vocab]
                for i, b in enumerate(rows):
                    try:
                        drafting[b] = self._draft_one(states[b], drafts[b], probs[b], logits[i], budgets[b])
                    except Exception as error:  # noqa: BLE001 - this row fails after the round; the others go on
                        drafts[b].failure, drafting[b] = error, False
            step += 1
            if not any(drafting) and step > max(len(d.tokens) for d in drafts):
                break
        exit_states = torch.cat(hidden_steps, dim=1)  # [m, K + 1, hidden]
        for b, draft in enumerate(drafts):
            draft.exit_states = exit_states[b : b + 1, : len(draft.tokens) + 1]
            draft.exit_layer = self.exit_layer
            draft.draft_probs = torch.stack(probs[b]) if probs[b] else None
        return drafts

    def _draft_one(
        self, state: DecodeState, draft: Draft, probs: list[torch.Tensor], logits: torch.Tensor, budget: int
    ) -> bool:
        """Choose one draft token for a row; return whether the row drafts on."""
        token, token_probs = choose_token(logits, state.params, state.generator)
        draft.tokens.append(token)
        if token_probs is not None:
            probs.append(token_probs)
        if token in state.eos_token_ids or len(draft.tokens) >= budget:
            return False
        return not (self.confidence > 0 and below_confidence(logits, token_probs, self.confidence))


def make_early_exit(engine: Any, **options: Any) -> EarlyExitDrafter:
    """The engine's early-exit drafter: its exit layer, confidence stop, exit adapter and trees."""
    settings = engine.config
    options = {
        "confidence": settings.draft_confidence,
        "exit_adapter": settings.exit_adapter,
        "tree_nodes": settings.tree_nodes,
        **options,
    }
    return EarlyExitDrafter(settings.exit_layer, **options)


# ----------------------------------------------------------------------------- calibration and bench


def planned_exit(engine: Any, settings: dict[str, Any]) -> tuple[int, Any]:
    """A plan's exit layer on ``engine``'s model and the exit adapter that reads it (or ``None``).

    Raises:
        ConfigurationError: the plan's exit layer is not a layer of this model.
    """
    exit_layer = settings.get("exit_layer")
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < engine.runner.num_layers:
        raise ConfigurationError(f"exit layer {exit_layer!r} is not an exit layer of this model")
    adapter = engine.config.exit_adapter
    return exit_layer, adapter if adapter is not None and adapter.exit_layer == exit_layer else None


def describe_exit(settings: dict[str, Any]) -> str:
    """``"early exit at layer E[ with its exit adapter], k=K"``."""
    adapter = " with its exit adapter" if settings.get("exit_adapter") else ""
    return f"early exit at layer {settings.get('exit_layer')}{adapter}, k={settings.get('num_draft_tokens', 4)}"


def exit_settings(context: CalibrationContext, layer: int, k: int) -> dict[str, Any]:
    """A plan's early-exit settings: layer, draft length, and whether the engine's exit adapter reads it."""
    return {"exit_layer": layer, "num_draft_tokens": k, "exit_adapter": context.exit_adapter_layer is not None}


class EarlyExitCalibration(DrafterCalibration):
    """The early exit is calibration's own measurement: the best layer and length it found."""

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best (exit layer, draft length) pair (:attr:`CalibrationContext.best_exit`)."""
        if not context.matches:
            return []
        layer, k, speed = context.best_exit
        label = f"{name}(E={layer},k={k})"
        return [Candidate(name, exit_settings(context, layer, k), speed, label, context.draft_cost[layer])]

    def valid(self, settings: dict[str, Any]) -> bool:
        """The plan names an exit layer."""
        return isinstance(settings.get("exit_layer"), int)

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """The exit layer, the adapter and the draft length."""
        return describe_exit(settings)

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The early exit at the plan's layer (through the engine's adapter when it reads that layer)."""
        exit_layer, adapter = planned_exit(engine, settings)
        return EarlyExitDrafter(exit_layer, confidence=engine.config.draft_confidence, exit_adapter=adapter)


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    """The fixed early exit, through the saved exit adapter when there is one, and its token trees."""
    e, k = context.exit_layer, context.num_draft_tokens
    fixed = BenchRow(
        f"selfspec_E{e}_k{k}",
        context.engine(drafter=name, exit_layer=e, num_draft_tokens=k),
        f"early exit at layer {e}, {k} drafts, fixed",
        name,
    )
    rows = [fixed]
    adapted = context.engine(drafter=name, exit_adapter="auto", num_draft_tokens=k)
    if adapted.exit_adapter is not None:
        about = f"early exit at layer {adapted.exit_layer} through the trained exit adapter, {k} drafts, fixed"
        rows.append(BenchRow(f"selfspec_exit_adapter_E{adapted.exit_layer}_k{k}", adapted, about, "exit_adapter"))
    if context.tree_nodes:  # trees are compared with the fixed chain, greedy and sampling
        chain = BenchRow(fixed.name, fixed.engine, "early-exit chain", "tree")
        rows += sampled(chain, context.temperatures)

    def tree(nodes: int) -> BenchRow:
        engine = context.engine(drafter=name, exit_layer=e, num_draft_tokens=k, tree_nodes=nodes)
        return BenchRow(
            f"selfspec_tree_{nodes}", engine, f"early-exit token tree, at most {nodes} nodes and {k} levels", "tree"
        )

    return rows + tree_rows(context, tree)


register_drafter(
    "early_exit",
    make_early_exit,
    description="the target's own first exit_layer layers draft (default)",
    trees=True,
    exit_adapter=True,
    calibrated=True,
    options=OPTIONS,
    calibration=EarlyExitCalibration(),
    bench=DrafterBench(
        _rows,
        {
            "early_exit": "selfspec_E<e>_k<k>: early exit at a fixed layer and draft length",
            "exit_adapter": "selfspec_exit_adapter_*, selfspec_hybrid_exit_adapter (when an adapter is saved)",
            "tree": "selfspec_tree_N* and the fixed chain at each temperature (with --tree-nodes)",
        },
    ),
)
