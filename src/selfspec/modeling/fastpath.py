"""A lean decoder-layer path for the Llama family, over the model's own weights.

At small and medium sizes a decoding step is bound by per-call overhead, not arithmetic: a
transformers decoder layer spends most of its time in module dispatch, keyword plumbing and
recomputed rotary tables. These functions compute exactly what transformers' Llama, Mistral,
Qwen2, Qwen3 and Phi-3 layers compute (same operations, same order, same dtypes: the RMSNorm
upcast, ``rotate_half`` rotary embedding, SDPA attention, gated SiLU MLP), reading the weights
of the model's own modules, so they need no copy of the model.

Projections: a plain ``nn.Linear`` is read as its weight and bias (``F.linear``, unchanged); a
subclass of it (bitsandbytes' ``Linear4bit`` and ``Linear8bitLt``, whose ``weight`` is packed) is
called as a module, ``module(x)``, as transformers' layer calls it (:data:`Projection`; bit-identical
to the model's modules in float32, tested). So a quantized target runs the lean path too, and with
it the static round, at the widths where its kernels give a row of a block the bits it gets alone
(:func:`row_invariant_widths`, :func:`~selfspec.modeling.static_step.exact_widths`; measured on
this CPU: NF4 at every width 1-33, 8-bit at width 1 only). The row-invariant Triton kernels read
weights, so they refuse such a module (:class:`~selfspec.errors.ConfigurationError`); a
row-exact forward (half precision) calls it one row at a time.

Eager attention and other families run through the model's modules instead.

**Fused projections** (:func:`fuse_projections`): q/k/v and gate/up can be read as one weight each
(one GEMV instead of three and two: fewer launches, a longer contiguous read), the modules'
weights becoming views of it, so no weight is held twice. A runner does it on CUDA, and only where
a fused call gives every output column the bits the separate calls give it
(:func:`fusion_keeps_bits`, probed per shape and dtype): so the text does not change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError
from .attention import AttentionPlan, attend, cancelling_rows, cancelling_weight, linear_rows

#: The environment variable that sets the fast path's default (``0`` turns it off).
FAST_PATH_ENV = "SELFSPEC_FAST_PATH"

#: model types whose decoder layers the lean path reproduces.
FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


#: One projection of a layer: a plain ``nn.Linear``'s ``(weight, bias)``, or a module called as it is
#: (a quantized linear layer, whose ``weight`` is not the matrix it multiplies by).
Projection = tuple[torch.Tensor, torch.Tensor | None] | nn.Linear


@dataclass
class LayerWeights:
    """The tensors of one decoder layer, taken (not copied) from its modules."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: list[Projection]  # q, k, v or fused qkv
    o_proj: Projection
    gate_up: list[Projection]  # gate and up, or fused gate_up
    down: Projection
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float

    @property
    def modules(self) -> list[nn.Linear]:
        """The projections called as modules (quantized ones); empty for plain ``nn.Linear`` layers."""
        return [p for p in (*self.qkv, self.o_proj, *self.gate_up, self.down) if isinstance(p, nn.Linear)]


def _linear(module: nn.Linear) -> Projection:
    """A plain ``nn.Linear`` as its ``(weight, bias)``; a subclass (a quantized layer) as itself."""
    if type(module) is nn.Linear:
        return module.weight, module.bias
    return module


def row_invariant_widths(module: nn.Linear, dtype: torch.dtype, widths: tuple[int, ...]) -> tuple[int, ...]:
    """The leading ``widths`` at which ``module`` gives each row of a block the bits it gets alone.

    For a projection called as a module (a quantized one: its weight cannot be swapped for
    :func:`~selfspec.modeling.attention.linear_is_row_invariant`'s cancelling probe), so the probe
    is the module's own weight on random ``dtype`` rows, every other one with large entries in a
    quarter of its columns (bitsandbytes' 8-bit matmul takes a column out of the int8 product when
    any row of the block has an entry over its threshold, 6.0, so a block's rows then differ from
    the rows alone). Each row is computed alone, then the block of each width in turn (ascending);
    the widths up to the first block that differs are returned (width 1 always holds).

    Measured on this CPU (bitsandbytes 0.50.2, an Intel Xeon with AVX512-BF16, one thread;
    ``kernels-community``'s kernel not loaded, so bitsandbytes' own packed kernel ran): NF4
    ``Linear4bit`` (compute dtype float32 or bfloat16; bitsandbytes computes in bfloat16 there) is
    row-invariant at every width 1-33, on 64x128 to 4096x1024 weights; ``Linear8bitLt`` (threshold
    6.0) is row-invariant only while no entry passes the threshold: with one, every row of a block of
    2-33 rows differed from its row alone.
    """
    in_features = module.in_features
    device = next(iter(module.parameters())).device
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        rows = torch.randn(max(widths), in_features, generator=generator, device=device)
        rows[1::2, :: max(1, in_features // 4)] *= 16  # large entries in every other row
        block = rows.to(dtype)[None]  # [1, n, in]
        alone = torch.cat([module(block[:, i : i + 1]) for i in range(block.shape[1])], dim=1)
        kept: list[int] = []
        for width in sorted(widths):
            if width > 1 and not torch.equal(module(block[:, :width]), alone[:, :width]):
                break
            kept.append(width)
    return tuple(kept)


_FUSION_KEEPS_BITS: dict[tuple[Any, ...], bool] = {}

#: the verify widths :func:`fusion_keeps_bits` checks (a decode, and chain verifies of 1-32 drafts)
FUSION_PROBE_WIDTHS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 33)


def fusion_keeps_bits(
    weights: list[torch.Tensor], biases: list[torch.Tensor | None], widths: tuple[int, ...] = FUSION_PROBE_WIDTHS
) -> bool:
    """Whether ``F.linear`` over the weights concatenated gives each output the bits the separate calls give it.

    A GEMM library may choose its kernel, tiling or split-K by the number of output columns, and
    then a column's sum runs in another order. Probed once per shapes, dtype and device (cached),
    at every width of ``widths``, with the cancelling probe that
    :func:`~selfspec.modeling.attention.linear_is_row_invariant` uses
    (:func:`~selfspec.modeling.attention.cancelling_weight`, :func:`~selfspec.modeling.attention.cancelling_rows`).
    """
    first = weights[0]
    has_bias = biases[0] is not None
    key = (tuple(tuple(w.shape) for w in weights), first.dtype, first.device.type, has_bias, widths)
    if key not in _FUSION_KEEPS_BITS:
        generator = torch.Generator(device=first.device).manual_seed(0)
        with torch.no_grad():
            probes = [cancelling_weight(weight, generator) for weight in weights]
            rows = cancelling_rows(max(widths), first, generator)
            zeros = [None if not has_bias else torch.zeros(p.shape[0], dtype=p.dtype, device=p.device) for p in probes]
            fused = torch.cat(probes)
            fused_bias = torch.cat(zeros) if has_bias else None  # type: ignore[arg-type]
            keeps = True
            for width in widths:
                apart = torch.cat([F.linear(rows[:width], p, b) for p, b in zip(probes, zeros, strict=True)], dim=-1)
                if not torch.equal(F.linear(rows[:width], fused, fused_bias), apart):
                    keeps = False
                    break
            _FUSION_KEEPS_BITS[key] = keeps
    return _FUSION_KEEPS_BITS[key]


def _fused(modules: list[nn.Linear]) -> Projection | None:
    """One ``(weight, bias)`` over ``modules``' weights, the modules' own weights becoming views of it.

    ``modules`` are plain ``nn.Linear`` layers; ``None`` where they cannot be fused (mixed dtypes,
    devices, input sizes or biases). Fusing the same modules again (a second runner on the model)
    returns the same tensor, and copies nothing: their weights are already consecutive views of one.
    """
    weights = [m.weight for m in modules]
    biases = [m.bias for m in modules]
    first = weights[0]
    if any(w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1] for w in weights):
        return None
    if any((b is None) != (biases[0] is None) for b in biases):
        return None
    base = first.untyped_storage()
    offset = first.storage_offset()
    starts = [0, *accumulate(w.shape[0] for w in weights)]  # each weight's first row, then the total
    rows = starts[-1]
    consecutive = all(w.is_contiguous() for w in weights) and all(
        w.untyped_storage().data_ptr() == base.data_ptr() and w.storage_offset() == offset + start * first.shape[1]
        for w, start in zip(weights, starts, strict=False)
    )
    with torch.no_grad():
        if consecutive:  # fused before: the views' common tensor
            weight = first.new_empty(0).set_(base, offset, (rows, first.shape[1]), (first.shape[1], 1))
        else:
            weight = torch.cat([w.detach() for w in weights])
            for module, start, end in zip(modules, starts, starts[1:], strict=False):
                module.weight.data = weight[start:end]  # a view: the weight is held once
        bias = None
        if biases[0] is not None:
            bias = torch.cat([b.detach() for b in biases if b is not None])
    return weight, bias


def fuse_projections(model: Any, layers: list[LayerWeights], widths: tuple[int, ...] = FUSION_PROBE_WIDTHS) -> int:
    """Read each layer's q/k/v and gate/up as one weight each, where that keeps every output's bits.

    The model's ``q_proj`` / ``k_proj`` / ``v_proj`` (and ``gate_proj`` / ``up_proj``) weights
    become views of one concatenated weight, so nothing is held twice and transformers' own
    forward reads the same values; ``layers`` is updated in place to read the fused weight.
    Only plain ``nn.Linear`` layers are fused, and only where :func:`fusion_keeps_bits` holds for
    the shapes at ``widths``. Returns the number of projections fused (a layer's q/k/v counts one).
    """
    fused = 0
    for layer, w in zip(model.model.layers, layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        groups = []
        if len(w.qkv) == 3 and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
            groups.append(("qkv", [attn.q_proj, attn.k_proj, attn.v_proj]))
        if len(w.gate_up) == 2 and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
            groups.append(("gate_up", [mlp.gate_proj, mlp.up_proj]))
        for name, modules in groups:
            if any(type(m) is not nn.Linear for m in modules):
                continue
            if not fusion_keeps_bits([m.weight for m in modules], [m.bias for m in modules], widths):
                continue
            projection = _fused(modules)
            if projection is None:
                continue
            setattr(w, name, [projection])
            fused += 1
    return fused


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
        if not all(isinstance(m, nn.Linear) for m in _projections(layer)):  # plain, or quantized (a subclass)
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


def _projections(layer: Any) -> list[nn.Module]:
    return [m for part in (layer.self_attn, layer.mlp) for name, m in part.named_children() if name.endswith("proj")]


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

    def linear(x: torch.Tensor, projection: Projection) -> torch.Tensor:
        if isinstance(projection, nn.Linear):  # a quantized layer: called as transformers' layer calls it
            if plan.kernel_past is not None:
                raise ConfigurationError("the row-invariant kernels need plain nn.Linear layers, not quantized ones")
            if exact and x.shape[-2] > 1:  # each position the bits it gets alone
                return torch.cat([projection(x[..., i : i + 1, :]) for i in range(x.shape[-2])], dim=-2)
            out: torch.Tensor = projection(x)
            return out
        if plan.kernel_past is not None:  # the row-invariant Triton kernel: one call, each row its own bits
            from .kernels import linear as row_invariant_linear

            return row_invariant_linear(x, *projection)
        return linear_rows(x, *projection, exact)

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
