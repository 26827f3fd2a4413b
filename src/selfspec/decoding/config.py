"""The engine's settings: validated once, with every ``"auto"`` resolved in one place.

:class:`EngineConfig` is what the parts of an engine read (the drafter factories in
particular: ``engine.config.exit_layer``, ``engine.config.tree_nodes``, ...). It is built from
the engine's :class:`~selfspec.decoding.options.EngineOptions`, the model and the saved calibration
by :meth:`EngineConfig.resolve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..drafting import Drafter, drafter_spec
from ..drafting.auto import plan_settings
from ..drafting.exit_adapter.adapter import ExitAdapter, engine_exit_adapter
from ..drafting.registry import drafters_using, drafters_with, names_in_words
from ..errors import ConfigurationError
from ..modeling.runner import ModelRunner
from .options import (
    DEFAULT_CALIBRATION_BUDGET,
    DEFAULT_DRAFT_CONFIDENCE,
    EngineOptions,
    check_budget,
)

__all__ = [
    "DEFAULT_CALIBRATION_BUDGET",
    "DEFAULT_DRAFT_CONFIDENCE",
    "EngineConfig",
    "check_arguments",
    "check_budget",
    "default_exit_layer",
]

#: Draft length used when ``num_draft_tokens="auto"`` finds no calibration.
DEFAULT_NUM_DRAFT_TOKENS = 4
#: Node budget used when ``tree_nodes="auto"`` finds no calibration (``None``: a chain).
DEFAULT_TREE_NODES: int | None = None


def default_exit_layer(num_layers: int) -> int:
    """The exit layer used when ``exit_layer="auto"`` finds no calibration: ``L // 4``."""
    return max(1, num_layers // 4)


def check_arguments(exit_layer: Any, num_draft_tokens: Any, drafter: Any, tree_nodes: Any = None) -> None:
    """Reject malformed engine arguments (before any weights are loaded): the checks of :class:`EngineOptions`."""
    EngineOptions(exit_layer=exit_layer, num_draft_tokens=num_draft_tokens, drafter=drafter, tree_nodes=tree_nodes)


def wants_calibration(exit_layer: Any, num_draft_tokens: Any, drafter: Any, tree_nodes: Any) -> bool:
    """Whether ``"auto"`` settings of a calibrated drafter would read a measured calibration."""
    if isinstance(drafter, Drafter) or "auto" not in (exit_layer, num_draft_tokens, tree_nodes):
        return False
    return drafter_spec(drafter).calibrated


@dataclass
class EngineConfig:
    """An engine's resolved settings (see :class:`~selfspec.SpeculativeEngine` for each argument).

    Attributes:
        drafter: the drafter's registered name, or the user's :class:`~selfspec.drafting.Drafter`.
        exit_layer: the early exit's layer (``1 .. num_layers - 1``).
        num_draft_tokens: the (starting) draft length.
        adaptive: whether the draft length adapts (``num_draft_tokens="auto"``).
        draft_confidence: the early exit's confidence stop (``0``: none).
        tree_nodes: the token-tree node budget, or ``None`` for chains.
        calibration: the measured settings the ``"auto"`` values came from (may be empty).
        exit_adapter: the trained exit adapter the drafter uses, if any (resolved from the
            ``exit_adapter`` option).
        draft_tokenizer: the draft model's tokenizer, checked against the target's.
        drafter_settings: the value of every option a registered drafter declares
            (:class:`~selfspec.drafting.declaring.DrafterOption`), by name; each reads as an
            attribute too: ``config.eagle_head``, ``config.medusa_heads``, ``config.draft_model``,
            ``config.learn_online``, a custom head's ``config.my_head``.
        drafter_options: keyword options passed to the drafter's factory.
        batching: whether concurrent calls are decoded together.
        fast_path: whether the lean layer path is used where it applies.
    """

    drafter: str | Drafter
    exit_layer: int
    num_draft_tokens: int
    adaptive: bool
    draft_confidence: float
    tree_nodes: int | None
    calibration: dict[str, Any] = field(default_factory=dict)
    exit_adapter: ExitAdapter | None = None
    draft_tokenizer: Any = None
    drafter_settings: dict[str, Any] = field(default_factory=dict)
    drafter_options: dict[str, Any] = field(default_factory=dict)
    batching: bool = False
    fast_path: bool = True

    def settings_for(self, drafter: str) -> dict[str, Any]:
        """The values given for the options the drafter ``drafter`` declares (defaults left out)."""
        return {
            option.name: self.drafter_settings[option.name]
            for option in drafter_spec(drafter).options
            if option.name in self.drafter_settings and option.given(self.drafter_settings[option.name])
        }

    def __getattr__(self, name: str) -> Any:
        """A drafter's option by name (``config.eagle_head``), from :attr:`drafter_settings`."""
        settings = self.__dict__.get("drafter_settings")
        if settings is not None and name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def drafter_name(self) -> str:
        """The drafter's registered name (a user's instance: its ``name``)."""
        return self.drafter.name if isinstance(self.drafter, Drafter) else self.drafter

    @classmethod
    def resolve(
        cls,
        runner: ModelRunner,
        name_or_path: str,
        calibration: dict[str, Any],
        options: EngineOptions | None = None,
        *,
        draft_tokenizer: Any = None,
        drafter_options: dict[str, Any] | None = None,
    ) -> EngineConfig:
        """Validate the engine's options and resolve every ``"auto"`` against ``calibration``.

        Args:
            runner: the target's runner (its number of layers bounds ``exit_layer``).
            name_or_path: the model's name (where a saved exit adapter is looked for).
            calibration: the measured settings the ``"auto"`` values come from (may be empty).
            options: the engine's options (:class:`~selfspec.decoding.options.EngineOptions`; the
                loading ones are not read here); ``None``: the defaults.
            draft_tokenizer: the draft model's tokenizer (``drafter="draft_model"``).
            drafter_options: keyword options for the drafter's factory.

        Raises:
            ConfigurationError: an option does not fit the model or drafter (a malformed one was
                refused when ``options`` were declared).
        """
        options = options or EngineOptions()
        exit_layer, num_draft_tokens, drafter = options.exit_layer, options.num_draft_tokens, options.drafter
        tree_nodes, draft_confidence = options.tree_nodes, options.draft_confidence
        settings = {name: getattr(options, name) for name in EngineOptions.drafter_options() if hasattr(options, name)}
        if drafter == "auto" and settings.get("eagle_head") == "auto":  # the plan considers the head "auto" finds
            settings["eagle_head"] = None
        adapter_module = engine_exit_adapter(options.exit_adapter, runner, name_or_path, exit_layer, drafter)
        if adapter_module is not None:
            exit_layer = adapter_module.exit_layer  # the layer the adapter was trained for
        adaptive = num_draft_tokens == "auto"
        confidence = DEFAULT_DRAFT_CONFIDENCE if draft_confidence is None else draft_confidence
        _check_drafter_options(drafter, settings)
        if drafter_options is not None and not isinstance(drafter_options, dict):
            raise ConfigurationError(f"drafter_options must be a dict or None, got {drafter_options!r}")
        planned = plan_settings(calibration) if drafter == "auto" else calibration  # drafter="auto": the plan's E, k
        return cls(
            drafter=drafter,
            exit_layer=_resolve_exit_layer(exit_layer, runner.num_layers, planned),
            num_draft_tokens=_resolve_num_draft_tokens(num_draft_tokens, planned),
            adaptive=adaptive,
            draft_confidence=confidence if adaptive else 0.0,
            tree_nodes=_resolve_tree_nodes(tree_nodes, drafter, calibration),
            calibration=calibration,
            exit_adapter=adapter_module,
            draft_tokenizer=draft_tokenizer,
            drafter_settings=settings,
            drafter_options=dict(drafter_options or {}),
            batching=options.batching,
            fast_path=runner.fast_layers is not None,
        )


def _resolve_exit_layer(exit_layer: int | str, num_layers: int, calibration: dict[str, Any]) -> int:
    if exit_layer == "auto":
        saved = calibration.get("exit_layer")
        if isinstance(saved, int) and 1 <= saved < num_layers:
            return saved
        return default_exit_layer(num_layers)
    assert isinstance(exit_layer, int)
    if not 1 <= exit_layer <= num_layers - 1:
        raise ConfigurationError(
            f"exit_layer must be in [1, {num_layers - 1}] for this {num_layers}-layer model, got {exit_layer}"
        )
    return exit_layer


def _resolve_num_draft_tokens(num_draft_tokens: int | str, calibration: dict[str, Any]) -> int:
    if num_draft_tokens == "auto":
        saved = calibration.get("num_draft_tokens")
        return saved if isinstance(saved, int) and saved >= 1 else DEFAULT_NUM_DRAFT_TOKENS
    assert isinstance(num_draft_tokens, int)
    return num_draft_tokens


def _resolve_tree_nodes(
    tree_nodes: int | str | None, drafter: str | Drafter, calibration: dict[str, Any]
) -> int | None:
    """``"auto"``: the calibrated choice for calibrated tree drafters, the default for other tree drafters."""
    tree_drafters = drafters_with("trees")
    if tree_nodes == "auto":
        if isinstance(drafter, Drafter) or drafter not in tree_drafters:
            return None  # a drafter that drafts no trees: a chain
        if not drafter_spec(drafter).calibrated:
            return DEFAULT_TREE_NODES  # e.g. Medusa's candidate tree (calibration races the early exit's)
        saved = calibration.get("tree_nodes", DEFAULT_TREE_NODES)
        return saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1 else None
    if tree_nodes is not None and (isinstance(drafter, Drafter) or drafter not in tree_drafters):
        name = drafter.name if isinstance(drafter, Drafter) else drafter
        raise ConfigurationError(
            f"tree_nodes drafts trees with the {names_in_words(tree_drafters)} drafters, not {name!r}; "
            "a Drafter instance returns trees through Draft.parents itself"
        )
    assert tree_nodes is None or isinstance(tree_nodes, int)
    return tree_nodes


def _check_drafter_options(drafter: str | Drafter, settings: dict[str, Any]) -> None:
    """A drafter's own option must not be given with another drafter (``eagle_head=`` with ``prompt_lookup``)."""
    for name, option in EngineOptions.drafter_options().items():
        if not option.exclusive or not option.given(settings.get(name, option.default)):
            continue
        users = drafters_using(name) + (["auto"] if option.auto else [])
        if drafter not in users:
            wanted = " or ".join(f"drafter={user!r}" for user in users)
            shown = f"{name}={settings[name]!r}" if isinstance(settings[name], bool) else f"{name}="
            raise ConfigurationError(f"{shown} is only used with {wanted}")


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The end-of-sequence tokens: the generation config's, else the tokenizer's, else the model config's."""
    eos: Any = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(int(e) for e in eos) if isinstance(eos, (list, tuple)) else frozenset({int(eos)})
