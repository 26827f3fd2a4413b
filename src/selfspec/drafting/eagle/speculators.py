"""vLLM's ``speculators`` layout: read EAGLE-3 and EAGLE-1 heads from it, write EAGLE-3 heads to it.

A ``speculators`` folder (vllm-project/speculators, the format ``vllm serve <folder>`` runs) holds
``config.json`` and ``model.safetensors``. The config is a transformers config with:

- ``speculators_model_type``: ``"eagle3"`` (or ``"eagle"`` for EAGLE-1/HASS heads);
- ``architectures``: ``["Eagle3Speculator"]`` (``["EagleSpeculator", ...]``);
- ``transformer_layer_config``: the head's decoder layer (a Llama or Qwen3 config dict);
- ``speculators_config``: ``algorithm``, ``proposal_methods`` (``[{"proposal_type": "greedy",
  "speculative_tokens": k, ...}]``), ``default_proposal_method`` and ``verifier``
  (``name_or_path``, ``architectures``): the target the head drafts for;
- EAGLE-3: ``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (layer ``i``: the state *entering* target layer ``i``),
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``embed_requires_grad``;
- EAGLE-1: ``layernorms``, ``fusion_bias``, ``transformer_layer_architecture``.

EAGLE-3 weights: ``fc.weight``, ``layers.0.*`` (the layer: ``self_attn.{q,k,v}_proj`` read 2H,
``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``, ``mlp.*``), ``norm.weight``,
``lm_head.weight`` [draft vocab, H], ``d2t`` / ``t2d`` and, optionally, ``embed_tokens.weight``.
EAGLE-1 weights: ``fusion_fc.{weight,bias}`` and ``transformer.*`` (a decoder layer without its
input norm when ``layernorms`` is false).

Sources (read, never copied): speculators ``config.py``, ``models/eagle3/{config,core}.py``,
``models/eagle.py`` (before its removal in 792b9e6c), ``convert/eagle/eagle3_converter.py``; vLLM
``transformers_utils/configs/speculators/{base,algos}.py``. Where a field is absent the reader
takes vLLM's reading (``norm_before_residual`` true), since vLLM is what runs these folders.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ...artifacts import atomic_path, atomic_write_text, make_folder
from ...errors import ConfigurationError
from .eagle3 import Eagle3Head, Eagle3Spec, build_eagle3_head, default_feature_layers
from .head import EagleHead

#: The speculators model types selfspec reads.
SPECULATORS_TYPES = ("eagle3", "eagle")
#: The top-level fields of a speculators EAGLE-3 ``config.json`` (speculators ``Eagle3SpeculatorConfig``
#: and its ``SpeculatorModelConfig`` base; transformers' own ``PretrainedConfig`` fields come on top).
EAGLE3_FIELDS = (
    "speculators_model_type",
    "speculators_version",
    "speculators_config",
    "architectures",
    "transformer_layer_config",
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
)
#: The format version selfspec writes into ``speculators_version`` (the layout it follows).
SPECULATORS_VERSION = "0.9.0"


def _verifier(raw: dict[str, Any]) -> str:
    spec = raw.get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return str(name or "")


def _speculative_tokens(raw: dict[str, Any]) -> int | None:
    spec = raw.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if isinstance(methods, list) and methods and isinstance(methods[0], dict):
        tokens = methods[0].get("speculative_tokens")
        return int(tokens) if isinstance(tokens, int) else None
    return None


def read_speculators_spec(raw: dict[str, Any], model: Any, where: str) -> Eagle3Spec:
    """The :class:`~selfspec.drafting.eagle.eagle3.Eagle3Spec` of a speculators ``eagle3`` config (no weight read).

    Raises:
        ConfigurationError: the config lacks the layer config, or uses a variant selfspec does not run.
    """
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigurationError(f"{where}: config.json has no transformer_layer_config object")
    unsupported = [name for name in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(name)]
    if unsupported:
        raise ConfigurationError(
            f"{where} uses {', '.join(unsupported)}: these EAGLE-3 variants are not supported by selfspec yet"
        )
    if int(layer.get("num_hidden_layers", 1) or 1) != 1:
        raise ConfigurationError(
            f"{where} has {layer.get('num_hidden_layers')} decoder layers; selfspec runs one-layer EAGLE-3 heads"
        )
    num_layers = int(model.config.num_hidden_layers)
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(num_layers)
    extra: dict[str, Any] = {"speculative_tokens": _speculative_tokens(raw)}
    if raw.get("target_hidden_size") is not None:
        extra["target_hidden_size"] = raw["target_hidden_size"]
    return Eagle3Spec(
        layer_config=dict(layer),
        feature_layers=[int(i) for i in layers],
        draft_vocab_size=int(raw.get("draft_vocab_size", 32000)),  # speculators' default
        norm_before_residual=bool(raw.get("norm_before_residual", True)),  # vLLM's reading when absent
        prefix="layers.0.",
        layout="speculators",
        verifier=_verifier(raw),
        extra=extra,
    )


def load_speculators_head(path: Path, model: Any, raw: dict[str, Any]) -> EagleHead:
    """Load a head folder in the speculators layout (``eagle3``, or ``eagle`` without extra norms).

    Raises:
        ModelNotFoundError: no weights in the folder.
        UnsafeCheckpointError: pickle weights only.
        ConfigurationError: an unknown model type, a variant selfspec does not run, or a head that
            does not fit the model (names and shapes are checked from the headers first).
    """
    from .files import _weight_files, _weight_shapes

    where = f"the EAGLE head in {path}"
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigurationError(
            f"{where} is a speculators {kind!r} model; selfspec reads speculators types {', '.join(SPECULATORS_TYPES)}"
        )
    files = _weight_files(path)
    shapes = _weight_shapes(files)
    return build_eagle3_head(path, model, read_speculators_spec(raw, model, where), files, shapes)


# ----------------------------------------------------------------------------- writing
def speculators_config(
    head: Eagle3Head, verifier: str, verifier_architectures: list[str], tokens: int
) -> dict[str, Any]:
    """The ``config.json`` of ``head`` in the speculators ``eagle3`` layout (every published field set)."""
    spec = head.spec
    layer = {k: v for k, v in head.layer_config.to_diff_dict().items() if k not in ("_attn_implementation_autoset",)}
    layer.update(
        model_type=head.layer_config.model_type,
        hidden_size=int(head.layer_config.hidden_size),
        num_hidden_layers=1,
        vocab_size=head.head_config.vocab_size,
        head_dim=int(head.layer_config.head_dim),
        rms_norm_eps=float(head.layer_config.rms_norm_eps),
    )
    layer.pop("attn_implementation", None)
    layer.pop("_attn_implementation", None)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens), "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(spec.draft_vocab_size),
        "norm_before_residual": bool(spec.norm_before_residual),
        "target_hidden_size": int(head.head_config.hidden_size),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in head.spec.feature_layers],
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": "float16",
    }  # fmt: skip


def save_speculators_eagle3(
    head: Eagle3Head,
    folder: str | os.PathLike[str],
    *,
    verifier: str,
    verifier_architectures: list[str] | None = None,
    speculative_tokens: int | None = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write an EAGLE-3 head as a speculators folder (``config.json`` + ``model.safetensors``).

    Args:
        head: the loaded head.
        folder: where to write (created).
        verifier: the target's hub id or path, written as ``speculators_config.verifier.name_or_path``
            (what ``vllm serve <folder>`` loads as the target).
        verifier_architectures: the target's ``architectures``.
        speculative_tokens: the draft length vLLM uses (default: the folder's, else 3).
        dtype: the weights' dtype (the vocabulary maps stay integer / bool).

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    path = Path(folder).expanduser()
    make_folder(path)
    tensors = {
        name.replace("midlayer.", "layers.0.", 1): value.detach().to(dtype).cpu().contiguous()
        for name, value in head.published_state().items()
    }
    vocab = head.head_config.vocab_size
    ids = head.draft_token_ids
    if ids is None:
        ids = torch.arange(vocab)
    ids = ids.detach().cpu().to(torch.long)
    tensors["d2t"] = (ids - torch.arange(ids.numel())).contiguous()  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    with atomic_path(path / "model.safetensors") as partial:
        save_file(tensors, str(partial), metadata={"format": "pt"})
    tokens = speculative_tokens or head.spec.extra.get("speculative_tokens") or 3
    config = speculators_config(head, verifier, verifier_architectures or [], int(tokens))
    atomic_write_text(path / "config.json", json.dumps(config, indent=2) + "\n")
    return path
