"""The engine's options and a call's options, each declared once (no torch imported here).

:class:`EngineOptions` declares every option of :meth:`SpeculativeEngine.from_pretrained
<selfspec.SpeculativeEngine.from_pretrained>`: its name, type and default (the dataclass field),
one line of help, the command-line flag, how a flag's text is parsed and which ``selfspec`` verbs
take it (the field's :class:`OptionSpec`). It is composed of the engine's own options, declared
here, and every registered drafter's (a :class:`~selfspec.drafting.declaring.DrafterOption` in its
registration: ``eagle_head``, ``medusa_heads``, ``draft_model``, ``exit_adapter``,
``learn_online``, a custom head's file). From it come ``from_pretrained``'s parameters (pinned
by a test), :meth:`EngineConfig.resolve <selfspec.decoding.config.EngineConfig.resolve>`'s input,
the flags of every verb, the arguments ``selfspec serve`` loads its engine with, and the fields of
both framework adapters (``ChatSpeculative``, ``SpeculativeLLM``; pinned by tests).

``EngineOptions`` is composed when this module is imported, from the built-in drafters' options
(declared without torch); a drafter registered later adds its options to
:meth:`EngineOptions.current`, which ``from_pretrained``, the command line and the server read.

:class:`GenerateOptions` declares the keyword options of ``generate``, ``generate_ids``,
``stream`` and ``stream_ids`` once.

:func:`check_drafter_name` refuses an unknown ``drafter=`` name with the valid names and the
closest one, without importing torch (the adapters check at construction).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import Field, dataclass, field, fields, make_dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict

from ..drafting.declaring import LOAD_VERBS, RUN_VERBS, DrafterOption, OptionSpec
from ..drafting.registry import BUILTIN_DRAFTERS, declared_options, registered_now
from ..errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from ..core.constraints import TokenConstraint
    from ..drafting import Drafter

__all__ = [
    "BUILTIN_DRAFTERS",
    "LOAD_VERBS",
    "RUN_VERBS",
    "EngineOptions",
    "EngineOwnOptions",
    "GenerateOptions",
    "OptionSpec",
]

#: The default first-load calibration time budget in seconds: first load of a 0.5B model on a 2-core
#: CPU stays well under 15 minutes (docs/calibration.md).
DEFAULT_CALIBRATION_BUDGET = 300.0
#: With ``num_draft_tokens="auto"``, the early exit stops drafting below this top probability.
DEFAULT_DRAFT_CONFIDENCE = 0.3


# ----------------------------------------------------------------------------- parsing flags
def bounded_int(value: str, minimum: int, what: str = "", maximum: int | None = None) -> int:
    """An int in ``[minimum, maximum]`` read from a flag's text (the ``ValueError`` names ``what``, if given)."""
    expected = f"{what} must be an int " if what else "must be an int "
    expected += f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{expected}, got {value!r}") from None
    if parsed < minimum or (maximum is not None and parsed > maximum):
        raise ValueError(f"{expected}, got {parsed}")
    return parsed


def number(value: str, what: str = "value") -> float:
    """A float read from a flag's text (``ValueError`` names ``what``)."""
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{what}: expected a number, got {value!r}") from None


def parse_threads(value: str) -> int | str:
    """``auto`` or an int >= 1."""
    if value == "auto":
        return value
    try:
        int(value)
    except ValueError:
        raise ValueError(f"threads must be 'auto' or an int >= 1, got {value!r}") from None
    return bounded_int(value, 1)


def parse_exit_layer(value: str) -> int | str:
    """``auto`` or an int >= 1."""
    if value == "auto":
        return value
    try:
        return bounded_int(value, 1, "exit_layer")
    except ValueError:
        raise ValueError(f"exit_layer must be 'auto' or an int >= 1, got {value!r}") from None


def parse_num_draft_tokens(value: str) -> int | str:
    """``auto`` or an int in ``[1, MAX_DRAFT_TOKENS]``."""
    from ..core.validation import check_num_draft_tokens

    if value == "auto":
        return value
    try:
        given: Any = int(value)
    except ValueError:
        given = value
    return check_num_draft_tokens(given)


#: ``compile=`` values besides a ``torch.compile`` backend name.
COMPILE_CHOICES = ("auto", "on", "off")


def parse_compile(value: str) -> bool | str:
    """``on``/``off``/``auto``, or a ``torch.compile`` backend name (``inductor``, ``aot_eager``)."""
    lowered = value.lower()
    if lowered in ("on", "true", "1"):
        return True
    if lowered in ("off", "false", "0"):
        return False
    return value


def check_compile(value: Any) -> None:
    """Refuse a ``compile=`` that is not a bool, ``"auto"`` or a backend name (checked when the engine resolves it)."""
    if isinstance(value, bool) or (isinstance(value, str) and value.strip() and value.replace("_", "").isalnum()):
        return
    raise ConfigurationError(
        f"compile must be True, False, 'auto' or a torch.compile backend name such as 'inductor', got {value!r}"
    )


#: ``row_exact=`` values besides True and False.
ROW_EXACT_CHOICES = ("auto", "on", "off")


def refuse_unknown_keywords(caller: str, given: Iterable[str], known: list[str]) -> None:
    """Raise the ``TypeError`` Python raises for a bad keyword, naming the closest known one.

    Raises:
        TypeError: e.g. ``from_pretrained() got an unexpected keyword argument 'drafer' (did you
            mean 'drafter'?)``.
    """
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}{hint}")


def parse_row_exact(value: str) -> bool | str:
    """``auto``, ``on`` or ``off`` (also ``true``/``false``/``1``/``0``)."""
    lowered = value.strip().lower()
    if lowered == "auto":
        return "auto"
    if lowered in ("on", "true", "1"):
        return True
    if lowered in ("off", "false", "0"):
        return False
    raise ValueError(f"row_exact must be auto, on or off, got {value!r}")


def check_row_exact(value: Any) -> None:
    """Refuse a ``row_exact=`` that is not ``True``, ``False`` or ``"auto"``."""
    if value is True or value is False or value == "auto":
        return
    raise ConfigurationError(f"row_exact must be True, False or 'auto', got {value!r}")


def parse_tree_nodes(value: str) -> int | str | None:
    """An int, ``auto`` or ``none`` (a chain)."""
    from ..core.validation import check_tree_nodes

    if value.lower() == "none":
        return None
    if value == "auto":
        return value
    try:
        return check_tree_nodes(int(value))
    except ValueError as error:
        if "tree_nodes" in str(error):
            raise
        raise ValueError(f"tree_nodes must be an int, 'auto' or 'none', got {value!r}") from None


def parse_draft_confidence(value: str) -> float:
    """A probability in ``[0, 1)``."""
    confidence = number(value, "draft_confidence")
    check_draft_confidence(confidence)
    return confidence


def parse_calibration_budget(value: str) -> float | None:
    """Seconds (a positive number) or ``none`` (no limit)."""
    if value.strip().lower() in ("none", "inf", "unlimited"):
        return None
    seconds = number(value, "calibration_budget")
    check_budget(seconds)
    return seconds


def parse_drafter(value: str) -> str:
    """A registered drafter's name (the closest one is named when not)."""
    check_drafter_name(value)
    return value


def parse_device(value: str) -> str:
    """``auto``, ``cpu``, or a device this torch build has (checked before any model loads)."""
    kind = value.split(":", 1)[0].lower()
    if kind in ("auto", "cpu"):
        return value
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {value!r}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu or auto"
            )
        index = value.split(":", 1)[1] if ":" in value else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {value!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif kind == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {value!r}: MPS is not available here; use --device cpu or auto")
    else:
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(f"unknown device {value!r}: use auto, cpu, cuda, cuda:N or mps") from None
    return value


# ----------------------------------------------------------------------------- checks
def check_budget(calibration_budget: Any) -> None:
    """Reject a calibration budget that is not ``None`` or a positive number of seconds."""
    if calibration_budget is None:
        return
    if isinstance(calibration_budget, bool) or not isinstance(calibration_budget, (int, float)):
        raise ConfigurationError(f"calibration_budget must be seconds (a number) or None, got {calibration_budget!r}")
    if not calibration_budget > 0:
        raise ConfigurationError(f"calibration_budget must be positive seconds, got {calibration_budget!r}")


def check_threads(threads: Any) -> None:
    """Reject a ``threads=`` that is not ``"auto"``, an int >= 1 or ``None``."""
    if threads is None or threads == "auto":
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigurationError(f"threads must be 'auto', an int >= 1 or None, got {threads!r}")


def check_draft_confidence(draft_confidence: Any) -> None:
    """Reject a draft confidence that is not ``None`` or a probability in ``[0, 1)``."""
    if draft_confidence is None:
        return
    if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, (int, float)):
        raise ConfigurationError(f"draft_confidence must be a number in [0, 1) or None, got {draft_confidence!r}")
    if not 0.0 <= draft_confidence < 1.0 or math.isnan(draft_confidence):
        raise ConfigurationError(f"draft_confidence must be in [0, 1), got {draft_confidence!r}")


def check_auto_exit_layer(drafter: Any, exit_layer: Any) -> None:
    """``drafter="auto"`` takes the exit layer from its plan: an explicit one means another drafter."""
    if drafter == "auto" and exit_layer != "auto":
        raise ConfigurationError(
            f"exit_layer={exit_layer!r} sets the early exit's layer, and drafter='auto' takes it from the "
            "calibrated plan: pass drafter='early_exit' (or 'hybrid') to choose the layer yourself"
        )


def known_drafters() -> list[str]:
    """The names ``drafter=`` takes, without importing torch.

    The built-in ones, and once :mod:`selfspec.drafting` is imported (it must be, to register
    one) every registered one.
    """
    return list(dict.fromkeys([*BUILTIN_DRAFTERS, *registered_now()]))


def check_drafter_name(drafter: Any) -> None:
    """Refuse a ``drafter=`` that is neither a registered name nor a :class:`~selfspec.drafting.Drafter`.

    Raises:
        ConfigurationError: e.g. ``unknown drafter 'eagle3' (did you mean 'eagle'?); choose one
            of early_exit, prompt_lookup, ...``.
    """
    if not isinstance(drafter, str):
        base = sys.modules.get("selfspec.drafting.base")  # a Drafter instance means torch is imported
        if base is not None and isinstance(drafter, base.Drafter):
            return
    names = known_drafters()
    if isinstance(drafter, str) and drafter in names:
        return
    close = (
        difflib.get_close_matches(drafter.replace("-", "_"), names, n=1, cutoff=0.6) if isinstance(drafter, str) else []
    )
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigurationError(
        f"unknown drafter {drafter!r}{hint}; choose one of {', '.join(names)} "
        "(a custom drafter: register_drafter() it first)"
    )


# ----------------------------------------------------------------------------- the declaration
def cli(help: str, flag: str, **spec: Any) -> dict[str, OptionSpec]:
    """The metadata of a field that is a flag: its :class:`OptionSpec`.

    The one way a dataclass field declares its flag: :class:`EngineOptions`' fields, and
    :class:`~selfspec.serving.server.settings.ServerLimits`' (``selfspec serve``'s limits).
    """
    return {"option": OptionSpec(help, flag, **spec)}


def declared_flags(options: type) -> list[tuple[str, Any, OptionSpec]]:
    """``(field name, default, spec)`` of every field of the dataclass ``options`` declared with :func:`cli`."""
    return [(f.name, f.default, f.metadata["option"]) for f in fields(options) if "option" in f.metadata]


@dataclass(frozen=True)
class EngineOwnOptions:
    """Every option of :meth:`SpeculativeEngine.from_pretrained <selfspec.SpeculativeEngine.from_pretrained>`.

    Each field is one option, declared once: its type and default here, its help, flag and verbs
    in the field's :class:`OptionSpec` (:func:`option_spec`). The engine's own are declared here;
    each registered drafter's options follow them (:class:`~selfspec.drafting.declaring.DrafterOption`).
    See :class:`~selfspec.SpeculativeEngine` for what each one does.
    """

    # ---- loading the model
    quantization: str | None = field(
        default=None,
        metadata=cli(
            "bitsandbytes quantization: 4bit (NF4) or 8bit (default: none)",
            "--quantization",
            verbs=LOAD_VERBS,
            choices=("4bit", "8bit"),
        ),
    )
    dtype: str | torch.dtype = field(
        default="auto",
        metadata=cli(
            "weights dtype: auto (the checkpoint's half precision where the hardware computes it natively: GPUs, "
            "CPUs with AMX or AVX512-BF16; float32 elsewhere and for quantized GGUF files) or a name such as "
            "float32 or bfloat16",
            "--dtype",
            verbs=LOAD_VERBS,
        ),
    )
    device: str | torch.device = field(
        default="auto",
        metadata=cli(
            "auto (CUDA when available), cpu, cuda, cuda:N or mps", "--device", verbs=LOAD_VERBS, parse=parse_device
        ),
    )
    gguf_file: str | None = field(
        default=None,
        metadata=cli(
            "the .gguf file inside the model's folder (a .gguf path needs none)", "--gguf-file", verbs=LOAD_VERBS
        ),
    )
    trust_remote_code: bool = field(
        default=False,
        metadata=cli("allow checkpoints that ship their own Python code", "--trust-remote-code", verbs=LOAD_VERBS),
    )
    allow_pickle: bool = field(
        default=False,
        metadata=cli("allow .bin (pickle) weights when no safetensors exist", "--allow-pickle", verbs=LOAD_VERBS),
    )
    threads: int | str | None = field(
        default="auto",
        metadata=cli(
            "torch CPU threads: 'auto' (default; on a CPU the fastest of 1..N cores, timed on the plain decode "
            "step at load and re-checked when the machine's load changes: on a busy machine one thread can be "
            "several times faster than all) or N (fixed; selfspec bench: 1)",
            "--threads",
            verbs=LOAD_VERBS,
            parse=parse_threads,
            verb_defaults={"bench": 1},
        ),
    )
    # ---- the drafter and its settings
    drafter: str | Drafter = field(
        default="auto",
        metadata=cli(
            "how drafts are made (default 'auto': the plan calibration measured fastest, plain decoding "
            "when nothing pays; 'early_exit' for models trained for it)",
            "--drafter",
            parse=parse_drafter,
            listed=known_drafters,
        ),
    )
    exit_layer: int | str = field(
        default="auto",
        metadata=cli(
            "the early exit's layer, or 'auto' (with --drafter early_exit or hybrid)",
            "--exit-layer",
            parse=parse_exit_layer,
        ),
    )
    num_draft_tokens: int | str = field(
        default="auto",
        metadata=cli(
            "tokens drafted per round, or 'auto' (calibrated, adapting)",
            "--num-draft-tokens",
            parse=parse_num_draft_tokens,
        ),
    )
    draft_confidence: float | None = field(
        default=None,
        metadata=cli(
            f"with --num-draft-tokens auto: stop drafting below this top probability (default "
            f"{DEFAULT_DRAFT_CONFIDENCE})",
            "--draft-confidence",
            parse=parse_draft_confidence,
        ),
    )
    tree_nodes: int | str | None = field(
        default=None,
        metadata=cli(
            "draft a token tree of at most N nodes (an int), 'auto' (calibrated choice), or 'none' (a chain)",
            "--tree-nodes",
            parse=parse_tree_nodes,
        ),
    )
    # ---- running
    batching: bool = field(
        default=False,
        metadata=cli(
            "decode concurrent calls together in batched rounds (same text per call)",
            "--batching",
            verbs=RUN_VERBS | {"bench"},
        ),
    )
    compile: bool | str = field(
        default="auto",
        metadata=cli(
            "run single calls in the static round (fixed shapes, one host read per round) compiled with "
            "torch.compile: 'auto' (on CUDA), 'on', 'off', or a torch.compile backend name",
            "--compile",
            verbs=RUN_VERBS | {"bench"},
            parse=parse_compile,
        ),
    )
    row_exact: bool | str = field(
        default="auto",
        metadata=cli(
            "give every verify row the bits of a one-token decode, so that the speculative text is the plain "
            "text bit for bit in half precision: on CUDA the plain loop and the verify run through the "
            "row-invariant Triton kernels, on a CPU the verify computes its rows one at a time; 'auto' (where "
            "half precision needs it), 'on', or 'off' (faster library kernels; the text may differ)",
            "--row-exact",
            verbs=RUN_VERBS | {"bench"},
            parse=parse_row_exact,
        ),
    )
    escape_special_tokens: bool = field(
        default=False,
        metadata=cli(
            "encode special-token strings in messages, tools and history as plain text (default: off, "
            "as transformers and vLLM)",
            "--escape-special-tokens",
        ),
    )
    # ---- first-load calibration
    calibrate: bool = field(
        default=True,
        metadata=cli(
            "do not measure a calibration on first load when none is saved ('auto' settings use defaults)",
            "--no-calibrate",
            verbs=RUN_VERBS | {"bench"},
        ),
    )
    calibration_budget: float | None = field(
        default=DEFAULT_CALIBRATION_BUDGET,
        metadata=cli(
            f"seconds (first-load) calibration may take, or 'none': no limit (default "
            f"{DEFAULT_CALIBRATION_BUDGET:.0f}; selfspec calibrate: none)",
            "--calibration-budget",
            verbs=LOAD_VERBS,
            parse=parse_calibration_budget,
            verb_defaults={"calibrate": None},
        ),
    )

    def __post_init__(self) -> None:
        """Every check of the options, once, where they are declared (before any weight is read)."""
        from ..core.validation import check_num_draft_tokens, check_tree_nodes  # torch, once an engine is made

        check_drafter_name(self.drafter)
        if self.exit_layer != "auto" and (isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int)):
            raise ConfigurationError(f"exit_layer must be 'auto' or an int, got {self.exit_layer!r}")
        check_num_draft_tokens(self.num_draft_tokens)  # 'auto' or an int in [1, MAX_DRAFT_TOKENS]
        check_tree_nodes(self.tree_nodes)  # None, 'auto' or an int in [1, MAX_TREE_NODES]
        check_auto_exit_layer(self.drafter, self.exit_layer)  # after the sizes: their bounds say more
        check_draft_confidence(self.draft_confidence)
        check_budget(self.calibration_budget)
        check_threads(self.threads)
        check_compile(self.compile)
        check_row_exact(self.row_exact)
        switches = (
            "trust_remote_code",
            "allow_pickle",
            "batching",
            "escape_special_tokens",
            "calibrate",
        )
        for name in switches:
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for declared in fields(self):
            option: DrafterOption | None = declared.metadata.get("drafter_option")
            if option is not None and option.check is not None:
                option.check(getattr(self, declared.name))

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any:
            """A drafter's option (``options.eagle_head``): a field of the composed class."""

    @classmethod
    def current(cls) -> type[EngineOwnOptions]:
        """The options with every drafter registered now (``EngineOptions`` itself unless one registered since)."""
        return _composed()

    @classmethod
    def of(cls, values: Mapping[str, Any], caller: str = "EngineOptions") -> EngineOwnOptions:
        """:meth:`current` options from keywords, an unknown one named with the closest option.

        Raises:
            TypeError: an unknown option (as Python does for a bad keyword).
            ConfigurationError: a malformed value.
        """
        composed = cls.current()
        refuse_unknown_keywords(caller, values, [f.name for f in fields(composed)])
        return composed(**values)

    @classmethod
    def names(cls) -> list[str]:
        """Every option's name, in declaration order (the engine's, then the drafters')."""
        return [f.name for f in fields(cls.current())]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every option's default."""
        return {f.name: f.default for f in fields(cls.current())}

    @classmethod
    def drafter_options(cls) -> dict[str, DrafterOption]:
        """The options the registered drafters declare, by name."""
        return {f.name: f.metadata["drafter_option"] for f in fields(cls.current()) if "drafter_option" in f.metadata}

    @classmethod
    def for_verb(cls, verb: str) -> list[str]:
        """The options the ``selfspec`` verb ``verb`` takes as flags."""
        return [name for name in cls.names() if verb in option_spec(name).verbs]

    def as_dict(self) -> dict[str, Any]:
        """The options as ``from_pretrained`` keyword arguments (values as given, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _drafter_fields(base: type, options: Iterable[DrafterOption]) -> list[tuple[str, Any, Field[Any]]]:
    """The dataclass fields of drafter options, refusing one that shadows an engine option."""
    own = {f.name for f in fields(base)}
    made: list[tuple[str, Any, Field[Any]]] = []
    for option in options:
        if option.name in own:
            raise ConfigurationError(f"a drafter option may not be named like an engine option: {option.name!r}")
        metadata = {"option": option.spec, "drafter_option": option}
        made.append((option.name, option.annotation, field(default=option.default, metadata=metadata)))
    return made


def _compose(base: type[EngineOwnOptions], options: Iterable[DrafterOption]) -> type[EngineOwnOptions]:
    """``base`` with a field per drafter option."""
    composed = make_dataclass("EngineOptions", _drafter_fields(base, options), bases=(base,), frozen=True)
    composed.__module__, composed.__doc__ = __name__, EngineOwnOptions.__doc__
    return composed


#: The options composed on import: the engine's and the built-in drafters' (declared without torch).
_IMPORTED: type[EngineOwnOptions] = _compose(EngineOwnOptions, declared_options().values())
_LATER: dict[tuple[str, ...], type[EngineOwnOptions]] = {}


def _composed() -> type[EngineOwnOptions]:
    """:data:`_IMPORTED`, or a subclass of it with the options of drafters registered since."""
    imported = {f.name for f in fields(_IMPORTED)}
    declared = declared_options()
    _drafter_fields(EngineOwnOptions, declared.values())  # refuses one named like an engine option
    later = [option for name, option in declared.items() if name not in imported]
    if not later:
        return _IMPORTED
    key = tuple(option.name for option in later)
    if key not in _LATER:
        _LATER[key] = _compose(_IMPORTED, later)
    return _LATER[key]


if TYPE_CHECKING:
    EngineOptions = EngineOwnOptions
else:
    EngineOptions = _IMPORTED


#: Options used only while loading (:func:`selfspec.modeling.loading.load_model_and_tokenizer` and
#: first-load calibration); the rest configure the engine (:class:`~selfspec.SpeculativeEngine`).
LOADING_OPTIONS = frozenset(
    {
        "quantization",
        "dtype",
        "device",
        "gguf_file",
        "trust_remote_code",
        "allow_pickle",
        "threads",
        "calibrate",
        "calibration_budget",
    }
)


def option_spec(name: str) -> OptionSpec:
    """The :class:`OptionSpec` of the engine option ``name`` (an engine's or a registered drafter's)."""
    for declared in fields(EngineOptions.current()):
        if declared.name == name:
            spec: OptionSpec = declared.metadata["option"]
            return spec
    raise KeyError(name)


def adapter_fields(name: str) -> type[Any]:
    """A pydantic model with a field per drafter option declared now, for a framework adapter to inherit.

    Both adapters (``ChatSpeculative``, ``SpeculativeLLM``) derive from it, so a drafter's option is
    a field of each (its default, its text type, its help as the description) without being named
    there. The class is made when the adapter's module is imported: the built-in drafters' options
    are declared by then (without torch); a drafter registered later reaches the adapters through
    their ``drafter_settings`` field, or as a keyword that :func:`drafter_settings_of` moves there.
    """
    from pydantic import Field, create_model

    declared = EngineOptions.drafter_options()
    made: dict[str, Any] = {
        option.name: (option.text_type, Field(default=option.default, description=option.help))
        for option in declared.values()
    }
    made["drafter_settings"] = (
        dict[str, Any],
        Field(
            default_factory=dict,
            description="Options of drafters registered after this class was made, by name (passed to "
            "from_pretrained as keywords; docs/custom_drafter.md).",
        ),
    )
    fields_model: type[Any] = create_model(name, **made)
    return fields_model


def drafter_settings_of(values: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """``values`` with the options of drafters registered after the adapter class moved to ``drafter_settings``."""
    known = set(fields)
    later = [name for name in values if name not in known and name in EngineOptions.drafter_options()]
    if not later:
        return values
    moved = dict(values)
    settings = dict(moved.get("drafter_settings") or {})
    for name in later:
        settings[name] = moved.pop(name)
    moved["drafter_settings"] = settings
    return moved


def engine_settings(options: EngineOptions) -> dict[str, Any]:
    """The options that configure the engine itself (:class:`~selfspec.SpeculativeEngine`'s arguments)."""
    return {name: value for name, value in options.as_dict().items() if name not in LOADING_OPTIONS}


# ----------------------------------------------------------------------------- a call's options
@dataclass
class GenerateOptions:
    """The keyword options of ``generate``, ``generate_ids``, ``stream`` and ``stream_ids``.

    Pass them as keywords (``engine.generate(prompt, max_new_tokens=32)``) or as one value
    (``engine.generate(prompt, options=GenerateOptions(max_new_tokens=32))``; keywords given too
    replace its fields).

    Attributes:
        max_new_tokens: the most new tokens to generate (``>= 1``).
        temperature: 0 for greedy decoding; > 0 samples.
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: nucleus sampling threshold in ``(0, 1]``.
        stop: strings that end the generation; they are not part of the returned text.
        seed: seed of the random generator, for reproducible sampling.
        constraint: restrict the allowed tokens (grammar-constrained decoding).
        truncate_prompt: when the prompt plus ``max_new_tokens`` exceeds the context window, keep
            only the prompt's last tokens instead of raising
            :class:`~selfspec.errors.InvalidPromptError`.
        logprobs: report each new token's log-probability under the model and the ``logprobs``
            most likely alternatives (``0 .. 20``; :attr:`GenerationOutput.logprobs
            <selfspec.GenerationOutput.logprobs>`). The values are the target's ``log_softmax`` in
            the verify forward that emitted the token (no extra forward), before temperature,
            top-k, top-p and a constraint's mask. ``None``: none.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    constraint: TokenConstraint | None = None
    truncate_prompt: bool = False
    logprobs: int | None = None

    @classmethod
    def of(cls, options: GenerateOptions | None, keywords: Mapping[str, Any], method: str) -> GenerateOptions:
        """``options`` (default: the defaults) with ``keywords`` replacing its fields.

        Raises:
            TypeError: an unknown keyword, naming the closest option (as Python does for a bad keyword).
        """
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"{method}() options must be a GenerateOptions, got {type(base).__name__}")
        refuse_unknown_keywords(method, keywords, [f.name for f in fields(cls)])
        return replace(base, **keywords) if keywords else base

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(GenerateOptions)}


class GenerateKeywords(TypedDict, total=False):
    """:class:`GenerateOptions` as keyword arguments, for type checkers and IDEs (PEP 692; a test pins the two)."""

    max_new_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    stop: str | list[str] | None
    seed: int | None
    constraint: TokenConstraint | None
    truncate_prompt: bool
    logprobs: int | None
