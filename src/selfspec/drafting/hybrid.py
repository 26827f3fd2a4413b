"""The hybrid drafter: prompt lookup or the early exit, chosen per round by expected gain."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.speed import CostModel, expected_tokens
from ..modeling.runner import ModelRunner
from .base import DecodeState, Draft, Drafter, StaticDraft, StaticDrafting
from .early_exit import EarlyExitDrafter, describe_exit, exit_settings, planned_exit
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
)
from .prompt_lookup import PromptLookupDrafter
from .registry import register_drafter

if TYPE_CHECKING:
    from ..modeling.static_step import StaticStep


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


@dataclass
class _Book:
    """One generation's record of both sources, and the drafts still to be settled."""

    lookup: _SourceRecord
    early_exit: _SourceRecord
    pending: list[tuple[str, list[int], int]] = field(default_factory=list)  # (source, tokens, start)
    skipped: int = 0

    def source(self, kind: str) -> _SourceRecord:
        return self.lookup if kind == "lookup" else self.early_exit


#: The verify curve assumed without a calibration (``--no-calibrate``): each draft token adds
#: 5% of a plain step to the verify (about a GPU's; a CPU's is steeper, and calibration measures it).
UNCALIBRATED_VERIFY = {1: 1.05}


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
        exit_adapter: optional trained exit adapter for the early exit.
        graft_lookup: verify a rejected lookup continuation beside the early-exit draft (greedy
            rounds without a grammar constraint; the early exit drafting a chain; not in
            batched rounds).
        costs: the calibrated :class:`~selfspec.core.speed.CostModel` of the early exit at
            ``exit_layer`` (its draft cost and the verify curve, :func:`hybrid_costs`); a lookup
            round is priced on the same verify curve at no draft cost. Without one, the draft
            cost comes from parameter counts and the verify curve is :data:`UNCALIBRATED_VERIFY`.
    """

    name = "hybrid"
    PROBE_EVERY = 8

    def __init__(
        self,
        exit_layer: int,
        max_ngram: int = 3,
        min_ngram: int = 2,
        exit_agreement: float = 0.6,
        confidence: float = 0.0,
        exit_adapter: ExitAdapter | None = None,
        graft_lookup: bool = True,
        costs: CostModel | None = None,
    ) -> None:
        self.lookup_drafter = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
        self.early_exit = EarlyExitDrafter(exit_layer, confidence=confidence, exit_adapter=exit_adapter)
        self.exit_agreement = exit_agreement
        self.graft_lookup = graft_lookup
        self.costs = costs
        self._draft_cost: float | None = None

    @property
    def exit_layer(self) -> int:
        """The early-exit drafter's layer."""
        return self.early_exit.exit_layer

    @property
    def tree_nodes(self) -> int | None:
        """The early exit's tree budget (lookup drafts chains)."""
        return self.early_exit.tree_nodes

    @property
    def can_batch(self) -> bool:  # type: ignore[override]
        """Batched rounds unless the early exit drafts trees."""
        return self.early_exit.can_batch

    def __repr__(self) -> str:
        adapter = "" if self.early_exit.exit_adapter is None else f", exit_adapter={self.early_exit.exit_adapter!r}"
        return f"HybridDrafter(exit_layer={self.exit_layer}, max_ngram={self.lookup_drafter.max_ngram}{adapter})"

    def draft_cost(self, runner: ModelRunner) -> float:
        """One early-exit draft token's cost relative to a full step: calibrated, else from parameter counts."""
        if self.costs is not None:
            return self.costs.draft
        if self._draft_cost is None:
            layer = sum(p.numel() for p in runner.layers[0].parameters())
            head = runner.vocab_size * int(runner.config.hidden_size)
            self._draft_cost = (self.exit_layer * layer + head) / (runner.num_layers * layer + head)
        return self._draft_cost

    def choose(self, state: DecodeState, copied: list[int], max_tokens: int) -> str:
        """``"lookup"`` or ``"early_exit"`` for this round (``copied`` is non-empty)."""
        book = self._book(state)
        verify = self.costs.verify if self.costs is not None else UNCALIBRATED_VERIFY
        lookup_cost = CostModel(0.0, verify).round_cost(len(copied))
        early_cost = CostModel(self.draft_cost(state.runner), verify).round_cost(max_tokens)
        lookup_gain = expected_tokens(book.lookup.rate, len(copied)) / lookup_cost
        early_gain = expected_tokens(book.early_exit.rate, max_tokens) / early_cost
        if lookup_gain >= early_gain:
            return "lookup"
        book.skipped += 1
        return "lookup" if book.skipped % self.PROBE_EVERY == 0 else "early_exit"

    def note(self, state: DecodeState, kind: str, tokens: list[int]) -> None:
        """Remember this round's draft (from ``kind``) to settle it from the text that follows."""
        if tokens:
            self._book(state).pending.append((kind, list(tokens), len(state.token_ids)))

    def settle(self, state: DecodeState) -> None:
        """Score the last round's drafts against the text that followed them (before choosing)."""
        self._book(state)

    def _book(self, state: DecodeState) -> _Book:
        book = state.memory(self, lambda: _Book(_SourceRecord(0.5), _SourceRecord(self.exit_agreement)))
        for kind, tokens, start in book.pending:  # settle the last round from the text that followed it
            emitted = state.token_ids[start:]
            accepted = 0
            while accepted < min(len(tokens), len(emitted)) and tokens[accepted] == emitted[accepted]:
                accepted += 1
            book.source(kind).record(len(tokens), accepted)
        book.pending = []
        return book

    def choose_round(self, state: DecodeState, max_tokens: int) -> tuple[str, list[int]]:
        """Settle the last round, look up a copy, and choose this round's source: ``(kind, copied)``.

        The caller drafts from ``kind`` (``copied`` when it is ``"lookup"``) and then calls
        :meth:`note` with the drafted tokens, as :meth:`propose` does (the static round drafts
        the early exit's chain itself).
        """
        self.settle(state)
        copied = self.lookup_drafter.lookup(state, max_tokens)
        return (self.choose(state, copied, max_tokens) if copied else "early_exit"), copied

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """A lookup draft when it is the better bet this round, else an early-exit draft."""
        if max_tokens <= 0:
            return Draft()
        kind, copied = self.choose_round(state, max_tokens)
        draft = Draft(tokens=copied) if kind == "lookup" else self.early_exit.propose(state, max_tokens)
        self.note(state, kind, draft.tokens)
        if kind == "early_exit" and copied and self.graft_lookup and state.params.greedy and state.constraint is None:
            self.note(state, "lookup", copied)
            return graft(draft, copied)
        return draft

    @property
    def static_drafting(self) -> StaticDrafting:
        """Device drafts (the early exit's chains, or a lookup copy sent in one copy); trees run the eager loop."""
        return self.early_exit.static_drafting

    def prepare_static(self, step: StaticStep, slots: int, kinds: tuple[str, ...]) -> None:
        """Both sources' steps: the full verify (lookup rounds) and the early exit's."""
        step.prepare(slots, kinds=kinds)
        self.early_exit.prepare_static(step, slots, kinds)

    def draft_static(self, state: DecodeState, budget: int, step: StaticStep, bucket: int) -> StaticDraft:
        """This round's source (:meth:`choose_round`): the lookup's copy (host), or the early exit's device chain.

        No lookup graft here: the static round verifies chains. The early exit's drafted tokens
        are noted once the round has read them (:attr:`StaticDraft.settle`).
        """
        kind, copied = self.choose_round(state, budget)  # the host's token history only: no read
        if kind == "lookup":
            self.note(state, kind, copied[:budget])
            return StaticDraft(host=Draft(tokens=copied[:budget]))
        drafted = self.early_exit.draft_static(state, budget, step, bucket)
        drafted.settle = lambda tokens: self.note(state, "early_exit", tokens)
        return drafted

    def propose_batch(self, states: list[DecodeState], budgets: list[int]) -> list[Draft]:
        """Each row's own choice, as alone; the early exit drafts its rows and the lookup rows ride along."""
        known: list[list[int] | None] = []
        kinds: list[str] = []
        for state, budget in zip(states, budgets, strict=True):
            if budget <= 0:
                kinds.append("none")
                known.append([])
                continue
            kind, copied = self.choose_round(state, budget)
            kinds.append(kind)
            known.append(copied if kind == "lookup" else None)
        drafts = self.early_exit.draft_rows(states, budgets, known)
        for state, kind, draft in zip(states, kinds, drafts, strict=True):
            if kind != "none":
                self.note(state, kind, draft.tokens)
        return drafts


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


def hybrid_costs(calibration: dict[str, Any] | None, exit_layer: int) -> CostModel | None:
    """The early exit's cost model at ``exit_layer`` from a calibration (its draft cost and verify curve), if any."""
    calibration = calibration or {}
    draft = (calibration.get("draft_cost") or {}).get(str(exit_layer))
    verify = calibration.get("verify_cost")
    if not isinstance(draft, (int, float)) or not isinstance(verify, dict) or not verify:
        return None
    return CostModel.from_json({"draft": draft, "verify": verify})


def make_hybrid(engine: Any, **options: Any) -> HybridDrafter:
    """The engine's hybrid: its early exit (layer, confidence, adapter, trees), calibrated agreement and costs."""
    settings = engine.config
    agreement = (settings.calibration.get("agreement") or {}).get(str(settings.exit_layer))
    options = {
        "exit_agreement": float(agreement) if isinstance(agreement, (int, float)) else 0.6,
        "confidence": settings.draft_confidence,
        "exit_adapter": settings.exit_adapter,
        "costs": hybrid_costs(settings.calibration, settings.exit_layer),
        **options,
    }
    hybrid = HybridDrafter(settings.exit_layer, **options)
    hybrid.early_exit.tree_nodes = settings.tree_nodes  # lookup drafts chains, the early exit trees
    return hybrid


class HybridCalibration(DrafterCalibration):
    """Lookup where the text repeats, else the best early exit calibration found."""

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best early exit's layer and length, replayed with copies where the text repeats."""
        if not context.matches:
            return []
        layer, k, _ = context.best_exit
        costs = CostModel(context.draft_cost[layer], context.verify_cost)
        speed = context.replay(costs, k, matches=context.matches[layer], lookup=(2, 3)).speedup
        settings = {**exit_settings(context, layer, k), "min_ngram": 2}
        return [Candidate(name, settings, speed, f"{name}(E={layer},k={k})", context.draft_cost[layer])]

    def valid(self, settings: dict[str, Any]) -> bool:
        """The plan names an exit layer."""
        return isinstance(settings.get("exit_layer"), int)

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """Lookup, else the early exit's layer, adapter and length."""
        return f"prompt lookup where the text repeats, else {describe_exit(settings)}"

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The hybrid at the plan's exit layer, with that layer's calibrated agreement."""
        exit_layer, adapter = planned_exit(engine, settings)
        agreement = (engine.config.calibration.get("agreement") or {}).get(str(exit_layer))
        return HybridDrafter(
            exit_layer,
            min_ngram=int(settings.get("min_ngram", 2)),
            exit_agreement=float(agreement) if isinstance(agreement, (int, float)) else 0.6,
            confidence=engine.config.draft_confidence,
            exit_adapter=adapter,
            costs=hybrid_costs(engine.config.calibration, exit_layer),
        )


def _rows(name: str, context: BenchContext) -> list[BenchRow]:
    """The adaptive hybrid, and through the saved exit adapter when there is one."""
    about = "prompt lookup or early exit per round; adaptive"
    engine = context.engine(drafter=name, exit_layer="auto", num_draft_tokens="auto")
    rows = [BenchRow(f"selfspec_{name}", engine, about, name)]
    adapted = context.engine(drafter=name, exit_adapter="auto", num_draft_tokens="auto")
    if adapted.exit_adapter is not None:
        about = f"prompt lookup, else early exit at layer {adapted.exit_layer} through the exit adapter; adaptive"
        rows.append(BenchRow(f"selfspec_{name}_exit_adapter", adapted, about, "exit_adapter"))
    return rows


register_drafter(
    "hybrid",
    make_hybrid,
    description="prompt lookup when a match exists and pays, else the early exit",
    trees=True,
    exit_adapter=True,
    calibrated=True,
    options=OPTIONS,
    calibration=HybridCalibration(),
    bench=DrafterBench(_rows, {"hybrid": "selfspec_hybrid: lookup or early exit per round"}),
)
