"""What a drafter's registration may declare beyond its factory: its calibration and its bench rows.

``drafter="auto"`` and ``selfspec bench`` know no drafter by name. A registration
(:func:`~selfspec.drafting.registry.register_drafter`) may pass

- ``calibration=`` a :class:`DrafterCalibration`: what calibration measures for the drafter on
  the model's own continuations (:meth:`~DrafterCalibration.measure`), the plan candidates it
  offers with their replayed speed (:meth:`~DrafterCalibration.candidates`), what is saved in
  ``selfspec.json`` (:meth:`~DrafterCalibration.saved`), and how ``drafter="auto"`` builds the
  drafter from a plan's settings (:meth:`~DrafterCalibration.build`);
- ``bench=`` a :class:`DrafterBench`: the ``selfspec bench`` rows it adds and their ``--methods``
  families.

Calibration (:mod:`selfspec.calibration.measure`) hands each hook a :class:`CalibrationContext`
and the benchmark (:mod:`selfspec.calibration.bench`) a :class:`BenchContext`: the drafter
modules never import the rings above them. :class:`RoundsCalibration` is the calibration of a
drafter measured by decoding with it (per round accepted lengths, draft cost per token), for
each of a few settings of its own options.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..core.speed import CostModel

if TYPE_CHECKING:
    from .base import Drafter

#: ``factory(engine, **options) -> Drafter`` (as registered).
DrafterFactory = Callable[..., "Drafter"]

#: The plan method of plain decoding (the baseline every candidate is compared with).
PLAIN = "none"


@dataclass(frozen=True)
class Candidate:
    """One setting of one drafter, with the speed calibration predicts for it.

    Attributes:
        method: the registered drafter's name (what the plan's ``method`` becomes).
        settings: the plan's settings for it (``num_draft_tokens``, ``exit_layer``, the drafter's
            own options...): what :meth:`DrafterCalibration.build` reads back.
        speedup: predicted tokens per plain-step cost (plain decoding is 1.0).
        label: how it is shown in ``selfspec.json``'s ``candidates`` (display only, never parsed).
        draft_cost: the cost of drafting one token relative to a plain step (the online guard's
            cost model when it is chosen).
    """

    method: str
    settings: dict[str, Any]
    speedup: float
    label: str
    draft_cost: float = 0.0


class Replayed(Protocol):
    """A replayed run (:class:`selfspec.calibration.measure.Replay`)."""

    @property
    def speedup(self) -> float:
        """Tokens per plain-step cost."""
        ...


class CalibrationContext(Protocol):
    """What calibration measured before asking the drafters (:class:`selfspec.calibration.measure.MeasureContext`).

    Attributes:
        engine: the calibrated engine (``None`` when candidates are replayed from saved figures).
        prompt_ids: the calibration prompts' token ids.
        max_new_tokens: tokens generated per prompt.
        max_draft_tokens: the longest draft length considered.
        data: the model's own greedy continuations.
        matches: per exit layer, per generated position, whether the early exit agreed.
        draft_cost: a draft step's cost per exit layer (relative to a plain step).
        verify_cost: verifying ``k`` drafts, per ``k``.
        step_seconds: one plain step's seconds.
        best_exit: ``(exit layer, draft length, predicted speedup)`` of the best early exit.
        exit_adapter_layer: the layer the engine's exit adapter reads, or ``None``.
        options: the drafter options given to ``calibrate(**options)``.
    """

    engine: Any
    prompt_ids: Sequence[list[int]]
    max_new_tokens: int
    max_draft_tokens: int
    data: Any
    matches: dict[int, list[list[bool]]]
    draft_cost: dict[int, float]
    verify_cost: dict[int, float]
    step_seconds: float
    best_exit: tuple[int, int, float]
    exit_adapter_layer: int | None
    options: dict[str, Any]

    @property
    def lengths(self) -> list[int]:
        """The measured draft lengths, shortest first."""
        ...

    def replay(self, costs: CostModel, num_draft_tokens: int, **how: Any) -> Replayed:
        """Replay the continuations with these costs (:func:`selfspec.calibration.measure.replay`)."""
        ...


class DrafterCalibration:
    """How calibration measures a drafter and how ``drafter="auto"`` replays its plan.

    Override what applies; the defaults offer no candidate and build the registered factory with
    the plan's ``settings["options"]``.

    Attributes:
        figures_key: the ``selfspec.json`` entry its measurement is kept under; drafters sharing a
            key share one measurement (an EAGLE head's chains serve ``eagle`` and ``eagle_hybrid``).
            ``None``: the drafter measures nothing of its own.
        options: the ``calibrate(**options)`` keywords it reads (others are refused).
        fallback_settings: the settings of the plan ``drafter="auto"`` runs when nothing was
            measured or the planned drafter cannot be built (one registration declares it).
    """

    figures_key: ClassVar[str | None] = None
    options: ClassVar[tuple[str, ...]] = ()
    fallback_settings: ClassVar[dict[str, Any] | None] = None

    def measure(self, name: str, context: CalibrationContext) -> Any:
        """Measure the drafter on this model and hardware (``None``: nothing to offer)."""
        return None

    def expected_speedup(self, name: str, context: CalibrationContext) -> float | None:
        """A cheap estimate of the drafter's speedup before its own measurement, or ``None`` (unknown).

        Under a calibration time budget the measurements run best estimate first, unknown ones (a
        learned head, whose worth only its measurement shows) before any estimate.
        """
        return None

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The plan candidates it offers, each replayed over the continuations."""
        return []

    def saved(self, figures: Any, candidates: list[Candidate]) -> dict[str, Any]:
        """Top-level entries for ``selfspec.json`` (its figures, the settings its factory reads)."""
        return {} if self.figures_key is None or figures is None else {self.figures_key: figures}

    def note(self, saved: dict[str, Any]) -> str:
        """One line for ``selfspec calibrate`` on what was saved (empty: nothing to say)."""
        return ""

    def valid(self, settings: dict[str, Any]) -> bool:
        """Whether a saved plan's settings can be replayed."""
        return True

    def describe(self, name: str, settings: dict[str, Any]) -> str:
        """The plan in words (:meth:`selfspec.drafting.auto.Plan.summary`)."""
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        return f"{name} ({shown})" if shown else name

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The drafter of a plan; raise a :class:`~selfspec.errors.SelfSpecError` when it no longer fits.

        Args:
            factory: the registration's factory (the default calls it with ``settings["options"]``).
            engine: the ``drafter="auto"`` engine.
            settings: the plan's settings.
            options: the engine's ``drafter_options``.
        """
        drafter: Drafter = factory(engine, **{**options, **settings.get("options", {})})
        return drafter


# ----------------------------------------------------------------------------- drafters measured by decoding


def measure_rounds(
    drafting: Any, prompt_ids: Sequence[list[int]], max_new_tokens: int, step_seconds: float
) -> dict[str, Any]:
    """Decode each prompt greedily with ``drafting`` (an engine) and record what its rounds accepted.

    Returns ``{"num_draft_tokens", "draft_cost", "accepted_per_round", "tau", "acceptance_rate"}``
    (empty when nothing was drafted): the accepted length of every round, the median over prompts
    of the drafting seconds per drafted token relative to one plain step (``step_seconds``), and
    the tokens per target forward.
    """
    accepted: list[int] = []
    costs: list[float] = []
    tokens = rounds = 0
    for ids in prompt_ids:
        out = drafting.generate_ids(ids, max_new_tokens=max_new_tokens)
        stats = out.stats
        # every round (the last one of a generation may draft less than the full chain)
        accepted += [n for n, count in enumerate(stats.accepted_length_histogram) for _ in range(count)]
        if stats.num_drafted and step_seconds > 0:
            costs.append(stats.draft_seconds / stats.num_drafted / step_seconds)
        tokens += len(out.token_ids)
        rounds += max(0, stats.target_forwards - 1)
    num_draft_tokens = drafting.num_draft_tokens
    if not accepted or not costs:
        return {}
    return {
        "num_draft_tokens": num_draft_tokens,
        "draft_cost": round(statistics.median(costs), 4),
        "accepted_per_round": accepted,
        "tau": round((tokens - len(prompt_ids)) / max(rounds, 1), 3),
        "acceptance_rate": round(sum(accepted) / (len(accepted) * num_draft_tokens), 4),
    }


def best_rounds_length(context: CalibrationContext, figures: dict[str, Any], lookup: bool = False) -> tuple[float, int]:
    """``(speedup, k)`` of the best draft length for a drafter measured per round (:func:`measure_rounds`).

    Each replayed round draws one of the measured accepted lengths (a shorter draft keeps a
    prefix); with ``lookup`` the round copies from the text where it repeats instead.
    """
    costs = CostModel(float(figures["draft_cost"]), context.verify_cost)
    longest = int(figures.get("num_draft_tokens", context.lengths[-1]))
    best = (0.0, 1)
    for k in [k for k in context.lengths if k <= longest]:
        run = context.replay(
            costs,
            k,
            lookup=(2, 3) if lookup else None,  # copy-only rounds where the text repeats
            accepted_per_round=figures["accepted_per_round"],
            max_draft_tokens=longest,  # measured chains were this long
        )
        best = max(best, (run.speedup, k))
    return best


class RoundsCalibration(DrafterCalibration):
    """A drafter measured by decoding with it, once per setting of its own options.

    Args:
        choices: the drafter options to try (``[{"max_chain": 2}, {"max_chain": 8}]``); each is
            measured with :func:`measure_rounds` on an engine built with
            ``drafter=name, drafter_options=choice``, replayed at every draft length, and offered
            as a candidate whose plan settings hold ``{"options": choice, "num_draft_tokens": k}``.
        num_draft_tokens: the measured chains' length (at most calibration's longest).
    """

    def __init__(self, choices: Sequence[dict[str, Any]] = ({},), num_draft_tokens: int = 4) -> None:
        self.choices = [dict(choice) for choice in choices]
        self.num_draft_tokens = num_draft_tokens

    def measure(self, name: str, context: CalibrationContext) -> list[dict[str, Any]] | None:
        """One :func:`measure_rounds` per option choice (those that drafted nothing are left out).

        The drafter is built with the calibrated engine's values of the options it declares (a
        head's file given to ``from_pretrained``); a plan that chooses it records them.
        """
        engine = context.engine
        own = engine.config.settings_for(name)
        measured = []
        for choice in self.choices:
            drafting = type(engine)(
                engine.model,
                engine.tokenizer,
                drafter=name,
                drafter_options=choice,
                num_draft_tokens=min(self.num_draft_tokens, context.max_draft_tokens),
                calibration={},
                **own,
            )
            figures = measure_rounds(drafting, context.prompt_ids, context.max_new_tokens, context.step_seconds)
            if figures:
                measured.append({"options": choice, "drafter_settings": _plain(own), **figures})
        return measured or None

    def candidates(self, name: str, context: CalibrationContext, figures: Any) -> list[Candidate]:
        """The best draft length of the best option choice."""
        best: tuple[float, int, dict[str, Any]] | None = None
        cost, own = 0.0, dict[str, Any]()
        for measured in figures or []:
            speed, k = best_rounds_length(context, measured)
            if best is None or speed > best[0]:
                best, cost = (speed, k, measured["options"]), float(measured["draft_cost"])
                own = measured.get("drafter_settings") or {}
        if best is None:
            return []
        speed, k, options = best
        shown = ",".join(f"{key}={value}" for key, value in options.items())
        label = f"{name}({shown + ',' if shown else ''}k={k})"
        settings = {"options": options, "num_draft_tokens": k, **({"drafter_settings": own} if own else {})}
        return [Candidate(name, settings, speed, label, cost)]

    def build(self, factory: DrafterFactory, engine: Any, settings: dict[str, Any], options: dict[str, Any]) -> Drafter:
        """The plan's drafter; the option values it was measured with fill those the engine was not given."""
        current = engine.config.drafter_settings
        for name, value in (settings.get("drafter_settings") or {}).items():
            if current.get(name) is None:
                current[name] = value
        return super().build(factory, engine, settings, options)


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    """The values a saved plan can hold (text, numbers, switches: a head's path, not a loaded head)."""
    simple = (str, int, float, bool, type(None))
    return {key: str(value) if isinstance(value, os.PathLike) else value for key, value in settings.items()
            if isinstance(value, (*simple, os.PathLike))}  # fmt: skip

    def saved(self, figures: Any, candidates: list[Candidate]) -> dict[str, Any]:
        """Nothing beyond the plan (the figures hold every round and are not kept)."""
        return {}


# ----------------------------------------------------------------------------- selfspec bench


@dataclass(frozen=True)
class BenchRow:
    """One ``selfspec bench`` row: a selfspec engine timed next to transformers.

    Attributes:
        name: the method's name (``selfspec_<something>``).
        engine: the :class:`~selfspec.decoding.engine.SpeculativeEngine` it runs
            (built with :meth:`BenchContext.engine`).
        description: one line for the report.
        family: the ``--methods`` choice that selects it.
        temperature: 0 for greedy (compared with transformers' greedy ``generate``), else the
            sampling temperature (compared with transformers' sampling at it).
    """

    name: str
    engine: Any
    description: str
    family: str
    temperature: float = 0.0


class BenchContext(Protocol):
    """What the benchmark hands a drafter's rows (:class:`selfspec.calibration.bench.RowContext`).

    Attributes:
        loaded: the engine ``selfspec bench`` loaded (its model, tokenizer, calibration, name).
        exit_layer: the fixed early-exit rows' layer.
        num_draft_tokens: the fixed rows' draft length.
        temperatures: the sampling temperatures compared.
        tree_nodes: the node budgets of the token-tree rows.
        draft_model: a loaded draft model, or ``None``.
    """

    loaded: Any
    exit_layer: int
    num_draft_tokens: int
    temperatures: Sequence[float]
    tree_nodes: Sequence[int]
    draft_model: Any

    def engine(self, **arguments: Any) -> Any:
        """A :class:`~selfspec.decoding.engine.SpeculativeEngine` on the loaded model with these arguments."""
        ...


@dataclass
class DrafterBench:
    """The ``selfspec bench`` rows a drafter adds.

    Attributes:
        rows: ``rows(name, context) -> [BenchRow, ...]``.
        families: the ``--methods`` families its rows use, each with one line of help.
    """

    rows: Any
    families: dict[str, str] = field(default_factory=dict)


def sampled(row: BenchRow, temperatures: Sequence[float], family: str | None = None) -> list[BenchRow]:
    """``row`` at each sampling temperature (``<name>_t<T>``)."""
    return [
        BenchRow(f"{row.name}_t{t}", row.engine, f"{row.description}, sampling T={t}", family or row.family, t)
        for t in temperatures
    ]


def tree_rows(context: BenchContext, row_for: Callable[[int], BenchRow]) -> list[BenchRow]:
    """A token-tree row per node budget of ``context.tree_nodes`` (``row_for(nodes)``), each greedy then sampled."""
    rows: list[BenchRow] = []
    for nodes in context.tree_nodes:
        tree = row_for(nodes)
        rows += [tree, *sampled(tree, context.temperatures)]
    return rows
