"""An EAGLE-style feature head: a one-layer drafter that reads the target's own features.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty")
drafts at the feature level. At position ``t`` the head reads the target's last-layer feature
``f_t`` (after the final norm) and the embedding of the token ``x_{t+1}`` that follows it, and
predicts the next feature ``f_{t+1}``; the target's own LM head turns a predicted feature into
draft logits. Drafting continues autoregressively on the head's own predicted features:

    x = fc([embed(x_{t+1}), f_t])            # [.., 2H] -> [.., H]
    f_{t+1} ~ norm(layer(x))                 # one decoder layer of the target's own class,
                                             # then the target's final norm
    draft logits = lm_head(f_{t+1})          # the target's LM head (frozen, shared)

The token embedding, final norm, rotary embedding and LM head are the target's own modules,
referenced (never copied, never saved, never trained). The head's parameters are ``fc`` and
the decoder layer. With ``draft_token_ids`` the head scores only a subset of the vocabulary
(EAGLE-3's reduced draft vocabulary, the most frequent tokens of its training text): on a
small model the LM head dominates a draft step, and a draft restricted to a subset is still
verified exactly (its distribution is zero elsewhere).

A head is saved as a folder with ``eagle_head.safetensors`` and ``eagle_config.json``
(:data:`HEAD_WEIGHTS`, :data:`HEAD_CONFIG`): the target's name and shapes, which layers'
features it reads, and how it was trained.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...artifacts import (
    BUNDLED_MODELS,
    EAGLE_HEADS,
    atomic_path,
    atomic_write_text,
    find_artifact,
    loose_name,
    make_folder,
    model_cache,
)
from ...errors import ConfigurationError, ModelNotFoundError
from ...modeling.attention import causal_allowed, format_mask
from ...modeling.compat import cache_keyword
from ...modeling.runner import ModelRunner, runner_for

#: Files of a saved head.
HEAD_WEIGHTS = "eagle_head.safetensors"
HEAD_CONFIG = "eagle_config.json"
#: The ``format`` field of :data:`HEAD_CONFIG`.
HEAD_FORMAT = "selfspec-eagle"
#: The subfolder of a model folder (or of its user-cache folder) where heads are saved and found.
EAGLE_SUBFOLDER = "eagle_head"
#: Heads shipped with the package, one folder per target model.
SHIPPED_HEADS = BUNDLED_MODELS / "eagle"
#: The target-config fields the head's decoder layer is built from (they must match to load a head).
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "attention_bias",
    "mlp_bias",
)


@dataclass
class EagleHeadConfig:
    """What a head was built for and how it was trained (saved as :data:`HEAD_CONFIG`).

    Attributes:
        target: the target model's name (a hub id, a folder or a GGUF file name).
        model_type: the target's ``config.model_type``.
        hidden_size: the target's hidden size ``H``.
        vocab_size: the target's vocabulary size.
        num_target_layers: the target's number of decoder layers.
        feature_layers: the target layers whose features the head reads; ``[L]`` is the last
            layer's output after the final norm (EAGLE-1).
        draft_vocab_size: size of the reduced draft vocabulary (``0``: the full vocabulary).
        layer: the target-config fields the head's decoder layer was built from.
        training: training figures (tokens, steps, seconds, held-out agreement, ...).
    """

    target: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    feature_layers: list[int]
    draft_vocab_size: int = 0
    layer: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    format: str = HEAD_FORMAT

    @classmethod
    def for_target(cls, model: Any, target: str = "", draft_vocab_size: int = 0) -> EagleHeadConfig:
        """The config of a new head for ``model`` (a transformers causal LM)."""
        config = model.config
        num_layers = int(config.num_hidden_layers)
        return cls(
            target=target or str(getattr(config, "_name_or_path", "") or ""),
            model_type=str(config.model_type),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            num_target_layers=num_layers,
            feature_layers=[num_layers],
            draft_vocab_size=draft_vocab_size,
            layer=layer_fields(config),
        )


def layer_fields(config: Any) -> dict[str, Any]:
    """The :data:`LAYER_FIELDS` of a transformers config (those it has)."""
    return {name: getattr(config, name) for name in LAYER_FIELDS if getattr(config, name, None) is not None}


class HeadCache:
    """The head's own KV cache: one layer, preallocated, cropped like the target's.

    Slot ``t`` holds the head's entry for the pair ``(f_t, x_{t+1})``. It implements the
    ``update`` contract transformers' attention modules call.

    Args:
        max_length: the most entries it will hold.
    """

    is_compileable = False

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def __repr__(self) -> str:
        return f"HeadCache(length={self.length}, max_length={self.max_length})"

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[1, kv_heads, q, head_dim]`` states; return the filled views."""
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.max_length:
            raise RuntimeError(f"EAGLE head cache overflow: {end} entries > {self.max_length}")
        if self.keys is None or self.values is None:
            self.keys = key_states.new_empty((*key_states.shape[:-2], self.max_length, key_states.shape[-1]))
            self.values = value_states.new_empty((*value_states.shape[:-2], self.max_length, value_states.shape[-1]))
        self.keys[..., start:end, :] = key_states
        self.values[..., start:end, :] = value_states
        self.length = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Entries held."""
        return self.length

    def crop_to(self, length: int) -> None:
        """Keep at most ``length`` entries."""
        self.length = min(self.length, length)


class StaticHeadCache:
    """The head's KV cache for compiled draft steps: fixed slots, the length on the device.

    The twin of :class:`HeadCache` for the static round (``compile=``): one key and one value
    buffer of ``max_length`` slots (allocated at the first write, zeroed: masked slots stay
    finite), slot ``t`` holding position ``t``, and a 0-d ``long`` :attr:`length` on the device.
    A forward writes its ``q`` entries at ``length .. length + q - 1`` with ``index_copy_``,
    moves the length past them, and attends over every slot through :meth:`allowed` (a mask
    built on the device), so a one-query draft step has the same shapes at every position and
    compiles once. Rolling back is setting :attr:`length`.

    Args:
        max_length: slots (the most entries it will hold).
        device: where the buffers and the length live.
    """

    is_compileable = True

    def __init__(self, max_length: int, device: torch.device) -> None:
        self.max_length = max_length
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = torch.zeros((), dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return f"StaticHeadCache(max_length={self.max_length})"

    def allowed(self, num_queries: int) -> torch.Tensor:
        """``[1, q, max_length]``: query ``i`` (at position ``length + i``) sees the slots up to its own."""
        device = self.length.device
        query = self.length + torch.arange(num_queries, device=device)
        return (torch.arange(self.max_length, device=device)[None, :] <= query[:, None])[None]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[1, kv_heads, q, head_dim]`` states at ``length ..``; return every slot."""
        if self.keys is None or self.values is None:
            self.keys = key_states.new_zeros((*key_states.shape[:-2], self.max_length, key_states.shape[-1]))
            self.values = value_states.new_zeros((*value_states.shape[:-2], self.max_length, value_states.shape[-1]))
            if self.keys.device.type == "cuda":  # compiled steps read and write them in place
                torch._dynamo.mark_static_address(self.keys)
                torch._dynamo.mark_static_address(self.values)
        slots = self.length + torch.arange(key_states.shape[-2], device=key_states.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self.length.add_(key_states.shape[-2])
        return self.keys, self.values


@dataclass
class HeadStep:
    """What the head's decoder layer reads in one forward (:meth:`EagleHead.layer_output`).

    Attributes:
        embeds: ``[B, q, H]`` embeddings of the tokens ``x_{t+1}``.
        features: ``[B, q, H]`` features ``f_t`` (the target's, or the head's own predictions).
        position_ids: ``[B, q]`` positions ``t``.
        rotary: the rotary ``(cos, sin)`` at those positions.
        mask: the attention mask as the layer takes it (``None``: one query over everything cached).
        cache: the head's KV cache.
    """

    embeds: torch.Tensor
    features: torch.Tensor
    position_ids: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    cache: Any


class EagleHead(nn.Module):
    """``fc`` + one decoder layer over the target's features; the target's modules are shared.

    The target's modules (embedding, decoder layers, final norm, rotary embedding, LM head and
    logit soft-capping) are reached through its :class:`~selfspec.modeling.runner.ModelRunner`.

    Args:
        model: the target: a loaded transformers ``*ForCausalLM`` of the Llama-family layout
            (:func:`~selfspec.modeling.runner.check_decoder_layout`), or its
            :class:`~selfspec.modeling.runner.ModelRunner`.
        config: the head's config (default: a new one for ``model``, full vocabulary).
        draft_token_ids: sorted ids of the reduced draft vocabulary (``None``: full vocabulary).
        init_from_last_layer: start the head's layer from a copy of the target's last layer
            (a training start; loading overwrites it).
    """

    draft_token_ids: torch.Tensor | None
    #: the target layers whose input states the head reads (EAGLE-3); ``None``: the last layer's output
    capture_layers: tuple[int, ...] | None = None

    def __init__(
        self,
        model: Any,
        config: EagleHeadConfig | None = None,
        draft_token_ids: torch.Tensor | None = None,
        init_from_last_layer: bool = True,
    ) -> None:
        super().__init__()
        # the target's own modules, shared and frozen: kept out of this module's parameters
        self._target: ModelRunner = runner_for(model, "an EAGLE head")
        target = self._target
        self.head_config = config or EagleHeadConfig.for_target(target)
        check_fits(self.head_config, target)
        hidden = self.head_config.hidden_size
        layer_config = copy.deepcopy(target.config)
        layer_config.num_hidden_layers = 1
        if getattr(layer_config, "layer_types", None) is not None:
            layer_config.layer_types = ["full_attention"]
        layer_class: Any = type(target.layers[0])  # the target's own decoder-layer class
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = layer_class(layer_config, layer_idx=0)
        self._keyword_of: tuple[type, str] | None = None  # (layer class, its cache keyword): see layer_output
        self.attn_implementation = target.attn_implementation
        if init_from_last_layer:
            self.layer.load_state_dict(target.layers[-1].state_dict())
        if draft_token_ids is not None:
            draft_token_ids = draft_token_ids.to(torch.long).flatten()
            self.head_config.draft_vocab_size = int(draft_token_ids.numel())
        self.register_buffer("draft_token_ids", draft_token_ids, persistent=False)
        self._draft_weight: torch.Tensor | None = None
        self.to_target()

    @property
    def target(self) -> ModelRunner:
        """The runner of the target whose modules the head shares."""
        return self._target

    def to_target(self) -> None:
        """Put the head on the target's device, in its dtype (float32 for a quantized embedding)."""
        dtype = self._target.dtype
        self.to(device=self._target.device, dtype=dtype if dtype.is_floating_point else torch.float32)

    def __repr__(self) -> str:
        config = self.head_config
        vocab = config.draft_vocab_size or config.vocab_size
        return (
            f"EagleHead(target={config.target!r}, hidden_size={config.hidden_size}, "
            f"layer={type(self.layer).__name__}, draft_vocab={vocab}, parameters={self.num_parameters()})"
        )

    def num_parameters(self) -> int:
        """The head's own parameters (the shared target modules excluded)."""
        return sum(p.numel() for p in self.parameters())

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (draft distributions cover all of it)."""
        return self.head_config.vocab_size

    # ------------------------------------------------------------------ features
    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` last decoder layer outputs -> the features the head reads (after the final norm)."""
        return self._target.norm(hidden)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's own token embedding."""
        return self._target.embed(token_ids)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's rotary embedding at ``position_ids`` ``[B, q]``."""
        return self._target.rotary(x, position_ids)

    def forward(
        self,
        features: torch.Tensor,
        next_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the next features.

        Args:
            features: ``[B, q, H]`` features ``f_t`` (target features, or the head's own predictions).
            next_tokens: ``[B, q]`` the tokens ``x_{t+1}`` that follow them.
            position_ids: ``[B, q]`` positions ``t``.
            cache: the head's KV cache (:class:`HeadCache`, or any transformers-style cache).
            allowed: ``[B, q, kv]`` which cached entries (plus these new ones) each query sees;
                ``None`` is causal attention over everything cached (one query: no mask).

        Returns:
            ``[B, q, H]`` predicted features ``f_{t+1}`` (:meth:`predicted`: in the space of ``features``).
        """
        step = HeadStep(
            embeds=self.embed(next_tokens).to(features.dtype),
            features=features,
            position_ids=position_ids,
            rotary=self.rotary(features, position_ids),
            mask=self.attention_mask(features, cache, allowed),
            cache=cache,
        )
        return self.predicted(self.layer_output(step))

    def layer_output(self, step: HeadStep) -> torch.Tensor:
        """The decoder layer over ``fc([embeds, features])`` -> ``[B, q, H]``."""
        x = self.fc(torch.cat([step.embeds, step.features], dim=-1))  # [B, q, 2H] -> [B, q, H]
        out: torch.Tensor = self.layer(
            x,
            attention_mask=step.mask,
            position_ids=step.position_ids,
            use_cache=True,
            position_embeddings=step.rotary,
            **self._cache_kwargs(step.cache),
        )
        return out

    def _cache_kwargs(self, cache: Any) -> dict[str, Any]:
        """``{keyword: cache}`` for :attr:`layer`, read from its signature once per layer class.

        Remembered here rather than looked up in :func:`~selfspec.modeling.compat.cache_keyword`'s
        ``functools`` cache on every call, so a compiled draft step traces a plain attribute read.
        """
        layer_class = type(self.layer)
        if self._keyword_of is None or self._keyword_of[0] is not layer_class:
            self._keyword_of = (layer_class, cache_keyword(self.layer))
        return {self._keyword_of[1]: cache}

    def predicted(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's ``[B, q, H]`` output -> predicted features (the target's final norm: where features live)."""
        normed: torch.Tensor = self._target.norm(out)
        return normed

    def attention_mask(self, x: torch.Tensor, cache: Any, allowed: torch.Tensor | None) -> torch.Tensor | None:
        """The ``[B, 1, q, kv]`` mask of a forward over ``x`` ``[B, q, ..]`` as the layer takes it.

        ``allowed`` (``[B, q, kv]``) as given, else causal over everything cached; one query
        with nothing given needs no mask (``None``).
        """
        batch, num_queries = x.shape[0], x.shape[1]
        if allowed is None and num_queries > 1:
            allowed = causal_allowed(num_queries, cache.get_seq_length(0), batch, x.device)
        return None if allowed is None else format_mask(allowed[:, None], x.dtype, self.attn_implementation)

    # ------------------------------------------------------------------ logits
    def draft_weight(self) -> torch.Tensor:
        """The LM-head rows the head scores: all of them, or the reduced draft vocabulary's."""
        weight = self._target.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        if self.draft_token_ids is None:
            return weight
        cached = self._draft_weight
        if cached is None or cached.device != weight.device or cached.dtype != weight.dtype:
            cached = self._draft_weight = weight.detach().index_select(0, self.draft_token_ids.to(weight.device))
        return cached

    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` predicted features -> ``[.., draft vocab]`` float32 logits."""
        logits = torch.nn.functional.linear(predicted.to(self.draft_weight().dtype), self.draft_weight())
        return self._target.softcap(logits).float()

    def full_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` predicted features -> ``[.., vocab]`` float32 logits (``-inf`` outside the draft vocabulary)."""
        logits = self.draft_logits(predicted)
        if self.draft_token_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_token_ids.to(full.device), logits)

    def target_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` target features (post-norm) -> the target's own ``[.., vocab]`` float32 logits."""
        return self._target.softcap(self._target.lm_head(features)).float()

    # ------------------------------------------------------------------ saving
    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float16) -> Path:
        """Write :data:`HEAD_WEIGHTS` (``fc`` and the layer, in ``dtype``) and :data:`HEAD_CONFIG`."""
        from safetensors.torch import save_file

        path = Path(folder)
        make_folder(path)
        tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in self.state_dict().items()}
        if self.draft_token_ids is not None:
            tensors["draft_token_ids"] = self.draft_token_ids.detach().cpu().to(torch.int64).contiguous()
        with atomic_path(path / HEAD_WEIGHTS) as partial:  # each file written aside and renamed into place
            save_file(tensors, str(partial), metadata={"format": HEAD_FORMAT})
        text = json.dumps(asdict(self.head_config), indent=2, sort_keys=True) + "\n"
        atomic_write_text(path / HEAD_CONFIG, text)
        return path


def check_fits(config: EagleHeadConfig, model: Any, where: str = "") -> None:
    """Raise :class:`ConfigurationError` unless a head with ``config`` fits ``model``."""
    target = model.config
    source = f" in {where}" if where else ""
    problems = []
    if config.model_type != target.model_type:
        problems.append(f"architecture {config.model_type!r} vs the model's {target.model_type!r}")
    for name, mine, theirs in (
        ("hidden size", config.hidden_size, int(target.hidden_size)),
        ("vocabulary", config.vocab_size, int(target.vocab_size)),
        ("layer count", config.num_target_layers, int(target.num_hidden_layers)),
    ):
        if mine != theirs:
            problems.append(f"{name} {mine} vs the model's {theirs}")
    mismatched = [k for k, v in config.layer.items() if k in LAYER_FIELDS and getattr(target, k, v) != v]
    if mismatched and not problems:
        problems.append("decoder layer shape (" + ", ".join(mismatched) + ")")
    if problems:
        raise ConfigurationError(
            f"the EAGLE head{source} was trained for {config.target or 'another model'!r} and does not fit this "
            f"model: {'; '.join(problems)}. Train one for this model with `selfspec train-eagle --model M`, or "
            "pass eagle_head= the folder of a head trained for it."
        )


def read_head_config(folder: str | os.PathLike[str]) -> EagleHeadConfig:
    """Read and check :data:`HEAD_CONFIG` of a head folder.

    Raises:
        ModelNotFoundError: no such folder, or no head files in it.
        ConfigurationError: the config is unreadable or incomplete.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(
            f"no EAGLE head folder at {os.fspath(folder)!r}; train one with `selfspec train-eagle --model M`"
        )
    config_path = path / HEAD_CONFIG
    if not config_path.is_file() or not (path / HEAD_WEIGHTS).is_file():
        raise ModelNotFoundError(
            f"{path} is not an EAGLE head folder: it needs {HEAD_CONFIG} and {HEAD_WEIGHTS} "
            "(written by `selfspec train-eagle`)"
        )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
        known = {k: raw[k] for k in EagleHeadConfig.__dataclass_fields__ if k in raw}
        config = EagleHeadConfig(**known)
        if config.format != HEAD_FORMAT:
            raise ValueError(f"format {config.format!r} is not {HEAD_FORMAT!r}")
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(
            f"{config_path} is not a valid EAGLE head config ({exc}); retrain the head with `selfspec train-eagle`"
        ) from exc
    return config


def load_eagle_head(folder: str | os.PathLike[str], model: Any) -> EagleHead:
    """Load a head saved by :meth:`EagleHead.save` for ``model`` (on its device and dtype).

    Raises:
        ModelNotFoundError: no such folder, or no head files in it.
        ConfigurationError: the head was trained for another model, or its files are corrupt.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_head_config(folder)
    path = Path(folder).expanduser()
    check_fits(config, model, str(path))
    try:
        state = load_file(str(path / HEAD_WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigurationError(
            f"{path / HEAD_WEIGHTS} is not a readable safetensors file ({exc}); retrain the head with "
            "`selfspec train-eagle`"
        ) from exc
    draft_ids = state.pop("draft_token_ids", None)
    if draft_ids is not None and (
        draft_ids.dim() != 1 or int(draft_ids.min()) < 0 or int(draft_ids.max()) >= config.vocab_size
    ):
        raise ConfigurationError(f"{path / HEAD_WEIGHTS}: draft_token_ids are not token ids of this vocabulary")
    head = EagleHead(model, config, draft_token_ids=draft_ids, init_from_last_layer=False)
    dtype = head.target.dtype
    try:
        head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    except RuntimeError as exc:
        raise ConfigurationError(f"the weights in {path / HEAD_WEIGHTS} do not match {HEAD_CONFIG}: {exc}") from exc
    head.eval().requires_grad_(False)
    return head


def head_folder_for(name_or_path: str) -> Path:
    """Where ``selfspec train-eagle`` saves a head for a model, and where ``"auto"`` looks first.

    The user cache's :func:`~selfspec.artifacts.model_cache` for :data:`~selfspec.artifacts.EAGLE_HEADS`
    (``<cache>/eagle_heads/<model key>/``), never the model's own folder.
    """
    return model_cache(name_or_path, EAGLE_HEADS)


def _holds_head(folder: Path) -> bool:
    """A selfspec head, or a published EAGLE-1/2/3 or ``speculators`` head folder."""
    return (folder / HEAD_CONFIG).is_file() or (folder / "config.json").is_file()


def shipped_head_moved(folder: str | os.PathLike[str]) -> Path | None:
    """Where a shipped head a saved plan names lives now, when the package has moved since.

    A plan saved in the user cache names its head by folder; for a head shipped with selfspec that
    is a folder inside the installed package, which a new clone, a new virtual environment or an
    upgrade moves. ``.../selfspec/models/eagle/<name>`` that no longer exists is the shipped head
    ``<name>`` of this installation, when it ships one (``None`` otherwise: a missing folder of any
    other kind stays missing).
    """
    path = Path(folder)
    if path.is_dir() or path.parent.name != SHIPPED_HEADS.name or path.parent.parent.name != SHIPPED_HEADS.parent.name:
        return None
    here = SHIPPED_HEADS / path.name
    return here if (here / HEAD_CONFIG).is_file() else None


def find_eagle_head(name_or_path: str, model: Any = None) -> Path | None:
    """The head ``eagle_head="auto"`` uses: beside the model, in the user cache, or shipped.

    Looks in :func:`head_folder_for` (the user cache), then, read only, in a local model folder's
    ``eagle_head/`` (a published head) and where earlier versions saved heads
    (:func:`~selfspec.artifacts.find_artifact`: a selfspec head, or a published EAGLE-1/2/3 or
    ``speculators`` head folder put there), then a published head of the table for the model
    (:func:`~selfspec.drafting.eagle.catalog.find_published_head`, checked against ``model``),
    then in the heads shipped with selfspec (:data:`SHIPPED_HEADS`), whose target name must match
    the model's name (ignoring folders, case and GGUF quantization tags) and, when ``model`` is
    given, whose shapes must fit it.
    Returns ``None`` when there is none.
    """
    own = find_artifact(name_or_path, EAGLE_HEADS, _holds_head, beside=(EAGLE_SUBFOLDER,))
    if own is not None:
        return own
    from .catalog import find_published_head  # a published head of the table, checked (fetched when online)

    published = find_published_head(name_or_path, model)
    if published is not None:
        return published
    key = loose_name(name_or_path) if name_or_path else ""
    if not key or not SHIPPED_HEADS.is_dir():
        return None
    for folder in sorted(SHIPPED_HEADS.iterdir()):
        if not (folder / HEAD_CONFIG).is_file():
            continue
        try:
            config = read_head_config(folder)
        except (ConfigurationError, ModelNotFoundError):
            continue
        if loose_name(config.target) not in key and loose_name(folder.name) not in key:
            continue
        if model is not None:
            try:
                check_fits(config, model)
            except ConfigurationError:
                continue
        return folder
    return None
