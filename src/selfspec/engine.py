"""The speculative decoding engine: one loop, three roles.

Each round (``../DESIGN.md``):

1. the drafter proposes up to ``k`` tokens (:mod:`selfspec.drafters`);
2. the target verifies them in one forward, continuing from the exit layer's states when the
   draft came from the target's own early layers;
3. acceptance keeps a prefix of the draft plus one recovered or bonus token
   (:mod:`selfspec.verify`);
4. every layer of the KV cache is rolled back to exactly the accepted text.

Plain decoding is the same loop with no draft (``drafter="none"``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch

from .adapter import ModelAdapter
from .adaptive import DraftController
from .batching import BatchScheduler
from .calibration import load_calibration
from .constraints import TokenConstraint, apply_mask
from .drafters import (
    DecodeState,
    Draft,
    Drafter,
    DraftModelDrafter,
    EarlyExitDrafter,
    HybridDrafter,
    LayerSkipDrafter,
    NoDrafter,
    PromptLookupDrafter,
    choose_token,
    default_skip_layers,
)
from .errors import ConfigurationError, GenerationMemoryError, InvalidPromptError, SamplingError
from .exit_adapter import ExitAdapter, engine_exit_adapter
from .medusa import MedusaDrafter, MedusaHeads, find_medusa_heads, load_medusa_heads
from .outputs import FinishReason, GenerationOutput, GenerationStats
from .sampling import SamplingParams, logits_to_probs
from .stopping import IncrementalDetokenizer, StopStringMatcher, normalize_stop
from .tree import TreeAcceptance, accept_tree_greedy, accept_tree_sampled, check_tree, tree_depths
from .tree_draft import keep_accepted_path, select_nodes, tree_to_chain, truncate_tree, verify_tree
from .verify import Acceptance, accept_greedy, accept_sampled

#: Drafters that draft token trees with ``tree_nodes``.
TREE_DRAFTERS = ("early_exit", "hybrid", "medusa")

#: Drafters selectable by name.
DRAFTERS = ("early_exit", "prompt_lookup", "hybrid", "layer_skip", "draft_model", "medusa", "none")
#: Draft length used when ``num_draft_tokens="auto"`` finds no calibration.
DEFAULT_NUM_DRAFT_TOKENS = 4
#: With ``num_draft_tokens="auto"``, the early exit stops drafting below this top probability.
DEFAULT_DRAFT_CONFIDENCE = 0.3
#: Node budget used when ``tree_nodes="auto"`` finds no calibration (``None``: a chain).
DEFAULT_TREE_NODES: int | None = None

Prompt = str | Sequence[dict[str, Any]]


def default_exit_layer(num_layers: int) -> int:
    """The exit layer used when ``exit_layer="auto"`` finds no calibration: ``L // 4``."""
    return max(1, num_layers // 4)


class SpeculativeEngine:
    """Lossless self-speculative decoding around a transformers causal LM.

    The model drafts tokens with its own first ``exit_layer`` layers (shared final norm and
    LM head) and verifies the whole draft in one forward of the remaining layers. Greedy
    output is token-identical to ``model.generate(do_sample=False)``; sampled output follows
    the model's own distribution exactly.

    Args:
        model: a loaded transformers ``*ForCausalLM`` of a supported architecture.
        tokenizer: its tokenizer; optional for token-level use (:meth:`generate_ids`).
        exit_layer: layers the draft runs, ``1 .. num_layers - 1``; ``"auto"`` uses the
            saved calibration, else ``num_layers // 4``.
        num_draft_tokens: tokens drafted per round, ``>= 1``; ``"auto"`` uses the saved
            calibration, else 4.
        drafter: ``"early_exit"`` (default), ``"prompt_lookup"`` (copy n-grams from the
            prompt and output), ``"hybrid"`` (lookup when a match exists, else early exit),
            ``"layer_skip"`` (a subset of the layers: calibrated, else
            :func:`~selfspec.drafters.default_skip_layers`), ``"draft_model"`` (a separate
            small model, see ``draft_model``), ``"medusa"`` (Medusa heads on the last
            hidden state, see ``medusa_heads``), ``"none"`` (plain decoding), or a
            :class:`~selfspec.drafters.Drafter` instance.
        draft_confidence: with ``num_draft_tokens="auto"``, the early exit stops drafting
            when its top probability falls below this (default 0.3); ignored for a fixed
            draft length. With ``"auto"`` the draft length also adapts to recent
            acceptance, and speculation pauses while it is measured slower than plain
            decoding.
        calibration: measured settings to use instead of the saved ``selfspec.json``
            (the ``"exit_layer"`` and ``"num_draft_tokens"`` keys are read).
        draft_model: with ``drafter="draft_model"``, the loaded draft model (sharing the
            target's tokenizer); :meth:`from_pretrained` also takes a name.
        draft_tokenizer: the draft model's tokenizer, checked against the target's.
        exit_adapter: a trained :class:`~selfspec.exit_adapter.ExitAdapter` for the early-exit
            and hybrid drafters (``selfspec train-adapter``): a folder, a loaded adapter,
            ``"auto"`` (the one saved beside the model, if any) or ``None`` (default: none).
            It changes the drafts only, never the text. With ``exit_layer="auto"`` the
            adapter's exit layer is used; an explicit, different ``exit_layer`` is an error
            (with ``"auto"``, the saved adapter is then left out).
        medusa_heads: with ``drafter="medusa"``, a folder of heads in the published Medusa
            layout (``config.json`` + ``medusa_lm_head.safetensors``) or loaded
            :class:`~selfspec.medusa.MedusaHeads`; ``None`` uses the heads saved beside the
            model (the demo model ships some; ``selfspec train-medusa`` trains them).
        tree_nodes: ``None`` (default) drafts a chain; an int ``N >= 1`` makes the early-exit
            drafter (also inside ``"hybrid"``) draft a token tree of at most ``N`` nodes and at
            most ``num_draft_tokens`` levels, verified in one forward
            (``docs/trees.md``); ``"auto"`` uses the calibrated choice (chain or tree, and
            the node budget), else :data:`DEFAULT_TREE_NODES`. With ``drafter="medusa"`` the
            heads' candidates are verified as a tree of at most ``N`` nodes (``"auto"``:
            :data:`DEFAULT_TREE_NODES`).
        batching: decode concurrent calls together: a background thread runs each round
            for all active generations in the same forwards, each keeping its own text
            (see :mod:`selfspec.batching`; generations with a constraint, or a drafter
            without a batched path, run unbatched).

    Example:
        >>> from selfspec import SpeculativeEngine
        >>> engine = SpeculativeEngine.from_pretrained("selfspec-demo")
        >>> out = engine.generate("It is a truth universally acknowledged", max_new_tokens=16)
        >>> out.finish_reason
        'length'
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        exit_layer: int | str = "auto",
        num_draft_tokens: int | str = "auto",
        drafter: str | Drafter = "early_exit",
        draft_confidence: float | None = None,
        calibration: dict[str, Any] | None = None,
        draft_model: Any = None,
        draft_tokenizer: Any = None,
        exit_adapter: str | os.PathLike[str] | ExitAdapter | None = None,
        medusa_heads: str | os.PathLike[str] | MedusaHeads | None = None,
        tree_nodes: int | str | None = None,
        batching: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(model)
        model.eval()
        self.name_or_path: str = str(getattr(model.config, "_name_or_path", "") or "")
        self.calibration = calibration if calibration is not None else (load_calibration(self.name_or_path) or {})
        self.exit_adapter = engine_exit_adapter(exit_adapter, self.adapter, self.name_or_path, exit_layer, drafter)
        if self.exit_adapter is not None:
            exit_layer = self.exit_adapter.exit_layer  # the layer the adapter was trained for
        self.exit_layer = self._resolve_exit_layer(exit_layer)
        self.num_draft_tokens = self._resolve_num_draft_tokens(num_draft_tokens)
        self.adaptive = num_draft_tokens == "auto"
        if draft_confidence is not None and not 0.0 <= draft_confidence < 1.0:
            raise ConfigurationError(f"draft_confidence must be in [0, 1), got {draft_confidence!r}")
        self.draft_confidence = (
            (DEFAULT_DRAFT_CONFIDENCE if draft_confidence is None else draft_confidence) if self.adaptive else 0.0
        )
        self.tree_nodes = self._resolve_tree_nodes(tree_nodes, drafter)
        self.draft_model = draft_model
        self._check_draft_model(drafter, draft_model, draft_tokenizer)
        if medusa_heads is not None and drafter != "medusa":
            raise ConfigurationError("medusa_heads= is only used with drafter='medusa'")
        self.medusa_heads = medusa_heads
        self.drafter = self._make_drafter(drafter)
        self.controller = DraftController(self.num_draft_tokens, adaptive=self.adaptive)
        self.eos_token_ids = self._eos_token_ids()
        self._lock = threading.RLock()
        if not isinstance(batching, bool):
            raise ConfigurationError(f"batching must be True or False, got {batching!r}")
        self.batching = batching
        self._batcher = BatchScheduler(self) if batching else None

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
        drafter: str | Drafter = "early_exit",
        draft_confidence: float | None = None,
        trust_remote_code: bool = False,
        allow_pickle: bool = False,
        calibrate: bool = True,
        draft_model: Any = None,
        exit_adapter: str | os.PathLike[str] | ExitAdapter | None = None,
        medusa_heads: str | os.PathLike[str] | MedusaHeads | None = None,
        tree_nodes: int | str | None = None,
        batching: bool = False,
    ) -> SpeculativeEngine:
        """Load a model from the hub, a local folder, or ``"selfspec-demo"``.

        Args:
            name_or_path: a hub id, a local folder with ``config.json`` and safetensors
                weights, or ``"selfspec-demo"`` (the small model bundled with the package).
            quantization: ``None``, ``"4bit"`` (bitsandbytes NF4) or ``"8bit"``.
            dtype: ``"auto"`` (float32 on CPU, the checkpoint's half precision on GPU),
                a name such as ``"bfloat16"``, or a ``torch.dtype``.
            device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:N]"``.
            exit_layer: see :class:`SpeculativeEngine`.
            num_draft_tokens: see :class:`SpeculativeEngine`.
            drafter: see :class:`SpeculativeEngine`.
            draft_confidence: see :class:`SpeculativeEngine`.
            trust_remote_code: allow checkpoints that ship their own Python code.
            allow_pickle: allow ``.bin`` (pickle) weights when no safetensors exist.
            draft_model: with ``drafter="draft_model"``: a loaded model, or a name or folder
                loaded like the target (same quantization, dtype and device).
            exit_adapter: see :class:`SpeculativeEngine`.
            tree_nodes: see :class:`SpeculativeEngine`.
            calibrate: when ``exit_layer`` or ``num_draft_tokens`` is ``"auto"`` and the
                model has no saved calibration, measure one now (a few seconds, with a
                progress bar) and save it beside the model or in the user cache.
            medusa_heads: with ``drafter="medusa"``: see :class:`SpeculativeEngine` (a
                ``medusa_lm_head.pt`` pickle loads only with ``allow_pickle=True``).
            batching: see :class:`SpeculativeEngine`.

        Raises:
            ModelNotFoundError: no such folder or hub model (an ``OSError``).
            UnsupportedArchitectureError: the architecture has no adapter.
            QuantizationError: the requested quantization cannot run here.
        """
        from .loading import load_model_and_tokenizer

        cls._check_engine_args(exit_layer, num_draft_tokens, drafter)
        cls._check_tree_nodes(tree_nodes)
        model, tokenizer, path = load_model_and_tokenizer(
            name_or_path,
            quantization=quantization,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
            allow_pickle=allow_pickle,
        )
        model.config._name_or_path = path
        draft_tokenizer = None
        if isinstance(draft_model, (str, os.PathLike)):
            draft_model, draft_tokenizer, _ = load_model_and_tokenizer(
                draft_model,
                quantization=quantization,
                dtype=dtype,
                device=device,
                trust_remote_code=trust_remote_code,
                allow_pickle=allow_pickle,
            )
        if drafter == "medusa" and allow_pickle and isinstance(medusa_heads, (str, os.PathLike)):
            medusa_heads = load_medusa_heads(medusa_heads, allow_pickle=True)
        engine_kwargs: dict[str, Any] = {
            "exit_layer": exit_layer,
            "num_draft_tokens": num_draft_tokens,
            "drafter": drafter,
            "draft_confidence": draft_confidence,
            "draft_model": draft_model,
            "draft_tokenizer": draft_tokenizer,
            "exit_adapter": exit_adapter,
            "medusa_heads": medusa_heads,
            "tree_nodes": tree_nodes,
            "batching": batching,
        }
        engine = cls(model, tokenizer, **engine_kwargs)
        wants_auto = "auto" in (exit_layer, num_draft_tokens, tree_nodes) and drafter in ("early_exit", "hybrid")
        if calibrate and wants_auto and not engine.calibration:
            from .calibrate import calibrate as run_calibration

            trees = tree_nodes == "auto"
            measured = run_calibration(engine, max_new_tokens=32, max_draft_tokens=6, trees=trees)
            engine = cls(model, tokenizer, calibration=measured.to_json(), **engine_kwargs)
        return engine

    @staticmethod
    def _check_engine_args(exit_layer: Any, num_draft_tokens: Any, drafter: Any) -> None:
        """Reject malformed engine arguments before any weights are loaded."""
        if exit_layer != "auto" and (isinstance(exit_layer, bool) or not isinstance(exit_layer, int)):
            raise ConfigurationError(f"exit_layer must be 'auto' or an int, got {exit_layer!r}")
        if num_draft_tokens != "auto" and (
            isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1
        ):
            raise ConfigurationError(f"num_draft_tokens must be 'auto' or an int >= 1, got {num_draft_tokens!r}")
        if not isinstance(drafter, Drafter) and drafter not in DRAFTERS:
            raise ConfigurationError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")

    @staticmethod
    def _check_tree_nodes(tree_nodes: Any) -> None:
        if tree_nodes is None or tree_nodes == "auto":
            return
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
            raise ConfigurationError(f"tree_nodes must be None, 'auto' or an int >= 1, got {tree_nodes!r}")

    def _resolve_tree_nodes(self, tree_nodes: int | str | None, drafter: str | Drafter) -> int | None:
        self._check_tree_nodes(tree_nodes)
        if tree_nodes == "auto":
            if drafter == "medusa":
                return DEFAULT_TREE_NODES  # Medusa's candidate tree (calibration races the early exit's)
            if drafter not in ("early_exit", "hybrid"):
                return None  # only the early exit and Medusa draft trees
            saved = self.calibration.get("tree_nodes", DEFAULT_TREE_NODES)
            return saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1 else None
        assert tree_nodes is None or isinstance(tree_nodes, int)
        return tree_nodes

    def _resolve_exit_layer(self, exit_layer: int | str) -> int:
        self._check_engine_args(exit_layer, "auto", "none")
        num_layers = self.adapter.num_layers
        if exit_layer == "auto":
            saved = self.calibration.get("exit_layer")
            if isinstance(saved, int) and 1 <= saved < num_layers:
                return saved
            return default_exit_layer(num_layers)
        assert isinstance(exit_layer, int)
        if not 1 <= exit_layer <= num_layers - 1:
            raise ConfigurationError(
                f"exit_layer must be in [1, {num_layers - 1}] for this {num_layers}-layer model, got {exit_layer}"
            )
        return exit_layer

    def _resolve_num_draft_tokens(self, num_draft_tokens: int | str) -> int:
        self._check_engine_args("auto", num_draft_tokens, "none")
        if num_draft_tokens == "auto":
            saved = self.calibration.get("num_draft_tokens")
            return saved if isinstance(saved, int) and saved >= 1 else DEFAULT_NUM_DRAFT_TOKENS
        assert isinstance(num_draft_tokens, int)
        return num_draft_tokens

    def _make_drafter(self, drafter: str | Drafter) -> Drafter:
        self._check_engine_args("auto", "auto", drafter)
        if self.tree_nodes is not None and (isinstance(drafter, Drafter) or drafter not in TREE_DRAFTERS):
            name = drafter.name if isinstance(drafter, Drafter) else drafter
            raise ConfigurationError(
                f"tree_nodes drafts trees with the early_exit, hybrid and medusa drafters, not {name!r}; "
                "a Drafter instance returns trees through Draft.parents itself"
            )
        if isinstance(drafter, Drafter):
            return drafter
        if drafter == "none":
            return NoDrafter()
        if drafter == "prompt_lookup":
            return PromptLookupDrafter()
        if drafter == "hybrid":
            agreement = (self.calibration.get("agreement") or {}).get(str(self.exit_layer))
            hybrid = HybridDrafter(
                self.exit_layer,
                exit_agreement=float(agreement) if isinstance(agreement, (int, float)) else 0.6,
                confidence=self.draft_confidence,
                exit_adapter=self.exit_adapter,
            )
            hybrid.early_exit.tree_nodes = self.tree_nodes  # lookup drafts chains, the early exit trees
            return hybrid
        if drafter == "draft_model":
            return DraftModelDrafter(self.draft_model, self.adapter.vocab_size)
        if drafter == "medusa":
            heads = self._medusa_heads()
            if self.tree_nodes is None:
                return MedusaDrafter(heads)
            return MedusaDrafter(heads, tree=True, tree_nodes=self.tree_nodes)
        if drafter == "layer_skip":
            saved = self.calibration.get("layer_skip_layers")
            layers = default_skip_layers(self.adapter.num_layers)
            if isinstance(saved, list) and saved and all(isinstance(i, int) for i in saved):
                layers = [i for i in saved if 0 <= i < self.adapter.num_layers] or layers
            return LayerSkipDrafter(layers)
        return EarlyExitDrafter(
            self.exit_layer,
            confidence=self.draft_confidence,
            exit_adapter=self.exit_adapter,
            tree_nodes=self.tree_nodes,
        )

    def _medusa_heads(self) -> MedusaHeads:
        """The heads for ``drafter="medusa"``, on the model's device and dtype, checked against it."""
        heads = self.medusa_heads
        if heads is None:
            heads = find_medusa_heads(self.name_or_path)
            if heads is None:
                raise ConfigurationError(
                    "drafter='medusa' needs medusa_heads= a folder of Medusa heads (config.json + "
                    "medusa_lm_head.safetensors); none are saved beside this model (in its medusa/ "
                    "subfolder). Train some with `selfspec train-medusa --model M`."
                )
        hidden = int(self.model.config.hidden_size)
        if isinstance(heads, MedusaHeads):
            if heads.hidden_size != hidden or heads.vocab_size != self.adapter.vocab_size:
                raise ConfigurationError(
                    f"{heads!r} does not fit this model (hidden size {hidden}, vocab {self.adapter.vocab_size})"
                )
            return heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        return load_medusa_heads(
            heads,
            hidden_size=hidden,
            vocab_size=self.adapter.vocab_size,
            dtype=self.adapter.dtype,
            device=self.adapter.device,
        )

    def _check_draft_model(self, drafter: Any, draft_model: Any, draft_tokenizer: Any) -> None:
        if drafter != "draft_model":
            if draft_model is not None:
                raise ConfigurationError("draft_model= is only used with drafter='draft_model'")
            return
        if draft_model is None or isinstance(draft_model, (str, os.PathLike)):
            raise ConfigurationError(
                "drafter='draft_model' needs draft_model= a loaded model (from_pretrained also takes a name)"
            )
        if self.tokenizer is not None and draft_tokenizer is not None:
            same = self.tokenizer.get_vocab() == draft_tokenizer.get_vocab()
        else:
            same = int(draft_model.config.vocab_size) == self.adapter.vocab_size
        if not same:
            raise ConfigurationError(
                "the draft model's vocabulary differs from the target's; a draft model must share "
                "the target's tokenizer"
            )
        draft_device = draft_model.get_input_embeddings().weight.device
        if draft_device != self.adapter.device:
            raise ConfigurationError(f"the draft model is on {draft_device}, the target on {self.adapter.device}")

    def _eos_token_ids(self) -> set[int]:
        eos: Any = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}

    def __repr__(self) -> str:
        return (
            f"SpeculativeEngine(model={self.name_or_path or type(self.model).__name__!r}, "
            f"drafter={self.drafter!r}, exit_layer={self.exit_layer}, "
            f"num_draft_tokens={self.num_draft_tokens}{' (adaptive)' if self.adaptive else ''}, "
            f"{f'tree_nodes={self.tree_nodes}, ' if self.tree_nodes else ''}"
            f"num_layers={self.adapter.num_layers}, {'batching=True, ' if self.batching else ''}"
            f"device={str(self.adapter.device)!r}, dtype={str(self.adapter.dtype)!r})"
        )

    # ----------------------------------------------------------------- prompts
    @property
    def context_window(self) -> int | None:
        """The model's maximum number of positions (prompt plus new tokens)."""
        return self.adapter.max_positions

    def encode_prompt(self, prompt: Prompt, *, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt.

        A ``str`` is encoded as ``tokenizer(prompt)`` (default special tokens, no template);
        a list of ``{"role": ..., "content": ...}`` messages goes through the tokenizer's chat
        template with the generation prompt (and ``tools``, when given).
        """
        tokenizer = self._require_tokenizer("text prompts")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPromptError("the prompt is empty; pass some text")
            return list(tokenizer(prompt)["input_ids"])
        if not isinstance(prompt, Sequence) or not prompt:
            raise InvalidPromptError("the prompt must be a non-empty string or a non-empty list of chat messages")
        for message in prompt:
            if not isinstance(message, dict) or "role" not in message:
                raise InvalidPromptError(f"each chat message must be a dict with 'role' and 'content', got {message!r}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidPromptError("this tokenizer has no chat template; pass a plain string prompt")
        text = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ConfigurationError(
                f"{what} need a tokenizer: pass tokenizer= to SpeculativeEngine, or use generate_ids"
            )
        return self.tokenizer

    # ----------------------------------------------------------------- public API
    def generate(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        constraint: TokenConstraint | None = None,
        truncate_prompt: bool = False,
    ) -> GenerationOutput:
        """Generate text for a prompt.

        Args:
            prompt: text, or a list of chat messages (rendered by the chat template).
            max_new_tokens: the most new tokens to generate (``>= 1``).
            temperature: 0 for greedy decoding; > 0 samples.
            top_k: sample only among the ``top_k`` most likely tokens.
            top_p: nucleus sampling threshold in ``(0, 1]``.
            stop: strings that end the generation; they are not part of the returned text.
            seed: seed of the random generator, for reproducible sampling.
            constraint: restrict the allowed tokens (grammar-constrained decoding).
            truncate_prompt: when the prompt plus ``max_new_tokens`` exceeds the context
                window, keep only the prompt's last tokens instead of raising
                :class:`~selfspec.errors.InvalidPromptError`.

        Returns:
            The text, new token ids, finish reason and speculation statistics.
        """
        return self.generate_ids(
            self.encode_prompt(prompt),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=stop,
            seed=seed,
            constraint=constraint,
            truncate_prompt=truncate_prompt,
        )

    def generate_ids(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        constraint: TokenConstraint | None = None,
        truncate_prompt: bool = False,
    ) -> GenerationOutput:
        """Like :meth:`generate`, from token ids (no tokenizer needed unless ``stop`` is given)."""
        run = self._start(
            prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, constraint, truncate_prompt
        )
        for _ in run.deltas():
            pass
        return run.output()

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        constraint: TokenConstraint | None = None,
        truncate_prompt: bool = False,
    ) -> GenerationStream:
        """Stream the text of :meth:`generate` as ``str`` deltas.

        The deltas join to exactly ``generate(...).text``. Call ``.close()`` to abandon the
        stream early; ``.stats`` and ``.output`` are set once it is exhausted or closed.
        """
        return self.stream_ids(
            self.encode_prompt(prompt),
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop=stop,
            seed=seed,
            constraint=constraint,
            truncate_prompt=truncate_prompt,
        )

    def stream_ids(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        constraint: TokenConstraint | None = None,
        truncate_prompt: bool = False,
    ) -> GenerationStream:
        """Like :meth:`stream`, from token ids (a tokenizer is needed to produce text)."""
        self._require_tokenizer("streams")
        run = self._start(
            prompt_ids, max_new_tokens, temperature, top_k, top_p, stop, seed, constraint, truncate_prompt
        )
        return GenerationStream(run)

    # ----------------------------------------------------------------- the loop
    def _start(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        stop: str | list[str] | None,
        seed: int | None,
        constraint: TokenConstraint | None,
        truncate_prompt: bool = False,
    ) -> _Generation:
        """Validate every argument, then set up a generation (nothing runs yet)."""
        ids = self._check_prompt_ids(prompt_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        stops = normalize_stop(stop)
        if stops:
            self._require_tokenizer("stop strings")
        window = self.context_window
        if window is not None and len(ids) + max_new_tokens > window:
            keep = window - max_new_tokens
            if truncate_prompt and keep >= 1:
                ids = ids[-keep:]  # left truncation: keep the end of the prompt, nearest the answer
            else:
                hint = "" if truncate_prompt else " (or pass truncate_prompt=True to keep only its end)"
                raise InvalidPromptError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                    f"context window of {window} tokens; shorten the prompt or lower max_new_tokens{hint}"
                )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise SamplingError(f"seed must be an int or None, got {seed!r}")
        generator = torch.Generator(device=self.adapter.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return _Generation(self, ids, max_new_tokens, params, stops, generator, constraint)

    def _check_prompt_ids(self, prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
                prompt_ids = prompt_ids[0]
            if prompt_ids.dim() != 1:
                raise InvalidPromptError(f"prompt_ids must be 1-D (or [1, n]); got shape {tuple(prompt_ids.shape)}")
            ids = [int(i) for i in prompt_ids.tolist()]
        else:
            ids = list(prompt_ids)
        if not ids:
            raise InvalidPromptError("the prompt is empty: pass at least one token")
        vocab = self.adapter.vocab_size
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidPromptError(f"token id {token!r} is not in the vocabulary [0, {vocab})")
        return ids

    def _rounds(self, run: _Generation) -> Generator[list[int], None, FinishReason]:
        """Decode, yielding the tokens each round emits; return the finish reason.

        The engine lock is held for each round's computation, never across a ``yield``, so
        an abandoned stream cannot block other callers. All state lives in ``run``: calls
        from several threads each get the text they would get alone. With ``batching=True``
        the rounds run in the engine's :class:`~selfspec.batching.BatchScheduler` instead.
        """
        if self._batcher is not None and self._batcher.accepts(run):
            return (yield from self._batcher.rounds(run))
        adapter, stats, params = self.adapter, run.stats, run.params
        prompt_len = len(run.prompt_ids)
        with self._lock, torch.inference_mode():
            started = time.perf_counter()
            # a tree drafter's nodes need slots beyond the text (a drafter may say how many)
            tree_slots = self.tree_nodes or getattr(self.drafter, "tree_nodes", None) or 0
            cache = adapter.new_cache(prompt_len + run.max_new_tokens + tree_slots)
            ids = torch.tensor([run.prompt_ids], device=adapter.device)
            hidden = adapter.run_layers(
                adapter.embed(ids), 0, adapter.num_layers, torch.arange(prompt_len, device=adapter.device), cache
            )
            logits = adapter.logits(hidden[:, -1:])[0]
            first, _ = choose_token(logits, params, run.generator, run.constraint)
            stats.target_forwards += 1
            stats.verify_seconds += time.perf_counter() - started
        if run.constraint is not None:
            run.constraint.advance(first)
        state = DecodeState(
            adapter=adapter,
            cache=cache,
            position=prompt_len,
            last_token=first,
            token_ids=[*run.prompt_ids, first],
            params=params,
            generator=run.generator,
            constraint=run.constraint,
            eos_token_ids=frozenset(self.eos_token_ids),
            last_hidden=hidden[:, -1:] if self.drafter.needs_hidden else None,
        )
        emitted = 1
        yield [first]
        if first in self.eos_token_ids:
            return "stop"
        while emitted < run.max_new_tokens:
            with self._lock, torch.inference_mode():
                tokens = self._round(state, run, run.max_new_tokens - emitted)
            emitted += len(tokens)
            yield tokens
            if tokens[-1] in self.eos_token_ids:
                return "stop"
        return "length"

    def _round(self, state: DecodeState, run: _Generation, remaining: int) -> list[int]:
        """One draft-verify-accept round; returns the emitted tokens (eos-truncated)."""
        stats, drafter = run.stats, self.drafter
        max_draft = min(self._draft_budget(run.controller), remaining - 1)
        started = time.perf_counter()
        draft = drafter.propose(state, max_draft) if max_draft > 0 else Draft()
        if draft.parents is not None:  # a token tree (selfspec.tree)
            check_tree(draft.tokens, draft.parents)
            draft = truncate_tree(state, draft, max_draft)
            room = state.cache.max_length - state.position - 1
            if len(draft) > room:  # a topological prefix is a tree: keep what the cache holds
                draft = select_nodes(state, draft, list(range(room)))
            if state.constraint is not None:
                draft = tree_to_chain(state, draft)
        draft = self._truncate_draft(draft, max_draft)
        drafted_at = time.perf_counter()
        stats.draft_seconds += drafted_at - started

        acceptance: Acceptance | TreeAcceptance
        if draft.parents is not None:
            target_logits = verify_tree(state, draft)  # [n + 1, vocab]
            acceptance = self._accept_tree(state, draft, target_logits, run.generator)
            keep_accepted_path(state, acceptance.path)
            if state.last_hidden is not None:  # verify_tree kept [1, n + 1, hidden]: the last accepted node's
                row = acceptance.path[-1] + 1 if acceptance.path else 0
                state.last_hidden = state.last_hidden[:, row : row + 1]
            depth = max(tree_depths(draft.parents), default=0)  # what the controller budgets
        else:
            target_logits = self._verify(state, draft)  # [k + 1, vocab]
            masks = self._constraint_masks(state, draft)
            if masks is not None:
                draft = self._truncate_draft(draft, len(masks) - 1)
                target_logits = apply_mask(target_logits[: len(masks)], torch.stack(masks))
            acceptance = self._accept(state, draft, target_logits, run.generator)
            depth = len(draft)
        stats.verify_seconds += time.perf_counter() - drafted_at
        stats.target_forwards += 1

        num_drafted = len(draft)
        drafter.observe(num_drafted, acceptance.num_accepted)
        seconds = time.perf_counter() - started
        run.controller.record(depth, acceptance.num_accepted, acceptance.num_accepted + 1, seconds)
        stats.num_drafted += num_drafted
        stats.num_accepted += acceptance.num_accepted
        histogram = stats.accepted_length_histogram
        histogram.extend([0] * (acceptance.num_accepted + 1 - len(histogram)))
        histogram[acceptance.num_accepted] += 1

        tokens = acceptance.emitted(draft.tokens)
        if state.last_hidden is not None and draft.parents is None:  # _verify kept [1, k + 1, hidden]
            state.last_hidden = state.last_hidden[:, acceptance.num_accepted : acceptance.num_accepted + 1]
        # roll every layer back to the accepted text: last_token + accepted drafts
        state.cache.crop_to(state.position + acceptance.num_accepted + 1)
        state.position += acceptance.num_accepted + 1
        tokens = tokens[:remaining]
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens = tokens[: i + 1]
                break
        state.last_token = tokens[-1]
        state.token_ids.extend(tokens)
        if state.constraint is not None:
            for token in tokens:
                state.constraint.advance(token)
        return tokens

    def _draft_budget(self, controller: DraftController) -> int:
        return 0 if isinstance(self.drafter, NoDrafter) else controller.budget()

    @staticmethod
    def _truncate_draft(draft: Draft, length: int) -> Draft:
        if len(draft) <= length or draft.parents is not None:  # trees: truncate_tree
            return draft
        return Draft(
            tokens=draft.tokens[:length],
            draft_probs=None if draft.draft_probs is None else draft.draft_probs[:length],
            exit_states=draft.exit_states,  # the verifier uses only the first `length` states
            exit_layer=draft.exit_layer,
        )

    def _verify(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """Target logits ``[k + 1, vocab]`` for ``last_token`` and every draft token."""
        adapter, cache, device = state.adapter, state.cache, state.adapter.device
        num_draft = len(draft)
        positions = torch.arange(state.position, state.position + num_draft + 1, device=device)
        if draft.exit_states is not None and num_draft > 0:
            # the drafter ran layers [0, E) on last_token and drafts 1..k-1; finish the last one
            exit_layer = draft.exit_layer
            # drop shallow-layer KV of drafts beyond a truncation
            cache.crop_to(state.position + num_draft, range(exit_layer))
            last = torch.tensor([[draft.tokens[-1]]], device=device)
            last_state = adapter.run_layers(adapter.embed(last), 0, exit_layer, positions[-1:], cache)
            exit_states = torch.cat([draft.exit_states[:, :num_draft], last_state], dim=1)
            hidden = adapter.run_layers(exit_states, exit_layer, adapter.num_layers, positions, cache)
        else:
            ids = torch.tensor([[state.last_token, *draft.tokens]], device=device)
            hidden = adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, positions, cache)
        if self.drafter.needs_hidden:
            state.last_hidden = hidden
        return adapter.logits(hidden)

    @staticmethod
    def _constraint_masks(state: DecodeState, draft: Draft) -> list[torch.Tensor] | None:
        """The constraint's allowed-token masks at each verified position (``None``: no constraint).

        Walks the draft through the constraint and stops at the first forbidden token (the
        draft is cut there), then rolls the constraint back.
        """
        constraint = state.constraint
        if constraint is None:
            return None
        masks: list[torch.Tensor] = []
        consumed = 0
        for token in draft.tokens:
            allowed = constraint.allowed_tokens()
            masks.append(allowed)
            if token >= allowed.shape[-1] or not bool(allowed[token]):
                break
            constraint.advance(token)
            consumed += 1
        else:
            masks.append(constraint.allowed_tokens())
        constraint.rollback(consumed)
        return masks

    @staticmethod
    def _accept(
        state: DecodeState, draft: Draft, target_logits: torch.Tensor, generator: torch.Generator
    ) -> Acceptance:
        device = target_logits.device
        draft_tokens = torch.tensor(draft.tokens, dtype=torch.long, device=device)
        if state.params.greedy:
            return accept_greedy(draft_tokens, target_logits)
        target_probs = logits_to_probs(target_logits, state.params)
        return accept_sampled(draft_tokens, draft.draft_probs, target_probs, generator)

    @staticmethod
    def _accept_tree(
        state: DecodeState, draft: Draft, target_logits: torch.Tensor, generator: torch.Generator
    ) -> TreeAcceptance:
        assert draft.parents is not None
        if state.params.greedy:
            return accept_tree_greedy(draft.tokens, draft.parents, target_logits)
        target_probs = logits_to_probs(target_logits, state.params)
        return accept_tree_sampled(draft.tokens, draft.parents, draft.draft_probs, target_probs, generator)


def _is_out_of_memory(error: BaseException) -> bool:
    """Whether an exception is an allocation failure (CUDA, or the CPU allocator)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error)
    return "can't allocate memory" in message or "out of memory" in message.lower()


class _Generation:
    """One generation's state: tokens so far, text tracking, stop strings, statistics."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        stops: list[str],
        generator: torch.Generator,
        constraint: TokenConstraint | None,
    ) -> None:
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.params = params
        self.generator = generator
        self.constraint = constraint
        self.stats = GenerationStats()
        # greedy text never depends on draft lengths: share the engine's timed controller;
        # sampled text does (through the random stream): a per-call, untimed one
        self.controller = engine.controller if params.greedy else engine.controller.for_sampling()
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: FinishReason | None = None
        tokenizer = engine.tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_matcher = StopStringMatcher(stops)
        self._started = 0.0
        self._finished = False

    def deltas(self) -> Generator[str, None, None]:
        """Run the generation, yielding text deltas (none without a tokenizer)."""
        self._started = time.perf_counter()
        rounds = self.engine._rounds(self)
        try:
            while True:
                try:
                    tokens = next(rounds)
                except StopIteration as done:
                    self.finish_reason = done.value
                    break
                except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
                    if not _is_out_of_memory(error):
                        raise
                    raise self._memory_error(error) from error
                for token in tokens:
                    self.token_ids.append(token)
                    delta = self._push_text(token)
                    if delta:
                        yield delta
                    if self.stop_matcher.stopped:
                        self.finish_reason = "stop"
                        return
            tail = self._flush_text()
            if tail:
                yield tail
        finally:
            rounds.close()
            if self.finish_reason is None:
                self.finish_reason = "cancelled"
            self._finish()

    def _memory_error(self, error: BaseException) -> GenerationMemoryError:
        """The clear error for an allocation failure; the failed round's cache is already gone."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the failed generation's blocks back
        return GenerationMemoryError(
            f"out of memory after {len(self.token_ids)} new tokens (prompt {len(self.prompt_ids)} tokens, "
            f"max_new_tokens {self.max_new_tokens}; the KV cache is sized for both up front). Lower "
            f"max_new_tokens, shorten the prompt, or load the model with quantization='4bit'/'8bit'. "
            f"The engine is still usable. Cause: {str(error).splitlines()[0][:200]}"
        )

    def _push_text(self, token: int) -> str:
        if self.detokenizer is None:
            return ""
        delta = self.stop_matcher.push(self.detokenizer.push(token))
        self.text_parts.append(delta)
        return delta

    def _flush_text(self) -> str:
        if self.detokenizer is None:
            return ""
        tail = self.stop_matcher.push(self.detokenizer.flush())
        tail += self.stop_matcher.flush()
        self.text_parts.append(tail)
        return tail

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        stats = self.stats
        elapsed = time.perf_counter() - self._started
        steps = stats.target_forwards - 1  # verify steps after the prefill
        decoded = max(0, len(self.token_ids) - 1)
        stats.mean_accepted_length = decoded / steps if steps > 0 else 1.0
        stats.acceptance_rate = stats.num_accepted / stats.num_drafted if stats.num_drafted else 0.0
        stats.tokens_per_second = len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    def output(self) -> GenerationOutput:
        """The finished result."""
        assert self.finish_reason is not None
        return GenerationOutput(
            text="".join(self.text_parts) if self.detokenizer is not None else None,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stats=self.stats,
            prompt_tokens=len(self.prompt_ids),
        )


class GenerationStream(Iterator[str]):
    """An iterator of text deltas from :meth:`SpeculativeEngine.stream`.

    Attributes:
        stats: the :class:`GenerationStats`, once the stream is exhausted or closed.
        output: the full :class:`GenerationOutput`, once the stream is exhausted or closed.
    """

    def __init__(self, run: _Generation) -> None:
        self._run = run
        self._deltas = run.deltas()
        self.stats: GenerationStats | None = None
        self.output: GenerationOutput | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration:
            self._complete()
            raise
        except BaseException:
            self._complete()
            raise

    def close(self) -> None:
        """Stop generating (the KV cache is released); ``finish_reason`` becomes ``"cancelled"``."""
        self._deltas.close()
        if self._run.finish_reason is None:  # closed before it started
            self._run.finish_reason = "cancelled"
            self._run._finish()
        self._complete()

    @property
    def finish_reason(self) -> FinishReason | None:
        """``"stop"``, ``"length"`` or ``"cancelled"`` once finished, else ``None``."""
        return self._run.finish_reason if self.output is not None else None

    def _complete(self) -> None:
        if self.output is None and self._run.finish_reason is not None:
            self.output = self._run.output()
            self.stats = self.output.stats

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GenerationStream(finish_reason={self.finish_reason!r}, tokens={len(self._run.token_ids)})"
