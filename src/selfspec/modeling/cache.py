"""KV caches: one generation's (:class:`StaticKVCache`) and a batch's (:class:`BatchedKVCache`).

Both keep the contract transformers' attention modules expect
(``cache.update(key, value, layer_idx, **kwargs)`` returns the keys and values to attend over)
and the rule every mask relies on: a chain's slot ``j`` holds position ``j``, so rolling back
is setting a length, and a rejected token leaves no trace (its slot is overwritten by the next
write).

One generation's cache:

Each decoder layer owns a key and a value buffer sized once for the whole generation
(prompt + new tokens + one draft). ``update`` writes the new positions in place and returns
views of the filled part, which is the contract transformers' attention modules expect
(``cache.update(key, value, layer_idx, **kwargs)``). Layers may hold different lengths in
the middle of an early-exit round (the shallow layers run ahead of the deep ones); rolling
back is setting a length, and a rejected token leaves no trace because its slot is
overwritten by the next write.
"""

from __future__ import annotations

import threading
from typing import Any, Literal, Protocol

import torch


class KVCache(Protocol):
    """What the model runner's layers need from a cache, and what the decoding loop asks of it.

    Attributes:
        is_compileable: transformers' flag: the cache's buffers keep their addresses across calls.
        batched: the cache holds a batch's rows (one generation per row, :class:`BatchedKVCache`),
            not one generation's positions: the loop prefills, drafts and verifies its rows together.
    """

    is_compileable: bool
    batched: bool

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new ``[m, kv_heads, q, head_dim]`` states; return the keys and values to attend over."""
        ...

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots visible to the current forward."""
        ...


class _LayerBuffers:
    """What both caches share: a key and a value buffer per layer (made on the layer's first write) and ``update``.

    ``update`` is the contract transformers' attention modules call; each cache writes in its own
    :meth:`_write`.
    """

    is_compileable = False

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new states to a layer; return the keys and values to attend over."""
        return self._write(key_states, value_states, layer_idx)

    def _write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class StaticKVCache(_LayerBuffers):
    """Per-layer preallocated key/value buffers with independent lengths.

    Args:
        num_layers: number of decoder layers.
        max_length: the most positions any layer will hold.
    """

    batched: Literal[False] = False  # one generation's (KVCache.batched)

    def __init__(self, num_layers: int, max_length: int) -> None:
        super().__init__(num_layers)
        self.max_length = max_length
        self.lengths = [0] * num_layers

    def __repr__(self) -> str:
        return f"StaticKVCache(num_layers={self.num_layers}, max_length={self.max_length}, lengths={self.lengths})"

    def _write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
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


class CachePool:
    """One :class:`StaticKVCache` an engine's calls reuse, one call at a time.

    A fresh cache's buffers are new memory, and the first write to each page costs the
    operating system a page fault: measured ~4% of a 1,470-token prefill of SmolLM2 in bf16 on
    this CPU (3.11 s with a reused cache against 3.24 s with a fresh one). A call takes the pooled
    cache when no other call holds it (grown when it needs more room); a concurrent call gets a
    fresh one. The pool keeps the largest cache a call needed.

    Args:
        num_layers: the model's decoder layers.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._cache: StaticKVCache | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CachePool({self._cache!r}, in_use={self._lock.locked()})"

    def take(self, max_length: int) -> tuple[StaticKVCache, bool]:
        """A cache of at least ``max_length`` positions, emptied, and whether it is the pool's (give it back then)."""
        if not self._lock.acquire(blocking=False):
            return StaticKVCache(self.num_layers, max_length), False
        if self._cache is None or self._cache.max_length < max_length:
            self._cache = StaticKVCache(self.num_layers, max_length)
        self._cache.crop_to(0)
        return self._cache, True

    def give_back(self, keep: bool = True) -> None:
        """Release the pool's cache (after :meth:`take` returned it).

        ``keep=False`` drops it: a failed call's cache may be half-allocated or far too large (after
        running out of memory).
        """
        if not keep:
            self._cache = None
        self._lock.release()


class BatchedKVCache(_LayerBuffers):
    """Per-layer ``[rows, kv_heads, length, head_dim]`` key/value buffers, one row per generation.

    Slot ``j`` of a row holds position ``j``: a forward writes its new states at their
    positions (per row), so rows of different lengths share one buffer and rolling a row back
    is setting its length, which the scheduler keeps. Buffers grow on demand.

    Before each forward, :meth:`select` names the rows (a contiguous range) and the positions
    being written; :meth:`update` then returns every slot up to the largest written position,
    for the selected rows.

    Args:
        num_layers: number of decoder layers.
    """

    batched: Literal[True] = True  # a batch's rows (KVCache.batched)

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.row_capacity = 0
        self.length_capacity = 0
        self._row_start = 0
        self._row_index: torch.Tensor | None = None  # [m, q] row of each new state
        self._positions: torch.Tensor | None = None  # [m, q] slot of each new state
        self._kv_length = 0

    def __repr__(self) -> str:
        return f"BatchedKVCache(num_layers={self.num_layers}, rows={self.row_capacity}, length={self.length_capacity})"

    def reserve(self, rows: int, length: int) -> None:
        """Make room for at least ``rows`` rows of ``length`` slots (allocated buffers grow)."""
        if rows <= self.row_capacity and length <= self.length_capacity:
            return
        self.row_capacity = max(self.row_capacity, _grown(rows, 4))
        self.length_capacity = max(self.length_capacity, _grown(length, 64))
        for i in range(self.num_layers):
            self.keys[i] = self._regrown(self.keys[i])
            self.values[i] = self._regrown(self.values[i])

    def _regrown(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        if buffer is None or (buffer.shape[0], buffer.shape[2]) == (self.row_capacity, self.length_capacity):
            return buffer
        grown = buffer.new_zeros((self.row_capacity, buffer.shape[1], self.length_capacity, buffer.shape[3]))
        grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
        return grown

    def select(self, row_start: int, positions: torch.Tensor, kv_length: int) -> None:
        """Set the next forward's rows ``row_start .. row_start + m`` and ``[m, q]`` positions.

        Each row's positions are consecutive (a chain of new tokens); ``kv_length`` is the
        largest position + 1.
        """
        self.reserve(row_start + positions.shape[0], kv_length)
        self._row_start = row_start
        rows = torch.arange(positions.shape[0], device=positions.device)
        self._row_index = rows[:, None].expand_as(positions)
        self._positions = positions
        self._kv_length = kv_length

    def _write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[m, kv_heads, q, head_dim]`` states at their positions; return the rows' views."""
        assert self._positions is not None and self._row_index is not None, "select() before a forward"
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None:
            kshape = (self.row_capacity, key_states.shape[1], self.length_capacity, key_states.shape[3])
            vshape = (self.row_capacity, value_states.shape[1], self.length_capacity, value_states.shape[3])
            keys = self.keys[layer_idx] = key_states.new_zeros(kshape)
            values = self.values[layer_idx] = value_states.new_zeros(vshape)
        end = self._row_start + key_states.shape[0]
        row_keys, row_values = keys[self._row_start : end], values[self._row_start : end]
        if key_states.shape[0] == 1:  # one row: its positions are consecutive, up to kv_length
            start = self._kv_length - key_states.shape[2]
            row_keys[:, :, start : self._kv_length] = key_states
            row_values[:, :, start : self._kv_length] = value_states
        else:
            # advanced indices on dims 0 and 2 put them first: [m, q, kv_heads, head_dim]
            row_keys[self._row_index, :, self._positions] = key_states.transpose(1, 2)
            row_values[self._row_index, :, self._positions] = value_states.transpose(1, 2)
        return row_keys[:, :, : self._kv_length], row_values[:, :, : self._kv_length]

    def move_row(self, source: int, target: int) -> None:
        """Copy row ``source`` into row ``target`` in every layer (a leaving row's slot is reused)."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                if buffer is not None:
                    buffer[target] = buffer[source]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots visible to the current forward (the largest written position + 1)."""
        return self._kv_length

    def crop_to(self, length: int, layers: range | None = None) -> None:
        """Nothing to do: a row's length is its position, kept by the scheduler (the contract's rollback)."""


def _grown(needed: int, minimum: int) -> int:
    size = minimum
    while size < needed:
        size *= 2
    return size
