"""A preallocated KV cache that draft and verify share, with O(1) rollback.

Each decoder layer owns a key and a value buffer sized once for the whole generation
(prompt + new tokens + one draft). ``update`` writes the new positions in place and returns
views of the filled part, which is the contract transformers' attention modules expect
(``cache.update(key, value, layer_idx, **kwargs)``). Layers may hold different lengths in
the middle of an early-exit round (the shallow layers run ahead of the deep ones); rolling
back is setting a length, and a rejected token leaves no trace because its slot is
overwritten by the next write.
"""

from __future__ import annotations

from typing import Any

import torch


class StaticKVCache:
    """Per-layer preallocated key/value buffers with independent lengths.

    Args:
        num_layers: number of decoder layers.
        max_length: the most positions any layer will hold.
    """

    is_compileable = False

    def __init__(self, num_layers: int, max_length: int) -> None:
        self.num_layers = num_layers
        self.max_length = max_length
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def __repr__(self) -> str:
        return f"StaticKVCache(num_layers={self.num_layers}, max_length={self.max_length}, lengths={self.lengths})"

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, q, head_dim]`` states to a layer; return its filled views."""
        start = self.lengths[layer_idx]
        end = start + key_states.shape[-2]
        if end > self.max_length:
            raise RuntimeError(f"KV cache overflow on layer {layer_idx}: {end} positions > {self.max_length}")
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            shape = (*key_states.shape[:-2], self.max_length, key_states.shape[-1])
            keys = key_states.new_empty(shape)
            vshape = (*value_states.shape[:-2], self.max_length, value_states.shape[-1])
            values = value_states.new_empty(vshape)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        keys[..., start:end, :] = key_states
        values[..., start:end, :] = value_states
        self.lengths[layer_idx] = end
        return keys[..., :end, :], values[..., :end, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions held by one layer (layer 0 by default)."""
        return self.lengths[layer_idx]

    def keep(self, start: int, slots: list[int], layers: range | None = None) -> None:
        """Keep only ``slots`` (increasing, all ``>= start``) after ``start``, moved to ``start ..``.

        After a tree round the accepted path's KV becomes contiguous again and every other
        node's KV is dropped: each layer then holds ``start + len(slots)`` positions.
        """
        for i in layers if layers is not None else range(self.num_layers):
            keys, values = self.keys[i], self.values[i]
            if keys is not None and values is not None and slots != list(range(start, start + len(slots))):
                index = torch.tensor(slots, device=keys.device)
                end = start + len(slots)
                keys[..., start:end, :] = keys.index_select(-2, index)
                values[..., start:end, :] = values.index_select(-2, index)
            self.lengths[i] = start + len(slots)

    def crop_to(self, length: int, layers: range | None = None) -> None:
        """Roll layers back so that each holds at most ``length`` positions."""
        for i in layers if layers is not None else range(self.num_layers):
            self.lengths[i] = min(self.lengths[i], length)
