"""EAGLE-3 heads: fused features of three target layers, their own norms, rotary and draft vocabulary.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts from the states *entering* a few target layers (by default layers
``2, L // 2, L - 3``: low, middle and high features; id ``L`` would be the last layer's output
before the final norm), concatenated and fused by ``fc``. At position ``t``, with ``x_{t+1}`` the
token that follows::

    g_t   = fc(cat(a_t, b_t, c_t))                     # [3 H_target] -> [H]  (no bias)
    e     = input_layernorm(embed(x_{t+1}))            # the head's own norms ...
    n     = hidden_norm(g_t)
    r     = n if norm_before_residual else g_t         # ... and residual rule
    h     = r + o_proj(attention(q/k/v(cat(e, n))))    # q/k/v read 2H; the head's own rotary
    out_t = h + mlp(post_attention_layernorm(h))       # fed back as the next step's g (no fc)
    draft logits = lm_head(norm(out_t))                # the head's own norm and LM head, over the
                                                       # draft vocabulary; target id = i + d2t[i]

The layer is the reference's first (and only) decoder layer; the head's attention, MLP and norms
are transformers' modules of the head's ``transformer_layer_config`` (Llama or Qwen3), with q/k/v
widened to 2H. The embedding is the file's ``embed_tokens.weight`` when the folder has one (as vLLM
does), else the target's. Sources (read, never copied): vllm-project/speculators
``models/eagle3/{core,model_definitions,config}.py``, SafeAILab/EAGLE ``eagle/model/cnets.py``
(``Model``, ``LlamaDecoderLayeremb``) and ``modeling_llama_kv.py`` (which layers are tapped). The
two published layouts are read by :mod:`selfspec.drafting.eagle.speculators` (``config.json`` with
``speculators_model_type: "eagle3"``, weights ``layers.0.*``) and :func:`load_safeailab_eagle3`
(SafeAILab / SpecForge: weights ``midlayer.*``).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import ConfigurationError
from .head import EagleHead, EagleHeadConfig, HeadStep

#: The ``format`` of the :class:`~selfspec.drafting.eagle.head.EagleHeadConfig` of a loaded EAGLE-3 head.
EAGLE3_FORMAT = "eagle-3"
#: transformer_layer_config model types whose decoder layer an EAGLE-3 head may use.
LAYER_TYPES = {"llama": "Llama", "qwen3": "Qwen3"}


def default_feature_layers(num_layers: int) -> list[int]:
    """The layers EAGLE-3 taps when a head names none: ``[2, L // 2, L - 3]`` (SafeAILab, vLLM, speculators)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Spec:
    """What an EAGLE-3 folder says, whatever its layout (read before any weight).

    Attributes:
        layer_config: the head's decoder-layer config (``model_type`` ``llama`` or ``qwen3``).
        feature_layers: target layers whose input states are fused (``i == L``: last output).
        draft_vocab_size: the head's vocabulary (its ``lm_head`` rows).
        norm_before_residual: the residual is the normed feature (else the raw fused feature).
        prefix: the published name of the layer's weights (``layers.0.`` or ``midlayer.``).
        layout: ``"speculators"`` or ``"safeailab"`` (for messages and the head's repr).
        verifier: the target the head was trained for, when the folder names it.
        extra: other settings of the folder kept for the record (``speculative_tokens``, ...).
    """

    layer_config: dict[str, Any]
    feature_layers: list[int]
    draft_vocab_size: int
    norm_before_residual: bool
    prefix: str
    layout: str
    verifier: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _modeling(model_type: str) -> Any:
    """Transformers' modeling module of a layer type (``llama`` / ``qwen3``)."""
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def build_layer_config(spec: Eagle3Spec, attn_implementation: str) -> Any:
    """A transformers config of the head's layer (``LlamaConfig`` / ``Qwen3Config``)."""
    fields = dict(spec.layer_config)
    model_type = str(fields.pop("model_type", "llama"))
    if model_type not in LAYER_TYPES:
        raise ConfigurationError(
            f"EAGLE-3 head layer type {model_type!r} is not supported (supported: {', '.join(LAYER_TYPES)})"
        )
    config_module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    config_class = getattr(config_module, f"{LAYER_TYPES[model_type]}Config")
    for drop in ("architectures", "num_hidden_layers", "layer_types", "torch_dtype", "dtype", "transformers_version"):
        fields.pop(drop, None)
    try:
        config = config_class(**fields, num_hidden_layers=1, attn_implementation=attn_implementation)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(f"the EAGLE-3 head's layer config is not a {model_type} layer ({exc})") from exc
    if getattr(config, "head_dim", None) is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    return config


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: q/k/v read ``cat(input_layernorm(embed), hidden_norm(feature))``.

    Its submodules are transformers' own (attention, MLP, RMS norms of the layer type), named as
    the published weights are (``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``hidden_norm``,
    ``post_attention_layernorm``).

    Args:
        layer_config: the head's layer config (:func:`build_layer_config`).
        norm_before_residual: the residual is the normed feature (else the raw one).
    """

    def __init__(self, layer_config: Any, norm_before_residual: bool) -> None:
        super().__init__()
        module = _modeling(layer_config.model_type)
        prefix = LAYER_TYPES[layer_config.model_type]
        base = getattr(module, f"{prefix}DecoderLayer")(layer_config, layer_idx=0)
        hidden, head_dim, bias = layer_config.hidden_size, layer_config.head_dim, layer_config.attention_bias
        self.self_attn = base.self_attn
        heads, kv_heads = layer_config.num_attention_heads, layer_config.num_key_value_heads
        self.self_attn.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=bias)  # reads [embed, feature]
        self.self_attn.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=bias)
        self.mlp = base.mlp
        self.input_layernorm = base.input_layernorm
        self.hidden_norm = type(base.input_layernorm)(hidden, eps=layer_config.rms_norm_eps)
        self.post_attention_layernorm = base.post_attention_layernorm
        self.norm_before_residual = norm_before_residual
        params = inspect.signature(type(self.self_attn).forward).parameters
        self._cache_keyword = "cache" if "cache" in params else "past_key_values"  # transformers 5.20+ vs older

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """``[B, q, H]`` token embeddings and features -> ``[B, q, H]`` the layer's output (pre-norm)."""
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        attention_input = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, q, 2H]: embedding first
        attended, _ = self.self_attn(
            hidden_states=attention_input,
            position_embeddings=position_embeddings,
            attention_mask=mask,
            **{self._cache_keyword: cache},
        )
        hidden = residual + attended
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out


class Eagle3Head(EagleHead):
    """A published EAGLE-3 head, drafting like any selfspec head (:class:`~selfspec.drafting.eagle.head.EagleHead`).

    The drafter hands it the concatenated input states of :attr:`capture_layers` (the verifier
    captures them during its forward, see :mod:`selfspec.decoding.verify`); :meth:`target_features` fuses
    them with ``fc``; :meth:`layer_output` runs :class:`Eagle3Layer`, whose pre-norm output
    is fed back as the next feature; :meth:`draft_logits` applies the head's own norm and LM
    head over its draft vocabulary, mapped to target ids by ``d2t``.

    Args:
        model: the target (a Llama-layout transformers causal LM, or its ModelRunner).
        config: the selfspec view of the head (target shapes, ``feature_layers``, draft vocabulary).
        spec: what the folder says (:class:`Eagle3Spec`).
        draft_token_ids: ``[draft vocab]`` target ids of the draft vocabulary (``arange + d2t``),
            or ``None`` when the head scores the full vocabulary.
        own_embedding: the head has its own ``embed_tokens`` (the file's), else the target's is used.
        source: the folder it came from (for messages).
    """

    def __init__(
        self,
        model: Any,
        config: EagleHeadConfig,
        spec: Eagle3Spec,
        draft_token_ids: torch.Tensor | None = None,
        own_embedding: bool = False,
        source: str = "",
    ) -> None:
        super().__init__(model, config, init_from_last_layer=False)
        implementation = self.target.attn_implementation  # the runner's: "eager" or "sdpa"
        layer_config = build_layer_config(spec, implementation)
        hidden = int(layer_config.hidden_size)
        target_hidden = config.hidden_size
        self.spec = spec
        self.source = source
        self.layer_config = layer_config
        self.fc = nn.Linear(len(spec.feature_layers) * target_hidden, hidden, bias=False)
        self.layer = Eagle3Layer(layer_config, spec.norm_before_residual)
        self.norm = type(self.layer.hidden_norm)(hidden, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, spec.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        rotary_class = getattr(
            _modeling(layer_config.model_type), f"{LAYER_TYPES[layer_config.model_type]}RotaryEmbedding"
        )
        self.head_rotary = rotary_class(layer_config)
        self.attn_implementation = implementation
        if draft_token_ids is not None:
            draft_token_ids = draft_token_ids.to(torch.long).flatten()
        self.register_buffer("draft_token_ids", draft_token_ids, persistent=False)
        self.capture_layers = tuple(spec.feature_layers)
        self.to_target()

    def __repr__(self) -> str:
        return (
            f"Eagle3Head(source={self.source!r}, layout={self.spec.layout!r}, features={self.spec.feature_layers}, "
            f"draft_vocab={self.spec.draft_vocab_size}, norm_before_residual={self.spec.norm_before_residual}, "
            f"parameters={self.num_parameters()})"
        )

    # ------------------------------------------------------------------ features
    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[.., n_layers * H_target]`` captured target states -> ``[.., H]`` fused features (``fc``)."""
        fused: torch.Tensor = self.fc(hidden.to(self.fc.weight.dtype))
        return fused

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The head's own embedding when its folder has one (as vLLM uses it), else the target's."""
        if self.embed_tokens is not None:
            embedded: torch.Tensor = self.embed_tokens(token_ids)
            return embedded
        return super().embed(token_ids)

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's own rotary embedding (its layer config's ``rope_theta`` / ``rope_scaling``)."""
        cos_sin: tuple[torch.Tensor, torch.Tensor] = self.head_rotary(x, position_ids)
        return cos_sin

    def layer_output(self, step: HeadStep) -> torch.Tensor:
        """:class:`Eagle3Layer` over the embeddings and the fused features (or the head's previous outputs)."""
        out: torch.Tensor = self.layer(step.embeds, step.features, step.rotary, step.mask, step.cache)
        return out

    def predicted(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output as it is: fed back as the next feature, scored by :meth:`draft_logits`."""
        return out

    # ------------------------------------------------------------------ logits
    def draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """``[.., H]`` layer outputs -> ``[.., draft vocab]`` float32 logits (the head's norm and LM head)."""
        logits: torch.Tensor = self.lm_head(self.norm(predicted.to(self.lm_head.weight.dtype)))
        return logits.float()

    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float16) -> Path:
        """Not selfspec's format: write EAGLE-3 heads with :func:`selfspec.drafting.eagle.export.export_eagle`."""
        raise ConfigurationError(
            "EAGLE-3 heads are saved in vLLM's speculators layout: "
            "selfspec.drafting.eagle.export.export_eagle(model, head, folder) or `selfspec export-eagle`"
        )

    def published_state(self) -> dict[str, torch.Tensor]:
        """The head's weights under their published names (``layers.0.*`` / ``midlayer.*`` as read)."""
        return {published_name(name, self.spec.prefix): value for name, value in self.state_dict().items()}


def published_name(name: str, prefix: str) -> str:
    """A head state-dict name -> its published name (``layer.`` -> ``prefix``; ``embed_tokens`` kept)."""
    return prefix + name[len("layer.") :] if name.startswith("layer.") else name


# ----------------------------------------------------------------------------- building from a folder
def build_eagle3_head(
    path: Path, model: Any, spec: Eagle3Spec, files: list[Path], shapes: dict[str, tuple[int, ...]]
) -> Eagle3Head:
    """Check an EAGLE-3 folder against ``model`` (names and shapes from the headers), then read its weights.

    Raises:
        ConfigurationError: the head does not fit the model, or its weights are not the layout's.
    """
    from . import files as eagle_files

    target = model.config
    target_hidden, target_vocab, num_layers = (
        int(target.hidden_size),
        int(target.vocab_size),
        int(target.num_hidden_layers),
    )
    where = f"the EAGLE-3 head in {path} ({spec.layout} layout)"
    problems = []
    layer_vocab = spec.layer_config.get("vocab_size")
    if layer_vocab is not None and int(layer_vocab) != target_vocab:
        problems.append(f"vocabulary {layer_vocab} vs the model's {target_vocab}")
    declared_target_hidden = spec.extra.get("target_hidden_size")
    if declared_target_hidden is not None and int(declared_target_hidden) != target_hidden:
        problems.append(f"target hidden size {declared_target_hidden} vs the model's {target_hidden}")
    bad_layers = [i for i in spec.feature_layers if not 0 <= int(i) <= num_layers]
    if bad_layers or not spec.feature_layers:
        problems.append(f"feature layers {spec.feature_layers} outside the model's 0..{num_layers}")
    fc_shape = shapes.get("fc.weight")
    if fc_shape is not None and len(fc_shape) == 2 and fc_shape[1] != len(spec.feature_layers) * target_hidden:
        problems.append(
            f"fc.weight {list(fc_shape)} reads {fc_shape[1]} features, not {len(spec.feature_layers)} layers x "
            f"{target_hidden} of this model"
        )
    if spec.draft_vocab_size <= 0 or spec.draft_vocab_size > target_vocab:
        problems.append(f"draft vocabulary {spec.draft_vocab_size} vs the model's {target_vocab}")
    if problems:
        raise ConfigurationError(
            f"{where} does not fit this model: {'; '.join(problems)}. Use a head trained for this model."
        )
    head_hidden = int(spec.layer_config.get("hidden_size") or target_hidden)
    own_embedding = "embed_tokens.weight" in shapes
    if head_hidden != target_hidden and not own_embedding:
        raise ConfigurationError(
            f"{where} has hidden size {head_hidden}, not the model's {target_hidden}, and no embed_tokens.weight "
            "of its own"
        )
    config = EagleHeadConfig(
        target=spec.verifier or f"published EAGLE-3 head {path.name}",
        model_type=str(target.model_type),
        hidden_size=target_hidden,
        vocab_size=target_vocab,
        num_target_layers=num_layers,
        feature_layers=[int(i) for i in spec.feature_layers],
        draft_vocab_size=spec.draft_vocab_size if spec.draft_vocab_size != target_vocab else 0,
        training={"source": str(path), "layout": spec.layout, **spec.extra},
        format=EAGLE3_FORMAT,
    )
    head = Eagle3Head(model, config, spec, own_embedding=own_embedding, source=str(path))

    # names and shapes, from the headers, against the head the config describes
    expected = {published_name(n, spec.prefix): tuple(v.shape) for n, v in head.state_dict().items()}
    vocab_maps = {"d2t": (spec.draft_vocab_size,), "t2d": (target_vocab,)}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected) - set(vocab_maps))
    wrong = sorted(
        f"{name} {list(shapes[name])} (expected {list(shape)})"
        for name, shape in {**expected, **vocab_maps}.items()
        if name in shapes and tuple(shapes[name]) != shape
    )
    if spec.draft_vocab_size != target_vocab and "d2t" not in shapes:
        missing.append("d2t")
    if missing or unexpected or wrong:
        detail = "; ".join(
            ([f"missing {missing}"] if missing else [])
            + ([f"unexpected {unexpected}"] if unexpected else [])
            + ([f"wrong shapes: {', '.join(wrong)}"] if wrong else [])
        )
        raise ConfigurationError(f"{where} does not match its config.json: {detail}")

    # the weights
    wanted = set(expected) | ({"d2t", "t2d"} & set(shapes))
    state = eagle_files._read_weights(files, wanted)
    dtype = head.fc.weight.dtype
    mine = {n: state[published_name(n, spec.prefix)].to(dtype) for n in head.state_dict()}
    head.load_state_dict(mine, strict=True)
    if "d2t" in state:
        head.draft_token_ids = draft_token_ids(state["d2t"], state.get("t2d"), target_vocab, where).to(
            head.fc.weight.device
        )
    head.eval().requires_grad_(False)
    return head


def draft_token_ids(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int, where: str) -> torch.Tensor:
    """Target ids of the draft vocabulary, ``arange(draft) + d2t``, checked (in range, distinct, as ``t2d`` says)."""
    if d2t.is_floating_point() or d2t.dim() != 1:
        raise ConfigurationError(f"{where}: d2t must be a 1-D integer tensor, got {d2t.dtype} {list(d2t.shape)}")
    ids = torch.arange(d2t.numel()) + d2t.to(torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ConfigurationError(f"{where}: d2t maps draft tokens outside the vocabulary or onto the same token")
    if t2d is not None:
        mask = t2d.to(torch.bool)
        if int(mask.sum()) != ids.numel() or not bool(mask[ids].all()):
            raise ConfigurationError(f"{where}: t2d does not mark exactly the tokens d2t maps to")
    return ids


def read_safeailab_spec(raw: dict[str, Any], model: Any) -> Eagle3Spec:
    """The :class:`Eagle3Spec` of a SafeAILab / SpecForge EAGLE-3 ``config.json`` (a Llama config + fields)."""
    num_layers = int(model.config.num_hidden_layers)
    nested = raw.get("eagle_config")
    eagle_config: dict[str, Any] = nested if isinstance(nested, dict) else {}
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = raw.get("draft_vocab_size") or raw.get("vocab_size") or model.config.vocab_size
    layer_config = {k: v for k, v in raw.items() if k not in ("eagle_config", "draft_vocab_size", "target_hidden_size")}
    layer_config.setdefault("model_type", "llama")
    layer_config.setdefault("rms_norm_eps", 1e-6)  # SafeAILab's EConfig default
    if raw.get("num_hidden_layers", 1) != 1:
        raise ConfigurationError(
            f"EAGLE-3 heads with {raw.get('num_hidden_layers')} decoder layers are not supported (one layer: midlayer)"
        )
    extra = {"target_hidden_size": raw["target_hidden_size"]} if raw.get("target_hidden_size") else {}
    return Eagle3Spec(
        layer_config=layer_config,
        feature_layers=[int(i) for i in (layers or default_feature_layers(num_layers))],
        draft_vocab_size=int(draft_vocab),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),  # LlamaDecoderLayeremb: raw residual
        prefix="midlayer.",
        layout="safeailab",
        extra=extra,
    )


def new_eagle3_head(
    model: Any, feature_layers: tuple[int, ...], draft_token_ids: torch.Tensor | None, target_name: str = ""
) -> Eagle3Head:
    """A new EAGLE-3 head for ``model``, to train (``selfspec train-eagle --format eagle3``).

    The layer is a Llama (or, for Qwen3 targets, Qwen3) layer shaped like the target's layers; the
    LM head starts as the target's rows of the draft vocabulary and stays frozen (as the
    speculators trainer does), the norm starts at ones, ``fc`` and the layer at their default
    initialisation; the embedding is the target's. ``norm_before_residual`` is false (SafeAILab's rule).
    """
    config = model.config
    model_type = config.model_type if config.model_type in LAYER_TYPES else "llama"
    rope = dict(getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)})
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # per-layer-type rotary (Gemma 3)
        rope = dict(rope["full_attention"])
    layer_config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": int(config.hidden_size),
        "intermediate_size": int(config.intermediate_size),
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        "hidden_act": str(getattr(config, "hidden_act", "silu")),
        "rms_norm_eps": float(getattr(config, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 4096) or 4096),
        "vocab_size": int(config.vocab_size),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "rope_parameters": rope,
    }
    vocab = int(config.vocab_size)
    draft_vocab = int(draft_token_ids.numel()) if draft_token_ids is not None else vocab
    spec = Eagle3Spec(
        layer_config=layer_config,
        feature_layers=[int(i) for i in feature_layers],
        draft_vocab_size=draft_vocab,
        norm_before_residual=False,
        prefix="layers.0.",
        layout="speculators",
        verifier=target_name,
        extra={"verifier_architectures": [str(a) for a in (getattr(config, "architectures", None) or [])]},
    )
    head_config = EagleHeadConfig(
        target=target_name or str(getattr(config, "_name_or_path", "") or ""),
        model_type=str(config.model_type),
        hidden_size=int(config.hidden_size),
        vocab_size=vocab,
        num_target_layers=int(config.num_hidden_layers),
        feature_layers=[int(i) for i in feature_layers],
        draft_vocab_size=draft_vocab if draft_vocab != vocab else 0,
        format=EAGLE3_FORMAT,
    )
    head = Eagle3Head(model, head_config, spec, draft_token_ids=draft_token_ids)
    with torch.no_grad():
        weight = head.target.lm_head.weight
        assert isinstance(weight, torch.Tensor)
        weight = weight.detach()
        rows = weight if draft_token_ids is None else weight.index_select(0, draft_token_ids.to(weight.device))
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight.dtype))
        head.norm.weight.fill_(1.0)
    head.lm_head.weight.requires_grad_(False)
    return head
