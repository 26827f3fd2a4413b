"""How an option is declared: its flag and help (:class:`OptionSpec`), and a drafter's own (:class:`DrafterOption`).

No torch here: the command line, ``--help`` and both framework adapters read these declarations
before any model loads. The engine's own options are the fields of
:class:`~selfspec.decoding.options.EngineOptions`; a drafter declares its options in its
registration (``register_drafter(..., options=(DrafterOption(...),))``), and ``EngineOptions``
is composed from both (``docs/custom_drafter.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError

#: The ``selfspec`` verbs that load an engine and run it as the user configures it.
RUN_VERBS = frozenset({"generate", "chat", "demo", "serve"})
#: Verbs that load a model themselves but configure the engine their own way (their own flags).
LOAD_VERBS = RUN_VERBS | {"calibrate", "bench"}


@dataclass(frozen=True)
class OptionSpec:
    """How an option shows on the command line and in help (the engine's, a drafter's, a server limit).

    Attributes:
        help: one line for ``--help``, the docs and the adapters' field descriptions.
        flag: the command-line flag (``--exit-layer``).
        verbs: the ``selfspec`` verbs that take the flag.
        parse: reads the flag's text (``None``: a switch, or plain text).
        choices: the values the flag accepts (``None``: any that ``parse`` accepts).
        verb_defaults: a verb whose default differs from the option's (``calibrate``'s budget).
        listed: the accepted values listed in ``--help``, read when the parser is built (drafters
            register at run time).
        metavar: the value's name in ``--help`` (``None``: argparse's, or the flag's own).
    """

    help: str
    flag: str
    verbs: frozenset[str] = RUN_VERBS
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    verb_defaults: Mapping[str, Any] = field(default_factory=dict)
    listed: Callable[[], list[str]] | None = None
    metavar: str | None = None


def check_switch(name: str) -> Callable[[Any], None]:
    """A :attr:`DrafterOption.check` that refuses anything but ``True`` and ``False``."""

    def check(value: Any) -> None:
        if not isinstance(value, bool):
            raise ConfigurationError(f"{name} must be True or False, got {value!r}")

    return check


#: ``load(value, loading)``: the engine settings a file option's value becomes when
#: ``from_pretrained`` loads it with the target's loading options (``dtype``, ``device``,
#: ``allow_pickle``, ...): e.g. ``{"draft_model": model, "draft_tokenizer": tokenizer}``.
OptionLoader = Callable[[Any, Mapping[str, Any]], Mapping[str, Any]]


@dataclass(frozen=True)
class DrafterOption:
    """One option a drafter owns, declared once in its registration.

    From it come a field of :class:`~selfspec.decoding.options.EngineOptions` (so a keyword of
    ``from_pretrained``), the flag of every verb in ``verbs`` (``selfspec generate --my-head``,
    ``selfspec serve``), a field of both framework adapters and the value the drafter reads as
    ``engine.config.<name>``.

    Attributes:
        name: the keyword (``"eagle_head"``); unique among every engine and drafter option.
        help: one line for ``--help``, the docs and the adapters' field descriptions.
        flag: the command-line flag (default: ``--`` and the name with dashes).
        default: the value when not given (``None`` for a file option: none, or the drafter's own lookup).
        annotation: the engine's type for the value, as written in the field (``"str | os.PathLike[str] | Any"``).
        text_type: what the adapters' field holds (text only: a path, a hub id or ``"auto"``).
        verbs: the ``selfspec`` verbs that take the flag.
        parse: reads the flag's text (``None``: plain text; a ``bool`` default makes a switch).
        check: refuses a malformed value when the options are declared (raises ``ConfigurationError``).
        load: what ``from_pretrained`` makes of the value with the loading options (a model,
            pickled weights), as engine settings: an :data:`OptionLoader`, or its ``"module:name"``
            (imported when used, so that a torch-free declaration names a loader beside the drafter);
            ``None``: the value is passed as given.
        exclusive: passing it with a drafter that does not declare it is an error (``False``: the
            drafter's own code decides, as the exit adapter's ``"auto"`` does).
        auto: ``drafter="auto"`` takes it too: calibration measures the drafter with it, and a plan
            that chose the drafter builds it with it (a learned head's file).
    """

    name: str
    help: str
    flag: str = ""
    default: Any = None
    annotation: str = "Any"
    text_type: Any = str | None
    verbs: frozenset[str] = RUN_VERBS
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], None] | None = None
    load: OptionLoader | str | None = None
    exclusive: bool = True
    auto: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a drafter option's name must be an identifier, got {self.name!r}")
        if not self.flag:
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))

    @property
    def spec(self) -> OptionSpec:
        """Its flag and help, as the engine's own options declare theirs."""
        return OptionSpec(self.help, self.flag, self.verbs, self.parse)

    def loader(self) -> OptionLoader | None:
        """:attr:`load`, imported when named by ``"module:name"``."""
        if not isinstance(self.load, str):
            return self.load
        import importlib

        module, _, name = self.load.partition(":")
        loader: OptionLoader = getattr(importlib.import_module(module), name)
        return loader

    def given(self, value: Any) -> bool:
        """Whether ``value`` asks for something (anything but the default)."""
        return value is not self.default and value != self.default
