"""Published EAGLE heads: load an EAGLE-1 / EAGLE-2 checkpoint folder as a selfspec draft head.

The EAGLE authors (SafeAILab/EAGLE) publish their heads as a folder with ``config.json`` (a
Llama config with ``num_hidden_layers: 1`` and an optional ``bias`` key for ``fc``) and
``pytorch_model.bin`` or ``model.safetensors``; SGLang (``llama_eagle.py``) and vLLM
(``llama_eagle.py``) read the same folders. EAGLE-2 uses EAGLE-1's heads unchanged (only the
draft tree differs). The head computes, at position ``t``::

    x = fc([embed(x_{t+1}), f_t])       # fc.weight [H, 2H] (+ fc.bias): embedding first, then feature
    f_{t+1} ~ layers.0(x)                 # a Llama decoder layer WITHOUT its input norm
    draft logits = lm_head(f_{t+1})       # the target's LM head, with no norm in front of it

where ``f_t`` is the target's last hidden state after its final norm. Unlike selfspec's own
heads (:class:`~selfspec.drafting.eagle.head.EagleHead`), the layer has no input norm, the output does not go
through the target's final norm, and the layer's norm eps and rotary embedding come from the
head's own ``config.json``. The weights are ``fc.weight``, ``fc.bias`` (optional),
``layers.0.{self_attn,mlp,post_attention_layernorm}.*`` and (optionally) ``embed_tokens.weight``,
a copy of the target's embedding that is only shape-checked: the target's own embedding and LM
head are used, as SGLang and vLLM do.

EAGLE-3 heads (``midlayer.*``, ``fc`` over three target layers' features, their own ``norm``,
``lm_head`` and ``d2t``/``t2d`` draft vocabulary) load through :mod:`selfspec.drafting.eagle.eagle3`, and folders in
vLLM's ``speculators`` layout through :mod:`selfspec.drafting.eagle.speculators`; :func:`load_published_head`
dispatches. Facts and sources: ``docs/eagle.md`` ("Published heads").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...artifacts import atomic_path, atomic_write_text, make_folder
from ...errors import ConfigurationError, ModelNotFoundError
from . import files as eagle_files
from .files import PUBLISHED_CONFIG, PUBLISHED_WEIGHTS, _read_config, _weight_files, _weight_shapes
from .head import EagleHead, EagleHeadConfig

#: The ``format`` of the :class:`~selfspec.drafting.eagle.head.EagleHeadConfig` of a loaded published head.
PUBLISHED_FORMAT = "eagle-1"
#: Weights a published EAGLE-1 head may hold beside ``fc`` and ``layers.0``: the target's own
#: modules (shape-checked, then the target's are used) and the input norm that EAGLE's layer 0
#: does not apply (SafeAILab/EAGLE cnets1.py; vLLM and SGLang replace it by the identity).
_SHARED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
_IGNORED_WEIGHTS = ("layers.0.input_layernorm.weight", "layers.0.self_attn.rotary_emb.inv_freq")
#: The layer's weight names (HF LlamaDecoderLayer) that a published head must hold.
_LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
)


def is_published_head(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` looks like a published EAGLE checkpoint (``config.json``, no selfspec head files)."""
    from .head import HEAD_CONFIG

    path = Path(folder).expanduser()
    return path.is_dir() and (path / PUBLISHED_CONFIG).is_file() and not (path / HEAD_CONFIG).is_file()


class PublishedEagleHead(EagleHead):
    """An EAGLE-1 / EAGLE-2 head in the published layout, drafting like any selfspec head.

    The drafter (:class:`~selfspec.drafting.eagle.drafter.EagleDrafter`) uses it exactly as an
    :class:`~selfspec.drafting.eagle.head.EagleHead`: it reads the target's post-norm features and predicts the
    next feature, which the target's LM head scores. What differs is inside: ``fc`` may have no
    bias, the decoder layer is a Llama layer built from the head's own ``config.json`` with its
    input norm removed, positions are rotated by the head's own rotary embedding (its
    ``rope_theta`` / ``rope_scaling``, as EAGLE's reference does), and the predicted feature goes
    to the LM head with no norm.

    Args:
        model: the target (a Llama-layout transformers causal LM or its runner, like :class:`EagleHead`'s).
        config: the head's selfspec config (shapes the head must fit; ``format`` "eagle-1").
        layer_config: a ``LlamaConfig`` of the head's decoder layer, from its ``config.json``.
        fc_bias: whether ``fc`` has a bias.
        source: the folder the head came from (for messages).
    """

    def __init__(self, model: Any, config: EagleHeadConfig, layer_config: Any, fc_bias: bool, source: str = "") -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__(model, config, init_from_last_layer=False)
        hidden = config.hidden_size
        self.source = source
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layer = LlamaDecoderLayer(layer_config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm
        self.head_rotary = LlamaRotaryEmbedding(layer_config)
        self.attn_implementation = layer_config._attn_implementation
        self.to_target()

    def __repr__(self) -> str:
        return (
            f"PublishedEagleHead(source={self.source!r}, hidden_size={self.head_config.hidden_size}, "
            f"fc_bias={self.fc.bias is not None}, parameters={self.num_parameters()})"
        )

    def rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's own rotary embedding (its config's ``rope_theta`` / ``rope_scaling``)."""
        cos_sin: tuple[torch.Tensor, torch.Tensor] = self.head_rotary(x, position_ids)
        return cos_sin

    def predicted(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's output as it is: EAGLE-1 scores it with the target's LM head, with no norm."""
        return out

    def save(self, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float16) -> Path:
        """Write the head back in the published layout (``config.json`` + ``model.safetensors``)."""
        from safetensors.torch import save_file

        path = Path(folder)
        make_folder(path)
        tensors = {
            name.replace("layer.", "layers.0.", 1): value.detach().to(dtype).cpu().contiguous()
            for name, value in self.state_dict().items()
        }
        with atomic_path(path / PUBLISHED_WEIGHTS) as partial:
            save_file(tensors, str(partial))
        layer_config = self.layer.self_attn.config
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "bias": self.fc.bias is not None,
            **{name: getattr(layer_config, name) for name in _CONFIG_DEFAULTS if name != "rope_theta"},
            "rope_theta": layer_config.rope_parameters["rope_theta"],
            "rope_scaling": _rope_scaling(layer_config),
        }
        atomic_write_text(path / PUBLISHED_CONFIG, json.dumps(config, indent=2) + "\n")
        return path


#: The ``config.json`` fields a published EAGLE-1 head's layer is built from, with the defaults of
#: EAGLE's own config class (SafeAILab/EAGLE eagle/model/configs.py ``EConfig``) where a field is absent.
_CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": None,
    "vocab_size": None,
    "intermediate_size": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,  # EConfig: num_attention_heads
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,  # EAGLE's LlamaRotaryEmbedding base when the config has none
}


def _rope_scaling(layer_config: Any) -> dict[str, Any] | None:
    params = dict(getattr(layer_config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") == "default":
        return None
    params.pop("rope_theta", None)
    return params


def _eagle3_reason(raw: dict[str, Any], names: set[str], hidden: int, fc_shape: tuple[int, ...] | None) -> str:
    """Why this folder is an EAGLE-3 head (empty when it is not one)."""
    architectures = " ".join(str(a) for a in raw.get("architectures") or [])
    if "eagle3" in architectures.lower():
        return f"architectures {raw.get('architectures')}"
    if any(name.startswith("midlayer.") for name in names):
        return "midlayer.* weights"
    if {"d2t", "t2d"} & names or "draft_vocab_size" in raw:
        return "a reduced draft vocabulary (d2t/t2d, draft_vocab_size)"
    if fc_shape is not None and len(fc_shape) == 2 and fc_shape[1] != 2 * hidden and fc_shape[1] % 3 == 0:
        return f"fc.weight {list(fc_shape)} (fused features of three target layers)"
    return ""


def load_published_head(folder: str | os.PathLike[str], model: Any) -> EagleHead:
    """Load a published EAGLE head folder for ``model`` (on its device and dtype).

    Reads SafeAILab's EAGLE-1/EAGLE-2 layout (:class:`PublishedEagleHead`), SafeAILab's / SpecForge's
    EAGLE-3 layout and vLLM's ``speculators`` layout (EAGLE-3, and EAGLE-1 heads): names and shapes
    are checked from the safetensors headers before any weight is read.

    Args:
        folder: a folder with ``config.json`` and ``model.safetensors`` (or a safetensors index).
        model: the target, a loaded Llama-layout transformers causal LM (or its ModelRunner).

    Raises:
        ModelNotFoundError: no such folder, or no weights in it.
        UnsafeCheckpointError: the folder holds only pickle weights (the message shows how to
            convert them to safetensors).
        ConfigurationError: the head does not fit the model (hidden size, vocabulary, layer
            shapes, feature layers), its files are unreadable, its weights are not its layout's, or
            it is a variant selfspec does not run.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"no EAGLE head folder at {os.fspath(folder)!r}")
    raw = _read_config(path)
    if raw.get("speculators_model_type") == "eagle":  # speculators' EAGLE-1 layout (issue 30)
        return _load_speculators_eagle1(path, model, raw)
    if "speculators_model_type" in raw:  # vLLM's speculators layout, EAGLE-3 (issue 30)
        from .speculators import load_speculators_head

        return load_speculators_head(path, model, raw)
    files = _weight_files(path)
    shapes = _weight_shapes(files)
    names = set(shapes)
    target_hidden = int(model.config.hidden_size)
    eagle3 = _eagle3_reason(raw, names, int(raw.get("hidden_size") or target_hidden), shapes.get("fc.weight"))
    if eagle3:  # SafeAILab / SpecForge EAGLE-3 (midlayer.*, three fused target layers)
        from .eagle3 import build_eagle3_head, read_safeailab_spec

        return build_eagle3_head(path, model, read_safeailab_spec(raw, model), files, shapes)
    return load_eagle1_tensors(path, model, raw, files, {name: name for name in names}, shapes)


def load_eagle1_tensors(
    path: Path,
    model: Any,
    raw: dict[str, Any],
    files: list[Path],
    stored: dict[str, str],
    stored_shapes: dict[str, tuple[int, ...]] | None = None,
) -> PublishedEagleHead:
    """Load an EAGLE-1 head whose weights are stored under ``stored[safeailab_name]``.

    Args:
        path: the folder (for messages).
        model: the target.
        raw: the layer's config (SafeAILab's ``config.json``, or a speculators ``transformer_layer_config``
            with ``bias``).
        files: the safetensors files.
        stored: SafeAILab's name of each weight -> the name it has in the files.
        stored_shapes: the headers' shapes by stored name (read when ``None``).
    """
    from transformers import LlamaConfig

    shapes_by_stored = stored_shapes if stored_shapes is not None else _weight_shapes(files)
    shapes = {name: shapes_by_stored[file_name] for name, file_name in stored.items()}
    names = set(shapes)
    target = model.config
    target_hidden, target_vocab = int(target.hidden_size), int(target.vocab_size)
    where = f"the EAGLE head in {path}"
    fc_shape = shapes.get("fc.weight")
    if fc_shape is None:
        raise ConfigurationError(
            f"{where} has no fc.weight: it is not an EAGLE-1/EAGLE-2 head (config.json + model.safetensors with "
            "fc.weight [H, 2H] and layers.0.*), nor a selfspec head (eagle_config.json, `selfspec train-eagle`)"
        )
    if raw.get("add_para_norm"):
        raise ConfigurationError(f"{where} normalises its inputs (add_para_norm, HASS); only EAGLE-1/2 heads load")

    # 1. the head must fit the target
    settings = {name: default if raw.get(name) is None else raw[name] for name, default in _CONFIG_DEFAULTS.items()}
    problems = []
    for name, theirs in (("hidden_size", target_hidden), ("vocab_size", target_vocab)):
        if settings[name] is None:
            settings[name] = theirs  # EAGLE's configs are copies of the target's; fc and the weights are checked below
        elif int(settings[name]) != theirs:
            problems.append(f"{name.replace('_', ' ')} {settings[name]} vs the model's {theirs}")
    if fc_shape != (target_hidden, 2 * target_hidden):
        problems.append(f"fc.weight {list(fc_shape)} vs [{target_hidden}, {2 * target_hidden}] for this model")
    for name in _SHARED_WEIGHTS:
        if name in shapes and shapes[name] != (target_vocab, target_hidden):
            problems.append(f"{name} {list(shapes[name])} vs the model's [{target_vocab}, {target_hidden}]")
    if problems:
        raise ConfigurationError(
            f"{where} does not fit this model: {'; '.join(problems)}. Use a head trained for this model, or train "
            "one with `selfspec train-eagle --model M`."
        )
    layers = sorted({n.split(".")[1] for n in names if n.startswith("layers.") and n.count(".") > 1})
    if layers != ["0"] or raw.get("num_hidden_layers", 1) != 1:
        raise ConfigurationError(
            f"{where} has decoder layers {layers or 'none'} (num_hidden_layers {raw.get('num_hidden_layers')}); "
            "selfspec drafts with one-layer EAGLE heads (layers.0)"
        )

    # 2. the head's own layer, from its config (EAGLE's defaults where a field is absent)
    for name in ("intermediate_size", "num_attention_heads"):
        if settings[name] is None:
            raise ConfigurationError(f"{path / PUBLISHED_CONFIG} has no {name}")
    settings["num_key_value_heads"] = settings["num_key_value_heads"] or settings["num_attention_heads"]
    qkv_bias = "layers.0.self_attn.q_proj.bias" in names
    mlp_bias = "layers.0.mlp.gate_proj.bias" in names
    fc_bias = "fc.bias" in names
    if "bias" in raw and bool(raw["bias"]) != fc_bias:
        raise ConfigurationError(
            f"{where}: config.json says bias={raw['bias']} but fc.bias is {'present' if fc_bias else 'absent'}"
        )
    implementation = getattr(target, "_attn_implementation", None)
    fields: dict[str, Any] = {
        **{name: settings[name] for name in _CONFIG_DEFAULTS},
        "rope_scaling": raw.get("rope_scaling"),  # EAGLE's own rotary: the head's rope_theta and rope_scaling
        "num_hidden_layers": 1,
        "attention_bias": qkv_bias,  # q/k/v biases (EAGLE's qkv_bias); o_proj's is set to zero below
        "mlp_bias": mlp_bias,
        "attn_implementation": implementation if implementation in ("eager", "sdpa") else "sdpa",
    }
    if raw.get("head_dim"):
        fields["head_dim"] = raw["head_dim"]
    try:
        layer_config = LlamaConfig(**fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(f"{path / PUBLISHED_CONFIG} does not describe a Llama layer ({exc})") from exc
    config = EagleHeadConfig(
        target=f"published EAGLE head {path.name}",
        model_type=str(target.model_type),
        hidden_size=target_hidden,
        vocab_size=target_vocab,
        num_target_layers=int(target.num_hidden_layers),
        feature_layers=[int(target.num_hidden_layers)],
        layer={},  # the layer is the head's own (from its config), not a copy of the target's
        training={"source": str(path), "architectures": raw.get("architectures")},
        format=PUBLISHED_FORMAT,
    )
    head = PublishedEagleHead(model, config, layer_config, fc_bias=fc_bias, source=str(path))

    # 3. the weights, by their published names
    expected = {f"layers.0.{name}" for name in _LAYER_WEIGHTS} | {"fc.weight"}
    missing = sorted(expected - names)
    unknown = sorted(names - set(_published_names(head).values()) - set(_SHARED_WEIGHTS) - set(_IGNORED_WEIGHTS))
    if missing or unknown:
        detail = "; ".join(([f"missing {missing}"] if missing else []) + ([f"unexpected {unknown}"] if unknown else []))
        raise ConfigurationError(f"{where} is not in the EAGLE-1 layout: {detail}")
    dtype = next(head.parameters()).dtype
    published = _published_names(head)
    state = eagle_files._read_weights(files, {stored[n] for n in published.values() if n in stored})
    loaded = {
        mine: state[stored[theirs]].to(dtype) for mine, theirs in published.items() if stored.get(theirs) in state
    }
    if qkv_bias and "layer.self_attn.o_proj.bias" not in loaded:  # EAGLE's o_proj has no bias
        loaded["layer.self_attn.o_proj.bias"] = torch.zeros_like(head.layer.self_attn.o_proj.bias)
    try:
        head.load_state_dict(loaded, strict=True)
    except RuntimeError as exc:
        raise ConfigurationError(f"the weights in {path} do not match its {PUBLISHED_CONFIG}: {exc}") from exc
    head.eval().requires_grad_(False)
    return head


def _load_speculators_eagle1(path: Path, model: Any, raw: dict[str, Any]) -> PublishedEagleHead:
    """A speculators ``eagle`` head (EAGLE-1/2, HASS without extra norms) through the EAGLE-1 loader.

    Names: ``fusion_fc.*`` -> ``fc.*``, ``transformer.*`` -> ``layers.0.*`` (speculators' ``EagleSpeculator``,
    before its removal in 792b9e6c); the layer config is ``transformer_layer_config``.
    """
    files = _weight_files(path)
    shapes = _weight_shapes(files)
    where = f"the EAGLE head in {path}"
    if raw.get("layernorms"):
        raise ConfigurationError(f"{where} uses layernorms=true (extra RMS norms): not supported by selfspec yet")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigurationError(f"{where}: config.json has no transformer_layer_config object")
    renamed = {_eagle1_name(name): name for name in shapes}
    if "fusion_fc.bias" in shapes and not raw.get("fusion_bias", False):
        raise ConfigurationError(f"{where}: fusion_fc.bias is present but fusion_bias is false")
    config = {**layer, "num_hidden_layers": 1, "bias": "fusion_fc.bias" in shapes}
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict):  # transformers 5 writes the rotary settings as rope_parameters
        config["rope_theta"] = rope.get("rope_theta", config.get("rope_theta"))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    return load_eagle1_tensors(path, model, config, files, renamed, shapes)


def _eagle1_name(name: str) -> str:
    """Speculators EAGLE-1 names -> SafeAILab's (``fusion_fc`` -> ``fc``, ``transformer.`` -> ``layers.0.``)."""
    if name.startswith("fusion_fc."):
        return "fc." + name[len("fusion_fc.") :]
    if name.startswith("transformer."):
        return "layers.0." + name[len("transformer.") :]
    return name


def _published_names(head: PublishedEagleHead) -> dict[str, str]:
    """The head's state-dict names -> their published names (``layer.*`` -> ``layers.0.*``)."""
    return {name: name.replace("layer.", "layers.0.", 1) for name in head.state_dict()}
