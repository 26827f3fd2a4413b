"""Row-invariant attention for decode and chain verify: one kernel, each row over exactly its own keys."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ConfigurationError
from .launch import check_device, store_dtype, triton_code


@dataclass(frozen=True)
class AttentionTiles:
    """The fixed split of :func:`chain_attention`'s keys: nothing in it depends on the number of rows.

    Attributes:
        split: keys per split (a split size, not a number of splits): a row with ``n`` keys is
            reduced in ``ceil(n / split)`` splits whatever else the call holds. A multiple of
            ``block_n``.
        block_n: keys per step of the online softmax inside a split.
    """

    split: int = 256
    block_n: int = 64

    def __post_init__(self) -> None:
        if self.block_n <= 0 or self.split % self.block_n:
            raise ConfigurationError(f"AttentionTiles: split {self.split} must be a multiple of block_n {self.block_n}")


ATTENTION_TILES = AttentionTiles()


def _block(size: int) -> int:
    """The power of two >= ``size`` and >= 16 (a ``tl.dot`` dimension on a GPU)."""
    return max(16, 1 << max(0, size - 1).bit_length())


def _past_tensor(past_length: int | torch.Tensor, rows: int, capacity: int, device: torch.device) -> torch.Tensor:
    """The cached length as a one-element int32 tensor (a device tensor is taken as it is)."""
    if isinstance(past_length, torch.Tensor):
        if past_length.numel() != 1:
            raise ConfigurationError(f"chain_attention: past_length must hold one value, got {past_length.numel()}")
        return past_length.reshape(1).to(device=device, dtype=torch.int32)
    if past_length < 0 or past_length + rows > capacity:
        raise ConfigurationError(
            f"chain_attention: past_length {past_length} + {rows} rows does not fit the {capacity} keys given"
        )
    return torch.tensor([past_length], dtype=torch.int32, device=device)


def chain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_length: int | torch.Tensor,
    *,
    scale: float | None = None,
    tiles: AttentionTiles = ATTENTION_TILES,
) -> torch.Tensor:
    """Causal attention of ``R`` new rows appended to a cache, each row's bits independent of ``R``.

    Row ``r`` (position ``past_length + r``) attends over keys ``0 .. past_length + r``: a decode
    is ``R = 1``, a chain verify of ``k`` drafts is ``R = k + 1``. The new rows' keys and values must
    already be written at ``past_length .. past_length + R - 1``; keys after a row's own are never
    read (the buffer may be a longer bucket holding anything there). Each row is reduced alone, in
    splits of ``tiles.split`` keys merged in split order, so a row gets the same bits in a decode,
    in a verify block of any size and at any position in it. Grouped-query attention is native:
    ``num_heads`` is a multiple of ``num_kv_heads`` and the heads of a group share their KV head.

    Args:
        query: ``[batch, num_heads, R, head_dim]``.
        key: ``[batch, num_kv_heads, capacity, head_dim]``, capacity >= ``past_length + R``.
        value: like ``key``.
        past_length: keys cached before the first new row (an int, or a one-element integer tensor
            on the device, which a CUDA graph can replay with a new value).
        scale: the softmax scale; ``1 / sqrt(head_dim)`` by default (SDPA's).
        tiles: the key split (the default is the one the engine uses).

    Returns:
        ``[batch, num_heads, R, head_dim]`` in ``query``'s dtype.

    Raises:
        ConfigurationError: shapes, dtypes or the length do not match, or the device cannot run it.
        MissingDependencyError: triton is not installed.
    """
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ConfigurationError(
            f"chain_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
            "must be [batch, heads, positions, head_dim] with key and value alike"
        )
    batch, num_heads, rows, head_dim = query.shape
    num_kv_heads, capacity = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ConfigurationError(
            f"chain_attention: query {tuple(query.shape)} does not match key {tuple(key.shape)} "
            "(same batch and head_dim; num_heads a multiple of num_kv_heads)"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ConfigurationError(f"chain_attention: one dtype expected, got {query.dtype}, {key.dtype}, {value.dtype}")
    past = _past_tensor(past_length, rows, capacity, query.device)
    if query.numel() == 0:
        return torch.empty_like(query)
    upcast = check_device(query, key, value, past)
    out = torch.empty(query.shape, dtype=store_dtype(query.dtype, upcast), device=query.device)
    group = num_heads // num_kv_heads
    block_d = _block(head_dim)
    num_splits = -(-capacity // tiles.split)
    part_acc = torch.empty(batch, num_heads, rows, num_splits, block_d, dtype=torch.float32, device=query.device)
    part_max = torch.empty(batch, num_heads, rows, num_splits, dtype=torch.float32, device=query.device)
    part_sum = torch.empty_like(part_max)
    code = triton_code()
    code.chain_attention_split_kernel[(batch * num_kv_heads, rows, num_splits)](
        query,
        key,
        value,
        past,
        part_acc,
        part_max,
        part_sum,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        num_heads,
        num_kv_heads,
        group,
        head_dim,
        rows,
        num_splits,
        1.0 / math.sqrt(head_dim) if scale is None else scale,
        UPCAST=upcast,
        IEEE=upcast or query.dtype == torch.float32,
        BLOCK_G=_block(group),
        BLOCK_D=block_d,
        BLOCK_N=tiles.block_n,
        SPLIT=tiles.split,
    )
    code.chain_attention_merge_kernel[(batch * num_heads, rows)](
        past,
        part_acc,
        part_max,
        part_sum,
        out,
        *out.stride(),
        num_heads,
        head_dim,
        rows,
        num_splits,
        BLOCK_D=block_d,
        SPLIT=tiles.split,
    )
    return out.to(query.dtype)
