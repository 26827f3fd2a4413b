"""The model runner: everything architecture-specific, behind one small interface.

The decoding loop never touches ``model.model.layers`` directly. It asks the runner to
embed tokens, run a range of decoder layers (``run_layers(hidden, start, end, ...)``: the
"early" forward is ``[0, E)`` and the "remainder" forward is ``[E, L)``, as in LayerSkip),
and turn hidden states into logits through the shared final norm and LM head.

One layer loop serves every forward: :meth:`ModelRunner.run_rows` runs layers for
``[rows, positions]`` over a batched cache, and :meth:`ModelRunner.run_layers` is the same loop
for one row (with token-tree attention when asked).

The runner builds attention masks itself, from the query positions (slot ``j`` of a row holds
position ``j``), one mask per layer type (full or sliding-window attention). transformers' own
mask helpers read the past length from layer 0 of the cache, which is wrong while the shallow
layers run ahead of the deep ones in an early-exit round.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core.tree import TreeMask
from ..errors import ConfigurationError, UnsupportedArchitectureError
from .argmax_head import ArgmaxHead
from .attention import (
    FULL,
    PREFILL,
    AttentionPlan,
    RowCalls,
    chain_rows,
    format_mask,
    linear_rows,
    row_exact_default,
    tree_rows,
)
from .cache import BatchedKVCache, StaticKVCache
from .compat import cache_kwargs
from .fastpath import build_fast_layers, fast_path_default, fuse_projections, layer_forward
from .kernels import linear as row_invariant_linear
from .kernels import uses_row_invariant_kernels

logger = logging.getLogger(__name__)

#: transformers ``model_type`` values selfspec runs, and the families they cover.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama 2/3, TinyLlama, SmolLM/SmolLM2, LayerSkip checkpoints",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "gemma": "Gemma",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def check_architecture(config: Any) -> None:
    """Raise :class:`UnsupportedArchitectureError` unless selfspec runs ``config``'s architecture."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported by selfspec; supported architectures: "
            f"{supported}. Use one of these, or decode this model with transformers' generate."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitectureError(
            "models with use_bidirectional_attention=True are not causal LMs and are not supported"
        )


def check_decoder_layout(model: Any, what: str) -> None:
    """Raise :class:`ConfigurationError` unless ``model`` has the layout the runner drives.

    That is the Llama layout: ``model.model.embed_tokens / layers / norm / rotary_emb`` and
    ``model.lm_head``; ``what`` names who needs it, for the message.
    """
    base = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, name) for name in needed) or not hasattr(model, "lm_head"):
        raise ConfigurationError(
            f"{what} needs a decoder-only model with model.embed_tokens, layers, norm, rotary_emb and "
            f"lm_head (the Llama layout); {type(model).__name__} has another layout"
        )


def runner_for(model: Any, what: str = "selfspec") -> ModelRunner:
    """``model``'s runner: a :class:`ModelRunner` as it is; a transformers model gets one (no fast path).

    Raises:
        ConfigurationError: ``model`` does not have the layout the runner drives (:func:`check_decoder_layout`).
    """
    if isinstance(model, ModelRunner):
        return model
    check_decoder_layout(model, what)
    return ModelRunner(model, fast_path=False)


class ModelRunner:
    """Drives a transformers causal LM layer by layer.

    Args:
        model: a loaded ``*ForCausalLM`` of a supported architecture (any dtype, device,
            or bitsandbytes quantization: the runner calls a quantized layer's own module).
        fast_path: use the lean layer path (:mod:`selfspec.modeling.fastpath`) where it
            applies; ``None`` reads the default (:func:`~selfspec.modeling.fastpath.fast_path_default`).
        fuse: read q/k/v and gate/up as one weight each on the lean path, the modules' weights
            becoming views of it, wherever that keeps every output's bits
            (:func:`~selfspec.modeling.fastpath.fuse_projections`); ``None``: on CUDA only.
    """

    def __init__(self, model: Any, *, fast_path: bool | None = None, fuse: bool | None = None) -> None:
        config = model.config
        check_architecture(config)
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in ("sdpa", "eager"):
            raise ConfigurationError(
                f"attention implementation {attn!r} is not supported; load the model with "
                "attn_implementation='sdpa' (or 'eager')"
            )
        self.model = model
        self.config = config
        self.attn_implementation = attn
        base = model.model
        self.embed_tokens: nn.Module = base.embed_tokens
        self.layers: Sequence[nn.Module] = base.layers
        self.norm: nn.Module = base.norm
        self.lm_head: nn.Module = model.lm_head
        self.rotary_emb: nn.Module = base.rotary_emb
        self.num_layers: int = len(self.layers)
        self.vocab_size: int = int(config.vocab_size)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)
        self.sliding_window: int | None = getattr(config, "sliding_window", None)
        self.layer_types: list[str] = self._layer_types(config)
        self._rotary_per_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        weight = self.embed_tokens.weight
        self.device: torch.device = weight.device
        self.dtype: torch.dtype = weight.dtype
        # the lean layer path (same maths, less overhead)
        enabled = fast_path_default() if fast_path is None else fast_path
        self.fast_layers = build_fast_layers(model) if enabled else None
        #: projections read as one fused weight (a layer's q/k/v counts one, its gate/up another)
        self.fused_projections: int = 0
        if self.device.type == "cuda" if fuse is None else fuse:
            self.fuse()
        #: verify rows attend one query per call, each with a decode's call (batch-invariant
        #: attention, :mod:`selfspec.modeling.attention`): on by default in half precision.
        self.row_exact: bool = row_exact_default(self.dtype)
        #: greedy steps that need only the argmax take it from :class:`ArgmaxHead` (a float32 head
        #: on a CPU with native bf16; exact, cheaper); ``False`` always runs the full head.
        self.argmax_screen: bool = True
        self._argmax_head: ArgmaxHead | None = None
        #: every forward through the row-invariant Triton kernels (:mod:`selfspec.modeling.kernels`)
        self.row_kernels: bool = False
        if uses_row_invariant_kernels(model):
            self.use_row_kernels(True)
        self._argmax_built = False

    def fuse(self) -> int:
        """Read each layer's q/k/v and gate/up as one weight each on the lean path, where the bits hold.

        The model's weights become views of the fused ones (nothing is held twice); a projection
        whose fused call would change an output's bits stays apart
        (:func:`~selfspec.modeling.fastpath.fuse_projections`). Returns :attr:`fused_projections`.
        Call it before the first forward: compiled steps traced earlier read the separate weights.
        """
        if self.fast_layers is not None:
            fused = fuse_projections(self.model, self.fast_layers)
            self.fused_projections += fused
            logger.info("fused %d q/k/v and gate/up groups of %d layers into one weight each", fused, self.num_layers)
        return self.fused_projections

    def row_kernels_refusal(self) -> str | None:
        """What the row-invariant kernels need that this model lacks, or ``None`` when they cover it."""
        if self.fast_layers is None:
            return "the lean path (Llama-family, attn_implementation='sdpa', plain nn.Linear layers)"
        if any(w.modules for w in self.fast_layers):  # the kernels read weights; a quantized layer's is packed
            return "plain nn.Linear layers (not quantized ones)"
        if SLIDING_ATTENTION in self.layer_types and self.sliding_window is not None:
            return "no sliding-window layers"
        if type(self.lm_head) is not nn.Linear:
            return "a plain nn.Linear LM head"
        return None

    def use_row_kernels(self, enabled: bool) -> None:
        """Run (or stop running) every forward through the row-invariant kernels (:attr:`row_kernels`).

        Raises:
            ConfigurationError: the kernels do not cover this model yet (:meth:`row_kernels_refusal`).
            MissingDependencyError: triton is not installed.
        """
        reason = self.row_kernels_refusal() if enabled else None
        if reason is not None:
            raise ConfigurationError(f"the row-invariant kernels need {reason}")
        if enabled:
            from .kernels.launch import triton_code

            triton_code()  # loaded now: a missing triton is said here, and compiled steps read a global
        self.row_kernels = enabled

    def __repr__(self) -> str:
        return (
            f"ModelRunner(model_type={self.config.model_type!r}, num_layers={self.num_layers}, "
            f"layer_types={sorted(set(self.layer_types))}, attn={self.attn_implementation!r}, "
            f"fast_path={self.fast_layers is not None}, fused_projections={self.fused_projections})"
        )

    def _layer_types(self, config: Any) -> list[str]:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            kind = SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION
            layer_types = [kind] * self.num_layers
        if set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
            raise UnsupportedArchitectureError(f"unsupported layer types {sorted(set(layer_types))}")
        if SLIDING_ATTENTION in layer_types and self.sliding_window is None:
            raise UnsupportedArchitectureError("sliding-attention layers without config.sliding_window")
        return list(layer_types)

    def new_cache(self, max_length: int) -> StaticKVCache:
        """A cache for one generation of at most ``max_length`` positions."""
        return StaticKVCache(self.num_layers, max_length)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[1, q]`` token ids -> ``[1, q, hidden]`` input states."""
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """``[1, q, hidden]`` states -> ``[q, vocab]`` float32 logits (final norm + LM head).

        Logits are cast to float32 as transformers' ``generate`` does before choosing a token.
        ``argmax_only``: see :meth:`row_logits`.
        """
        return self.row_logits(hidden, argmax_only)[0]

    @property
    def argmax_head(self) -> ArgmaxHead | None:
        """The exact-argmax head (:mod:`selfspec.modeling.argmax_head`), built on first use, or ``None``."""
        if not self._argmax_built:
            self._argmax_built = True
            self._argmax_head = ArgmaxHead.build(self.lm_head) if self.final_logit_softcapping is None else None
        return self._argmax_head

    def row_logits(self, hidden: torch.Tensor, argmax_only: bool = False) -> torch.Tensor:
        """``[m, q, hidden]`` -> ``[m, q, vocab]`` float32 logits (final norm, LM head, softcap).

        With :attr:`row_kernels`, the head runs through the row-invariant kernel (no screen).
        Otherwise, with :attr:`row_exact`, a plain LM head whose weight is not row-invariant runs one
        position at a time for one row (each position gets the bits a one-token decode gets;
        batched rows are not made exact). With ``argmax_only`` (a greedy step whose logits only
        an argmax reads: no grammar mask, no log-probabilities) and :attr:`argmax_screen`, the
        :class:`ArgmaxHead` answers where it applies: exact logits at the few candidates for
        the maximum, ``-inf`` elsewhere.
        """
        normed = self.norm(hidden)
        head = self.lm_head
        if self.row_kernels and isinstance(head, nn.Linear):  # a plain nn.Linear (checked at construction)
            return self.softcap(row_invariant_linear(normed, head.weight, head.bias)).float()
        screen = self.argmax_head if argmax_only and self.argmax_screen else None
        if screen is not None:
            return screen.logits(normed)
        if self.row_exact and type(head) is nn.Linear and normed.shape[0] == 1 and normed.shape[-2] > 1:
            logits = linear_rows(normed, head.weight, head.bias, exact_rows=True)
        else:
            logits = head(normed)
        return self.softcap(logits).float()

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's final logit soft-capping (``cap * tanh(logits / cap)``), when it has one."""
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        cache: StaticKVCache,
        tree: TreeMask | None = None,
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """Run decoder layers ``[start, end)`` on one row's new positions, writing their KV to ``cache``.

        Args:
            hidden: ``[1, q, hidden]`` input states of the new positions.
            start: first layer to run.
            end: one past the last layer to run.
            positions: ``[q]`` absolute positions of the new states; in a chain they follow
                the cached positions of layer ``start`` directly.
            cache: the generation's cache; every layer in the range must hold the same length.
            tree: for token-tree nodes (:mod:`selfspec.core.tree`): which of the tree nodes at the
                end of the cache each query sees; ``None`` is plain causal attention.
            capture: (EAGLE-3 feature taps) layer ids ``i`` whose *input* states (the residual
                stream entering layer ``i``; ``i == end`` is the last layer's output before the
                final norm) are stored into this dict as the layers run: no extra computation.

        Returns:
            ``[1, q, hidden]`` output states of layer ``end - 1``.
        """
        if start >= end:
            return hidden
        position_ids = positions.unsqueeze(0)  # [1, q]
        cached = cache.lengths[start]
        kv_length = cached + positions.shape[0]  # a chain's slot j holds position j
        if tree is not None:
            plans = self._tree_plans(positions, kv_length, hidden.dtype, tree)
        elif cached == 0 and positions.shape[0] > 1:
            plans = self._prefill_plans(position_ids, kv_length, hidden.dtype)
        else:
            plans = self._chain_plans(position_ids, kv_length, hidden.dtype)
        return self._forward(hidden, start, end, position_ids, plans, cache, capture)

    def run_rows(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        cache: BatchedKVCache,
        row_start: int = 0,
    ) -> torch.Tensor:
        """Run layers ``[start, end)`` for rows ``row_start .. row_start + m`` at per-row positions.

        Args:
            hidden: ``[m, q, hidden]`` input states.
            start: first layer to run.
            end: one past the last layer to run.
            positions: ``[m, q]`` absolute positions (each row's own, consecutive).
            cache: the batched cache; the new states are written at their positions.
            row_start: the cache row of the first input row.

        Returns:
            ``[m, q, hidden]`` output states of layer ``end - 1``.
        """
        if start >= end:
            return hidden
        if self.row_kernels:
            raise ConfigurationError("batched generation does not run through the row-invariant kernels yet")
        kv_length = int(positions.max()) + 1
        cache.select(row_start, positions, kv_length)
        if positions.shape[0] == 1 and kv_length == positions.shape[1] > 1:  # one row from slot 0: a prefill
            plans = self._prefill_plans(positions, kv_length, hidden.dtype)
        else:
            plans = self._masked_plans(self.causal_masks(positions, kv_length, hidden.dtype))
        return self._forward(hidden, start, end, positions, plans, cache)

    def _forward(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        position_ids: torch.Tensor,
        plans: dict[str, AttentionPlan],
        cache: Any,
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """The layer loop: ``[m, q, hidden]`` through layers ``[start, end)`` at ``[m, q]`` positions."""
        rotary = self._rotary(hidden, position_ids, {self.layer_types[i] for i in range(start, end)})
        if self.fast_layers is not None:
            fast = self.fast_layers
            # [m, q, head_dim] -> [m, 1, q, head_dim], broadcast over heads
            cos_sin = {t: (cos.unsqueeze(1), sin.unsqueeze(1)) for t, (cos, sin) in rotary.items()}
            for i in range(start, end):
                if capture is not None and i in capture:  # EAGLE-3 tap: the state entering layer i
                    capture[i] = hidden
                cos, sin = cos_sin[self.layer_types[i]]
                hidden = layer_forward(fast[i], hidden, cos, sin, plans[self.layer_types[i]], cache, i)
            if capture is not None and end in capture:  # EAGLE-3 tap: the last layer's output
                capture[end] = hidden
            return hidden
        for i in range(start, end):
            if capture is not None and i in capture:  # EAGLE-3 tap: the state entering layer i
                capture[i] = hidden
            layer_type = self.layer_types[i]
            hidden = self.layers[i](
                hidden,
                attention_mask=plans[layer_type].mask,
                position_ids=position_ids,
                use_cache=True,
                position_embeddings=rotary[layer_type],
                **cache_kwargs(self.layers[i], cache),
            )
        if capture is not None and end in capture:  # EAGLE-3 tap: the last layer's output
            capture[end] = hidden
        return hidden

    def rotary(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, layer_type: str = FULL_ATTENTION
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's rotary ``(cos, sin)`` at ``[m, q]`` ``position_ids`` for layers of ``layer_type``."""
        if self._rotary_per_type:
            per_type: tuple[torch.Tensor, torch.Tensor] = self.rotary_emb(hidden, position_ids, layer_type)
            return per_type
        shared: tuple[torch.Tensor, torch.Tensor] = self.rotary_emb(hidden, position_ids)
        return shared

    def _rotary(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, layer_types: set[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._rotary_per_type:
            return {t: self.rotary(hidden, position_ids, t) for t in layer_types}
        return dict.fromkeys(layer_types, self.rotary(hidden, position_ids))

    def _masked_plans(self, masks: dict[str, torch.Tensor | None]) -> dict[str, AttentionPlan]:
        return {t: FULL if mask is None else AttentionPlan(mask=mask) for t, mask in masks.items()}

    def _windowed(self, layer_type: str, kv_length: int) -> bool:
        """Whether layers of this type hide some of ``kv_length`` slots behind a sliding window."""
        return layer_type == SLIDING_ATTENTION and self.sliding_window is not None and kv_length > self.sliding_window

    def _prefill_plans(self, positions: torch.Tensor, kv_length: int, dtype: torch.dtype) -> dict[str, AttentionPlan]:
        """One row's prompt from slot 0: ``is_causal`` attention, the call transformers' ``generate`` makes.

        The module path passes no mask to transformers' SDPA layers (they then use ``is_causal``
        themselves); eager attention and windowed layers keep an explicit mask.
        """
        if self.row_kernels:
            return dict.fromkeys(set(self.layer_types), AttentionPlan(kernel_past=0))
        plans: dict[str, AttentionPlan] = {}
        masks: dict[str, torch.Tensor | None] | None = None
        for layer_type in set(self.layer_types):
            windowed = self._windowed(layer_type, kv_length)
            if not windowed and (self.fast_layers is not None or self.attn_implementation == "sdpa"):
                plans[layer_type] = PREFILL
                continue
            if masks is None:
                masks = self.causal_masks(positions, kv_length, dtype)
            plans[layer_type] = AttentionPlan(mask=masks[layer_type])
        return plans

    def _chain_plans(self, position_ids: torch.Tensor, kv_length: int, dtype: torch.dtype) -> dict[str, AttentionPlan]:
        """One row's ``q`` new positions after its cached ones (a decode when ``q == 1``).

        Half precision on the fast path: one decode-identical call per row
        (:func:`~selfspec.modeling.attention.chain_rows`); on CUDA otherwise bottom-right causal
        attention without a mask; else an explicit mask.
        """
        num_queries = position_ids.shape[1]
        if self.row_kernels:  # decode and verify alike: each row over its own keys
            return dict.fromkeys(set(self.layer_types), AttentionPlan(kernel_past=kv_length - num_queries))
        masks: dict[str, torch.Tensor | None] | None = None
        plans: dict[str, AttentionPlan] = {}
        for layer_type in set(self.layer_types):
            windowed = self._windowed(layer_type, kv_length)
            if num_queries == 1 and not windowed:
                plans[layer_type] = FULL
            elif self.fast_layers is not None and not windowed and self.row_exact:
                plans[layer_type] = AttentionPlan(rows=chain_rows(kv_length, num_queries))
            elif self.fast_layers is not None and not windowed and self.device.type == "cuda":
                plans[layer_type] = AttentionPlan(lower_right=True)
            else:
                if masks is None:
                    masks = self.causal_masks(position_ids, kv_length, dtype)
                plans[layer_type] = AttentionPlan(mask=masks[layer_type])
        return plans

    def _tree_plans(
        self, positions: torch.Tensor, kv_length: int, dtype: torch.dtype, tree: TreeMask
    ) -> dict[str, AttentionPlan]:
        """Tree nodes: a mask, or (half precision, fast path) one decode-identical call per node."""
        if self.row_kernels:
            raise ConfigurationError("token trees do not run through the row-invariant kernels yet (use a chain)")
        masks = self._tree_masks(positions, kv_length, dtype, tree)
        rows: RowCalls | None = None
        plans: dict[str, AttentionPlan] = {}
        for layer_type, mask in masks.items():
            if self.fast_layers is not None and self.row_exact and not self._windowed(layer_type, kv_length):
                if rows is None:
                    rows = tree_rows(tree.allowed.tolist(), kv_length - tree.allowed.shape[1])  # one host read
                plans[layer_type] = AttentionPlan(rows=rows)
            else:
                plans[layer_type] = AttentionPlan(mask=mask)
        return plans

    def causal_masks(
        self, positions: torch.Tensor, kv_length: int, dtype: torch.dtype
    ) -> dict[str, torch.Tensor | None]:
        """One ``[m, 1, q, kv]`` mask per layer type: query ``(b, i)`` sees slots ``<= positions[b, i]``.

        Slot ``j`` holds position ``j``, so this is the causal rule per row, whatever the rows'
        lengths (``kv_length`` is the largest position + 1); sliding-window layers also hide
        slots ``<= position - window``. One row's single query over every slot needs no mask
        (``None``).
        """
        windowed_kv = self.sliding_window is not None and kv_length > self.sliding_window
        if positions.shape == (1, 1) and not windowed_kv:
            return dict.fromkeys(self.layer_types)  # one query over every cached key: no mask
        slots = torch.arange(kv_length, device=positions.device)  # [kv]
        query = positions[:, :, None]  # [m, q, 1]
        causal = slots[None, None, :] <= query  # [m, q, kv]
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in set(self.layer_types):
            windowed = layer_type == SLIDING_ATTENTION and windowed_kv
            if positions.shape == (1, 1) and not windowed:
                masks[layer_type] = None
                continue
            allowed = causal
            if windowed:
                assert self.sliding_window is not None
                allowed = allowed & (slots[None, None, :] > query - self.sliding_window)
            masks[layer_type] = self._format_mask(allowed[:, None], dtype)  # [m, 1, q, kv]
        return masks

    def _tree_masks(
        self, positions: torch.Tensor, kv_len: int, dtype: torch.dtype, tree: TreeMask
    ) -> dict[str, torch.Tensor | None]:
        """Masks for tree nodes: the committed text (slot = position) plus the allowed tree keys."""
        base = kv_len - tree.allowed.shape[1]  # committed positions before the tree nodes
        device = positions.device
        # [q, kv]: every committed key, then the tree keys each query may see
        allowed = torch.cat([tree.allowed.new_ones(positions.shape[0], base), tree.allowed], dim=1)
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in set(self.layer_types):
            layer_allowed = allowed
            if layer_type == SLIDING_ATTENTION:
                assert self.sliding_window is not None
                kv_positions = torch.cat([torch.arange(base, device=device), tree.key_positions])  # [kv]
                layer_allowed = allowed & (kv_positions[None, :] > positions[:, None] - self.sliding_window)
            masks[layer_type] = self._format_mask(layer_allowed[None, None], dtype)  # [1, 1, q, kv]
        return masks

    def _format_mask(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A bool ``allowed`` mask as the attention implementation takes it (bool, or additive)."""
        return format_mask(allowed, dtype, self.attn_implementation)
