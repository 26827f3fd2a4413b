"""Model adapters: everything architecture-specific, behind one small interface.

The decoding loop never touches ``model.model.layers`` directly. It asks the adapter to
embed tokens, run a range of decoder layers (``run_layers(hidden, start, end, ...)``: the
"early" forward is ``[0, E)`` and the "remainder" forward is ``[E, L)``, as in LayerSkip),
and turn hidden states into logits through the shared final norm and LM head.

The adapter builds attention masks itself, from the query positions and the number of
positions the *called* layers hold, one mask per layer type (full or sliding-window
attention). transformers' own mask helpers read the past length from layer 0 of the cache,
which is wrong while the shallow layers run ahead of the deep ones in an early-exit round.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .cache import StaticKVCache
from .errors import ConfigurationError, UnsupportedArchitectureError
from .fastpath import build_fast_layers, layer_forward
from .tree import TreeMask

#: transformers ``model_type`` values with an adapter, and the families they cover.
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
    """Raise :class:`UnsupportedArchitectureError` unless ``config`` has an adapter."""
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


class ModelAdapter:
    """Drives a transformers causal LM layer by layer.

    Args:
        model: a loaded ``*ForCausalLM`` of a supported architecture (any dtype, device,
            or bitsandbytes quantization: the adapter calls the model's own modules).
    """

    def __init__(self, model: Any) -> None:
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
        # the lean layer path (same maths, less overhead); SELFSPEC_FAST_PATH=0 turns it off
        enabled = os.environ.get("SELFSPEC_FAST_PATH", "1") != "0"
        self.fast_layers = build_fast_layers(model) if enabled else None

    def __repr__(self) -> str:
        return (
            f"ModelAdapter(model_type={self.config.model_type!r}, num_layers={self.num_layers}, "
            f"layer_types={sorted(set(self.layer_types))}, attn={self.attn_implementation!r}, "
            f"fast_path={self.fast_layers is not None})"
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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, q, hidden]`` states -> ``[q, vocab]`` float32 logits (final norm + LM head).

        Logits are cast to float32 as transformers' ``generate`` does before choosing a token.
        """
        logits = self.lm_head(self.norm(hidden))[0]
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        cache: StaticKVCache,
        tree: TreeMask | None = None,
    ) -> torch.Tensor:
        """Run decoder layers ``[start, end)`` on new positions, writing their KV to ``cache``.

        Args:
            hidden: ``[1, q, hidden]`` input states of the new positions.
            start: first layer to run.
            end: one past the last layer to run.
            positions: ``[q]`` absolute positions of the new states; in a chain they follow
                the cached positions of layer ``start`` directly.
            cache: the generation's cache; every layer in the range must hold the same length.
            tree: for token-tree nodes (:mod:`selfspec.tree`): which of the tree nodes at the
                end of the cache each query sees; ``None`` is plain causal attention.

        Returns:
            ``[1, q, hidden]`` output states of layer ``end - 1``.
        """
        if start >= end:
            return hidden
        past = cache.lengths[start]
        position_ids = positions.unsqueeze(0)  # [1, q]
        masks = self._masks(positions, past, hidden.dtype, tree)
        rotary = self._rotary(hidden, position_ids, {self.layer_types[i] for i in range(start, end)})
        if self.fast_layers is not None:
            fast = self.fast_layers
            # [1, q, head_dim] -> [1, 1, q, head_dim], broadcast over heads
            cos_sin = {t: (cos.unsqueeze(1), sin.unsqueeze(1)) for t, (cos, sin) in rotary.items()}
            for i in range(start, end):
                cos, sin = cos_sin[self.layer_types[i]]
                hidden = layer_forward(fast[i], hidden, cos, sin, masks[self.layer_types[i]], cache, i)
            return hidden
        for i in range(start, end):
            layer_type = self.layer_types[i]
            hidden = self.layers[i](
                hidden,
                attention_mask=masks[layer_type],
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
                position_embeddings=rotary[layer_type],
            )
        return hidden

    def _rotary(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, layer_types: set[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._rotary_per_type:
            return {t: self.rotary_emb(hidden, position_ids, t) for t in layer_types}
        shared = self.rotary_emb(hidden, position_ids)
        return dict.fromkeys(layer_types, shared)

    def _masks(
        self, positions: torch.Tensor, past: int, dtype: torch.dtype, tree: TreeMask | None = None
    ) -> dict[str, torch.Tensor | None]:
        """One attention mask per layer type for queries at ``positions`` over ``past + q`` keys."""
        query_len = positions.shape[0]
        kv_len = past + query_len
        if tree is not None:
            return self._tree_masks(positions, kv_len, dtype, tree)
        if query_len == 1 and (self.sliding_window is None or kv_len <= self.sliding_window):
            return dict.fromkeys(self.layer_types)  # one query over every cached key: no mask
        kv_positions = torch.arange(kv_len, device=positions.device)  # [kv]
        causal = kv_positions[None, :] <= positions[:, None]  # [q, kv]
        masks: dict[str, torch.Tensor | None] = {}
        for layer_type in set(self.layer_types):
            allowed = causal
            window_matters = layer_type == SLIDING_ATTENTION and kv_len > (self.sliding_window or 0)
            if window_matters:
                assert self.sliding_window is not None
                allowed = allowed & (kv_positions[None, :] > positions[:, None] - self.sliding_window)
            if query_len == 1 and not window_matters:
                masks[layer_type] = None  # one query over every cached key: no mask needed
            else:
                masks[layer_type] = self._format_mask(allowed, dtype)
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
            masks[layer_type] = self._format_mask(layer_allowed, dtype)
        return masks

    def _format_mask(self, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        allowed = allowed[None, None]  # [1, 1, q, kv]
        if self.attn_implementation == "sdpa":
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)
