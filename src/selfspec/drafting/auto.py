"""The plan behind ``drafter="auto"``: the method calibration measured fastest on this model.

A :class:`Plan` is a method (a registered drafter's name) and its settings; it is saved in
``selfspec.json`` (under ``"plan"``) by :func:`~selfspec.calibration.calibrate` and read back by
the ``"auto"`` drafter, which builds it through the method's registration
(:class:`~selfspec.drafting.planning.DrafterCalibration`): no drafter is named here. Any
registered drafter whose registration declares a ``calibration`` can be planned;
:func:`plan_methods` lists them.

Per request the online guard (:mod:`selfspec.decoding.controller`) pauses any drafting that does
not pay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import SelfSpecError
from .eagle.options import LEARN_ONLINE
from .exit_adapter.options import EXIT_ADAPTER
from .planning import PLAIN, DrafterCalibration
from .registry import drafter_spec, register_drafter, registered

logger = logging.getLogger(__name__)

#: A method must be predicted this much faster than plain decoding to be chosen.
PLAIN_MARGIN = 1.05
#: The settings a plan saved before plans held ``settings`` (selfspec 0.x, calibration version 3) kept flat.
_FLAT_SETTINGS = ("exit_layer", "num_draft_tokens", "min_ngram", "layers", "exit_adapter", "eagle_head")


def plan_methods() -> list[str]:
    """The registered drafters a plan can name (their registration declares a ``calibration``)."""
    return [spec.name for spec in registered() if spec.calibration is not None]


def method_calibration(method: str) -> DrafterCalibration | None:
    """The registration's calibration of ``method``, or ``None`` (not registered, or not plannable)."""
    try:
        return drafter_spec(method).calibration
    except SelfSpecError:
        return None


@dataclass
class Plan:
    """What ``drafter="auto"`` runs, and why.

    Attributes:
        method: a registered drafter with a calibration (:func:`plan_methods`).
        settings: the method's own settings (what its calibration's ``build`` reads), e.g.
            ``{"exit_layer": 2, "num_draft_tokens": 3}``.
        predicted_speedup: predicted tokens/s relative to plain decoding on this hardware.
        reason: one line on why.
        calibrated: ``False`` for the fallback used when nothing was measured.
        threads: the engine's torch thread count and why (``threads="auto"``: the timings and the
            load it chose by), set by :attr:`SpeculativeEngine.plan <selfspec.SpeculativeEngine.plan>`;
            ``""``: not chosen. Not saved (measured at each load).
        exactness: what holds between the speculative text and the plain text (the engine's
            :attr:`~selfspec.SpeculativeEngine.exactness`, set by ``engine.plan``; not saved).
        measured: whose forwards calibration timed: ``"eager loop"``, or ``"static round
            (<backend>)"`` where ``compile=`` puts the engine's calls in the static round (its
            compiled steps priced, issue 40); ``""`` in plans saved before it was recorded.
    """

    method: str = PLAIN
    settings: dict[str, Any] = field(default_factory=dict)
    predicted_speedup: float | None = None
    reason: str = ""
    calibrated: bool = True
    threads: str = ""
    exactness: str = ""
    measured: str = ""

    @property
    def num_draft_tokens(self) -> int:
        """The starting draft length (it adapts); 4 when the method has none."""
        value = self.settings.get("num_draft_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else 4

    def summary(self) -> str:
        """One line: the method, its settings (in the method's own words) and the prediction."""
        hooks = method_calibration(self.method)
        what = hooks.describe(self.method, self.settings) if hooks is not None else self.method
        threads = f"; {self.threads}" if self.threads else ""
        if not self.calibrated:
            return f"{what} (not calibrated: no measurements){threads}"
        timed = f" (costs timed on the {self.measured})" if self.measured.startswith("static") else ""
        return (f"{what}: {self.reason}" if self.reason else what) + timed + threads

    def advice(self, name_or_path: str, has_head: bool) -> str:
        """How to get more speed: fetch the published EAGLE head the table names, else train one (``""``: none)."""
        if has_head or not name_or_path:
            return ""
        from .eagle.catalog import missing_head_advice  # a published head for this model that is not here

        published = missing_head_advice(name_or_path)
        if published:
            return published
        if self.method not in ("none", "prompt_lookup"):
            return ""
        return (
            f"for more speed, `selfspec train-eagle --model {name_or_path} --minutes 20` trains an EAGLE head for "
            "this model from its own text (no dataset; on SmolLM2-135M on a 2-core CPU it gave 1.13x chat and "
            "1.40x code over plain decoding); the next load finds it and drafter='auto' considers it"
        )

    def to_json(self) -> dict[str, Any]:
        """The ``"plan"`` entry of ``selfspec.json``."""
        return {
            "method": self.method,
            "settings": dict(self.settings),
            "predicted_speedup": self.predicted_speedup,
            "reason": self.reason,
            "calibrated": self.calibrated,
            "measured": self.measured,
        }

    @classmethod
    def from_json(cls, data: Any) -> Plan | None:
        """Read a saved plan (also the older flat form); ``None`` when missing, malformed or unknown."""
        if not isinstance(data, dict) or not isinstance(data.get("method"), str):
            return None
        hooks = method_calibration(data["method"])
        if hooks is None:
            return None
        settings = data.get("settings")
        if settings is None:  # the flat form: settings beside the method, unset ones as None or []
            settings = {k: data[k] for k in _FLAT_SETTINGS if data.get(k) not in (None, [])}
        speedup = data.get("predicted_speedup")
        if (
            not isinstance(settings, dict)
            or not isinstance(data.get("reason", ""), str)
            or not isinstance(data.get("measured", ""), str)
            or not (speedup is None or isinstance(speedup, (int, float)))
            or not hooks.valid(settings)
        ):
            return None
        return cls(
            data["method"],
            dict(settings),
            speedup,
            data.get("reason", ""),
            bool(data.get("calibrated", True)),
            measured=data.get("measured", ""),
        )


def uncalibrated_plan() -> Plan:
    """The plan ``drafter="auto"`` uses when no calibration was measured (``calibrate=False``).

    The registration that declares ``fallback_settings`` (a drafter that costs nothing to draft,
    which the guard pauses where it does not pay); plain decoding when none does.
    """
    for spec in registered():
        if spec.calibration is not None and spec.calibration.fallback_settings is not None:
            return Plan(spec.name, dict(spec.calibration.fallback_settings), calibrated=False)
    return Plan(PLAIN, calibrated=False)


def plan_of(calibration: dict[str, Any] | None) -> Plan | None:
    """The plan saved in a calibration, or ``None``."""
    return Plan.from_json((calibration or {}).get("plan"))


def sampled_plan_of(calibration: dict[str, Any] | None) -> Plan | None:
    """The plan for sampling requests saved in a calibration (``"sampled_plan"``), or ``None``.

    Calibration replays the greedy plan on the model's own sampled continuations (rejection
    sampling, exact acceptance counts); sampled drafts are accepted less often than greedy ones,
    so where they do not pay this plan is plain decoding.
    """
    data = (calibration or {}).get("sampled_plan")
    if not isinstance(data, dict) or not isinstance(data.get("method"), str):
        return None
    if data["method"] == PLAIN:  # plain decoding needs no registration's settings check
        speedup = data.get("predicted_speedup")
        return Plan(PLAIN, {}, speedup if isinstance(speedup, (int, float)) else None, str(data.get("reason", "")))
    return Plan.from_json(data)


def sampled_drafts_pay(calibration: dict[str, Any] | None) -> bool:
    """Whether ``drafter="auto"`` drafts when a request samples: not when the sampled plan is plain decoding."""
    plan = sampled_plan_of(calibration)
    return plan is None or plan.method != PLAIN


def plan_settings(calibration: dict[str, Any]) -> dict[str, Any]:
    """``calibration`` with the plan's exit layer and draft length as the ``"auto"`` values."""
    plan = plan_of(calibration)
    if plan is None:
        return calibration
    settings = {**calibration, "num_draft_tokens": plan.num_draft_tokens}
    exit_layer = plan.settings.get("exit_layer")
    if isinstance(exit_layer, int):
        settings["exit_layer"] = exit_layer
    return settings


def _build(plan: Plan, engine: Any, options: dict[str, Any]) -> Any:
    spec = drafter_spec(plan.method)
    if spec.calibration is None:
        raise SelfSpecError(f"the registered drafter {plan.method!r} has no calibration")
    return spec.calibration.build(spec.factory, engine, plan.settings, options)


def make_auto(engine: Any, **options: Any) -> Any:
    """The drafter of the engine's calibrated plan (:class:`Plan`), logged once per engine.

    Built by the plan's method's registration; when it no longer fits (a head removed, an exit
    layer the model does not have) the uncalibrated plan's drafter runs instead, with a warning.
    """
    plan = plan_of(engine.config.calibration) or uncalibrated_plan()
    try:
        drafter = _build(plan, engine, options)
    except SelfSpecError as error:
        fallback = uncalibrated_plan()
        logger.warning(
            "drafter='auto': the planned %s is not usable (%s); using %s", plan.method, error, fallback.method
        )
        drafter = _build(fallback, engine, options)
    drafter.plan = plan
    if getattr(engine, "_logged_plan", None) != plan.summary():
        engine._logged_plan = plan.summary()
        name = getattr(engine, "model_name", engine.name_or_path) if engine.name_or_path else ""  # short names
        advice = plan.advice(name, has_head=bool(engine.config.calibration.get("eagle")))
        logger.info("drafter='auto' for %s: %s%s", name or "the model", plan.summary(),
                    f"; {advice}" if advice else "")  # fmt: skip
    return drafter


def _auto_rows(name: str, context: Any) -> list[Any]:
    from .planning import BenchRow, sampled

    planned = context.engine(drafter=name, calibration=context.loaded.calibration)
    about = f"drafter='auto': {planned.plan.summary() if planned.plan else 'plan'}"
    row = BenchRow(f"selfspec_{name}", planned, about, name)
    return [row, *sampled(BenchRow(row.name, planned, "drafter='auto'", name), context.temperatures)]


def _bench() -> Any:
    from .planning import DrafterBench

    about = "selfspec_auto (+ _tT): the calibrated plan, greedy and at each temperature"
    return DrafterBench(_auto_rows, {"auto": about})


register_drafter(
    "auto",
    make_auto,
    description="the fastest method calibration measured on this model and hardware (plain when none pays)",
    exit_adapter=True,
    calibrated=True,
    bench=_bench(),
    options=(EXIT_ADAPTER, LEARN_ONLINE),  # the plan may draft with either
)
