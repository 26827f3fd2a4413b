"""A row-invariant linear layer: ``F.linear``'s contract, each row's bits independent of the row count."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import ConfigurationError
from .launch import check_device, store_dtype, triton_code


@dataclass(frozen=True)
class LinearTiles:
    """The fixed tile of :func:`linear`: nothing in it depends on the number of rows.

    Attributes:
        block_m: rows per tile; 16 covers a decode (1 row) and every chain verify up to 15 drafts in
            one tile, and more rows take more tiles of the same shape.
        block_n: output features per tile (per program).
        block_k: the reduction step; K is walked from 0 upwards in this step, never split.
    """

    block_m: int = 16
    block_n: int = 32
    block_k: int = 128


LINEAR_TILES = LinearTiles()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: LinearTiles = LINEAR_TILES,
) -> torch.Tensor:
    """``x @ weight.T + bias`` whose row ``i`` has the same bits whatever the other rows are.

    Same contract as :func:`torch.nn.functional.linear`: ``x`` is ``[..., in_features]``, ``weight``
    ``[out_features, in_features]``, ``bias`` ``[out_features]`` or None, all one dtype; the result
    is ``[..., out_features]`` in that dtype. The products accumulate in float32 in a fixed order (one
    tile shape, K in ``tiles.block_k`` steps, no split-K), so a decode's row and the same row inside a
    verify block of any size, at any position, get identical bits. This holds for the LM head too.

    Args:
        x: the input rows, any leading dimensions.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]``, optional.
        tiles: the tile shape (the default is the one the engine uses).

    Returns:
        ``[..., out_features]`` in ``x``'s dtype.

    Raises:
        ConfigurationError: shapes or dtypes do not match, or the device cannot run the kernel.
        MissingDependencyError: triton is not installed.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ConfigurationError(f"linear: x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ConfigurationError(f"linear: bias {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ConfigurationError(
            f"linear: x, weight and bias must share one dtype (x {x.dtype}, weight {weight.dtype})"
        )
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)  # [M, K]
    if rows.shape[0] == 0 or out_features == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    upcast = check_device(rows, weight, *([] if bias is None else [bias]))
    out = torch.empty(rows.shape[0], out_features, dtype=store_dtype(x.dtype, upcast), device=x.device)  # [M, N]
    grid = (-(-rows.shape[0] // tiles.block_m), -(-out_features // tiles.block_n))
    triton_code().linear_kernel[grid](
        rows,
        weight,
        weight if bias is None else bias,  # an unused pointer when there is no bias
        out,
        rows.shape[0],
        out_features,
        in_features,
        rows.stride(0),
        rows.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        IEEE=upcast or x.dtype == torch.float32,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)
