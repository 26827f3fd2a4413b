"""The plan behind ``drafter="auto"``: the method calibration measured fastest on this model.

A :class:`Plan` is saved in ``selfspec.json`` (under ``"plan"``) by
:func:`~selfspec.calibration.calibrate` and read back by the ``"auto"`` drafter, which builds:

- ``"none"``: plain decoding (nothing beat it on this model and hardware);
- ``"prompt_lookup"``: copies from the prompt where it repeats, plain steps elsewhere;
- ``"early_exit"``: the target's first ``exit_layer`` layers (through an exit adapter when one
  is saved beside the model);
- ``"hybrid"``: prompt lookup where the text repeats, else the early exit;
- ``"layer_skip"``: a subset of the layers;
- ``"eagle"``: an EAGLE-style feature head found for the model (:func:`~selfspec.drafting.eagle.head.find_eagle_head`);
- ``"eagle_hybrid"``: prompt-lookup copies where the text repeats, the head's chains elsewhere.

Per request the lookup part drafts only where the prompt gives it something to copy, and the
online guard (:mod:`selfspec.decoding.controller`) pauses any drafting that does not pay.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from .registry import register_drafter

logger = logging.getLogger(__name__)

#: Methods a plan can name.
PLAN_METHODS = ("none", "prompt_lookup", "early_exit", "hybrid", "layer_skip", "eagle", "eagle_hybrid")
#: A method must be predicted this much faster than plain decoding to be chosen.
PLAIN_MARGIN = 1.05


@dataclass
class Plan:
    """What ``drafter="auto"`` runs, and why.

    Attributes:
        method: one of :data:`PLAN_METHODS`.
        exit_layer: the early exit's layer (``"early_exit"`` and ``"hybrid"``).
        num_draft_tokens: the starting draft length (it adapts).
        min_ngram: the shortest n-gram prompt lookup copies after.
        layers: the layer-skip drafter's layers.
        exit_adapter: whether the early exit reads the exit layer through the saved adapter.
        eagle_head: the EAGLE head's folder (``"eagle"`` and ``"eagle_hybrid"``).
        predicted_speedup: predicted tokens/s relative to plain decoding on this hardware.
        reason: one line on why.
        calibrated: ``False`` for the fallback used when nothing was measured.
    """

    method: str = "prompt_lookup"
    exit_layer: int | None = None
    num_draft_tokens: int = 4
    min_ngram: int = 2
    layers: list[int] = field(default_factory=list)
    exit_adapter: bool = False
    eagle_head: str | None = None
    predicted_speedup: float | None = None
    reason: str = ""
    calibrated: bool = True

    def summary(self) -> str:
        """One line: the method, its settings and the prediction."""
        if self.method == "none":
            what = "plain decoding"
        elif self.method == "prompt_lookup":
            what = f"prompt lookup (min_ngram={self.min_ngram}), plain steps where nothing repeats"
        elif self.method == "layer_skip":
            what = f"layer skip ({len(self.layers)} layers, k={self.num_draft_tokens})"
        elif self.method in ("eagle", "eagle_hybrid"):
            what = f"EAGLE head, k={self.num_draft_tokens}"
            if self.method == "eagle_hybrid":
                what = f"{what}, prompt-lookup copies where the text repeats"
        else:
            adapter = " with its exit adapter" if self.exit_adapter else ""
            what = f"early exit at layer {self.exit_layer}{adapter}, k={self.num_draft_tokens}"
            if self.method == "hybrid":
                what = f"prompt lookup where the text repeats, else {what}"
        if not self.calibrated:
            return f"{what} (not calibrated: no measurements)"
        return f"{what}: {self.reason}" if self.reason else what

    def advice(self, name_or_path: str, has_head: bool) -> str:
        """How to get more speed when the plan drafts little: train an EAGLE head (``""`` otherwise)."""
        if self.method not in ("none", "prompt_lookup") or has_head or not name_or_path:
            return ""
        return (
            f"for more speed, `selfspec train-eagle --model {name_or_path} --minutes 20` trains an EAGLE head for "
            "this model from its own text (no dataset; on SmolLM2-135M on a 2-core CPU it gave 1.13x chat and "
            "1.40x code over plain decoding); the next load finds it and drafter='auto' considers it"
        )

    def to_json(self) -> dict[str, Any]:
        """The ``"plan"`` entry of ``selfspec.json``."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Plan | None:
        """Read a saved plan; ``None`` when missing or malformed."""
        if not isinstance(data, dict) or data.get("method") not in PLAN_METHODS:
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            plan = cls(**known)
        except TypeError:
            return None
        if plan.method in ("early_exit", "hybrid") and not isinstance(plan.exit_layer, int):
            return None
        return plan


#: The plan ``drafter="auto"`` uses when no calibration was measured (``calibrate=False``):
#: copying costs nothing to draft, and the guard pauses it where it does not pay.
UNCALIBRATED_PLAN = Plan("prompt_lookup", num_draft_tokens=4, min_ngram=2, calibrated=False)


def plan_of(calibration: dict[str, Any] | None) -> Plan | None:
    """The plan saved in a calibration, or ``None``."""
    return Plan.from_json((calibration or {}).get("plan"))


def plan_settings(calibration: dict[str, Any]) -> dict[str, Any]:
    """``calibration`` with the plan's exit layer and draft length as the ``"auto"`` values."""
    plan = plan_of(calibration)
    if plan is None:
        return calibration
    settings = {**calibration, "num_draft_tokens": plan.num_draft_tokens}
    if isinstance(plan.exit_layer, int):
        settings["exit_layer"] = plan.exit_layer
    return settings


def make_auto(engine: Any, **options: Any) -> Any:
    """The drafter of the engine's calibrated plan (:class:`Plan`), logged once per engine."""
    from ..errors import ConfigurationError, ModelNotFoundError
    from . import EarlyExitDrafter, HybridDrafter, LayerSkipDrafter, NoDrafter, PromptLookupDrafter

    settings = engine.config
    plan = plan_of(settings.calibration) or UNCALIBRATED_PLAN
    num_layers = engine.runner.num_layers
    adapter = settings.exit_adapter if plan.exit_adapter or settings.exit_adapter is not None else None
    exit_layer = plan.exit_layer if isinstance(plan.exit_layer, int) and 1 <= plan.exit_layer < num_layers else None
    if adapter is not None and exit_layer != adapter.exit_layer:
        adapter = None
    drafter: Any = None
    if plan.method in ("eagle", "eagle_hybrid"):
        from .eagle.drafter import make_eagle

        try:
            drafter = make_eagle(engine, eagle_head=plan.eagle_head, lookup=plan.method == "eagle_hybrid")
        except (ConfigurationError, ModelNotFoundError) as error:  # the head was removed or no longer fits
            logger.warning("drafter='auto': the planned EAGLE head is not usable (%s); using prompt lookup", error)
            drafter = PromptLookupDrafter(min_ngram=plan.min_ngram, **options)
    elif plan.method == "none":
        drafter = NoDrafter()
    elif plan.method == "prompt_lookup" or (plan.method in ("early_exit", "hybrid") and exit_layer is None):
        drafter = PromptLookupDrafter(min_ngram=plan.min_ngram, **options)
    elif plan.method == "early_exit":
        drafter = EarlyExitDrafter(exit_layer, confidence=settings.draft_confidence, exit_adapter=adapter)  # type: ignore[arg-type]
    elif plan.method == "hybrid":
        agreement = (settings.calibration.get("agreement") or {}).get(str(exit_layer))
        drafter = HybridDrafter(
            exit_layer,  # type: ignore[arg-type]
            min_ngram=plan.min_ngram,
            exit_agreement=float(agreement) if isinstance(agreement, (int, float)) else 0.6,
            confidence=settings.draft_confidence,
            exit_adapter=adapter,
        )
    else:
        layers = [i for i in plan.layers if 0 <= i < num_layers]
        drafter = LayerSkipDrafter(layers) if layers else NoDrafter()
    drafter.plan = plan
    if getattr(engine, "_logged_plan", None) != plan.summary():
        engine._logged_plan = plan.summary()
        advice = plan.advice(engine.name_or_path, has_head=bool(settings.calibration.get("eagle")))
        logger.info("drafter='auto' for %s: %s%s", engine.name_or_path or "the model", plan.summary(),
                    f"; {advice}" if advice else "")  # fmt: skip
    return drafter


register_drafter(
    "auto",
    make_auto,
    description="the fastest method calibration measured on this model and hardware (plain when none pays)",
    exit_adapter=True,
    calibrated=True,
)
