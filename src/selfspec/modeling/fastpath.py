"""A lean decoder-layer path for the Llama family, over the model's own weights.

At small and medium sizes a decoding step is bound by per-call overhead, not arithmetic: a
transformers decoder layer spends most of its time in module dispatch, keyword plumbing and
recomputed rotary tables. These functions compute exactly what transformers' Llama, Mistral,
Qwen2, Qwen3 and Phi-3 layers compute (same operations, same order, same dtypes: the RMSNorm
upcast, ``rotate_half`` rotary embedding, SDPA attention, gated SiLU MLP), reading the weights
of the model's own modules, so they need no copy of the model.

Used only for plain ``nn.Linear`` layers with SDPA attention; quantized (bitsandbytes)
layers, eager attention and other families run through the model's modules instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionPlan, attend, linear_rows

#: The environment variable that sets the fast path's default (``0`` turns it off).
FAST_PATH_ENV = "SELFSPEC_FAST_PATH"

#: model types whose decoder layers the lean path reproduces.
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass
class LayerWeights:
    """The tensors of one decoder layer, taken (not copied) from its modules."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: list[tuple[torch.Tensor, torch.Tensor | None]]  # (weight, bias) of q, k, v or fused qkv
    o_proj: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None]]  # gate and up, or fused gate_up
    down: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


def _linear(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def fast_path_default() -> bool:
    """Whether runners use the lean path when not told: on, unless ``SELFSPEC_FAST_PATH=0``.

    This is the one place the environment variable is read; ``ModelRunner(model, fast_path=...)``
    and ``SpeculativeEngine(..., fast_path=...)`` set it explicitly.
    """
    return os.environ.get(FAST_PATH_ENV, "1") != "0"


def build_fast_layers(model: Any) -> list[LayerWeights] | None:
    """The lean path's view of the model's layers, or ``None`` when it does not apply."""
    config = model.config
    if config.model_type not in FAST_MODEL_TYPES or config._attn_implementation != "sdpa":
        return None
    if getattr(config, "hidden_act", "silu") != "silu":
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if any(type(m) is not nn.Linear for m in (*_proj_modules(attn), *_proj_modules(mlp))):
            return None
        if hasattr(attn, "qkv_proj"):
            qkv = [_linear(attn.qkv_proj)]
        else:
            qkv = [_linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj)]
        gate_up = (
            [_linear(mlp.gate_up_proj)]
            if hasattr(mlp, "gate_up_proj")
            else [_linear(mlp.gate_proj), _linear(mlp.up_proj)]
        )
        q_norm = (attn.q_norm.weight, _eps(attn.q_norm)) if hasattr(attn, "q_norm") else None
        k_norm = (attn.k_norm.weight, _eps(attn.k_norm)) if hasattr(attn, "k_norm") else None
        head_dim = int(attn.head_dim)
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                input_eps=_eps(layer.input_layernorm),
                post_norm=layer.post_attention_layernorm.weight,
                post_eps=_eps(layer.post_attention_layernorm),
                qkv=qkv,
                o_proj=_linear(attn.o_proj),
                gate_up=gate_up,
                down=_linear(mlp.down_proj),
                q_norm=q_norm,
                k_norm=k_norm,
                num_heads=int(config.num_attention_heads),
                num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
                head_dim=head_dim,
                scaling=float(attn.scaling),
            )
        )
    return layers


def _proj_modules(parent: nn.Module) -> list[nn.Module]:
    return [m for name, m in parent.named_children() if name.endswith("proj")]


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Llama computes it: in float32, scaled in the input dtype."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; a partial one (Phi-3) rotates only the first ``cos.shape[-1]`` dims."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([(x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass], dim=-1)


def layer_forward(
    w: LayerWeights,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    plan: AttentionPlan,
    cache: Any,
    layer_idx: int,
) -> torch.Tensor:
    """One decoder layer: ``[m, q, hidden]`` -> ``[m, q, hidden]``, writing the layer's KV.

    ``plan`` says how the queries attend (:mod:`selfspec.modeling.attention`).
    """
    batch, q_len, _ = hidden.shape
    exact = plan.rows is not None  # batch-invariant rows: every op gives each row its decode bits

    def linear(x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        if plan.kernel_past is not None:  # the row-invariant Triton kernel: one call, each row its own bits
            from .kernels import linear as row_invariant_linear

            return row_invariant_linear(x, *weight_bias)
        return linear_rows(x, *weight_bias, exact)

    residual = hidden
    x = rms_norm(hidden, w.input_norm, w.input_eps)
    if len(w.qkv) == 1:
        qkv = linear(x, w.qkv[0])
        q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
        query, key, value = qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
    else:
        query, key, value = (linear(x, wb) for wb in w.qkv)
    query = query.view(batch, q_len, -1, w.head_dim)
    key = key.view(batch, q_len, -1, w.head_dim)
    if w.q_norm is not None and w.k_norm is not None:
        query = rms_norm(query, *w.q_norm)
        key = rms_norm(key, *w.k_norm)
    query, key = query.transpose(1, 2), key.transpose(1, 2)
    value = value.view(batch, q_len, -1, w.head_dim).transpose(1, 2)
    query, key = _rotary(query, cos, sin), _rotary(key, cos, sin)
    key, value = cache.update(key, value, layer_idx)
    attn = attend(query, key, value, plan, w.scaling, w.num_kv_heads != w.num_heads)
    attn = attn.transpose(1, 2).reshape(batch, q_len, -1)
    hidden = residual + linear(attn, w.o_proj)
    residual = hidden
    x = rms_norm(hidden, w.post_norm, w.post_eps)
    if len(w.gate_up) == 1:
        gate, up = linear(x, w.gate_up[0]).chunk(2, dim=-1)
    else:
        gate, up = (linear(x, wb) for wb in w.gate_up)
    return residual + linear(F.silu(gate) * up, w.down)
