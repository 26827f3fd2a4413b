"""Attention dispatch: which attention call each forward of the target makes.

One place decides how the queries of a forward attend over the cache (the fast path calls
:func:`attend`; the module path passes :meth:`AttentionPlan.module_mask` to transformers' layers):

- **decode** (one query over every cached key): no mask, the call transformers' ``generate`` makes.
- **prefill from an empty cache**: ``is_causal=True`` over exactly the prompt's keys, the call
  ``generate`` makes (SDPA serves it with its flash kernels and native grouped-query attention,
  without materialising a mask or repeating K/V).
- **chain verify** (``q`` new positions after the cached ones): bottom-right-aligned causal
  attention. On CUDA it is :func:`torch.nn.attention.bias.causal_lower_right` (FlashAttention or
  mem-efficient without a mask where the heads match; with grouped-query attention torch 2.13's
  ``CausalBias`` does not pass ``enable_gqa`` to those kernels, so the bias is materialised);
  elsewhere an explicit ``[m, 1, q, kv]`` boolean mask. Untested on a GPU so far.
- **tree verify**: an explicit mask (the committed text plus each node's ancestors).

**Batch-invariant rows.** In half precision, greedy equality with ``generate`` needs every verify
row to get the bits its position gets when decoded alone. On the CPUs measured (AMX), linear
layers, RMSNorm and the LM head are row-invariant in bf16, but SDPA is not: its CPU flash kernel
takes a different matmul path for one query than for a block of queries, and the split of the
keys into vectorised and scalar ``exp`` lanes depends on the number of keys of the call, so
neither a multi-row call nor a masked tail reproduces a one-token decode (measured: rows of a
multi-query call differed in ~15-70% of the cases in bf16/fp16, a masked tail in ~0.5%; see
``tests/exact/test_modeling_row_invariance.py``). The one call that gives a row the decode's bits is the
decode's call itself: that query alone over exactly the keys it sees, in position order, without
a mask. :class:`RowCalls` plans that, for chains (row ``i`` over the first ``L_i`` keys) and for
trees (row ``j`` over the committed keys followed by its ancestors: the path is written into
the slots right after the committed text, in place, visiting nodes in depth-first order so each
node costs one slot write, and the tree's keys are put back afterwards). Plans are built on the
host once per forward and reused by every layer.

Linear layers: on the same CPUs, oneDNN's bf16 matmul gives a row the bits it gets alone only
while the reduction is short: measured, ``in_features <= 1024`` is row-invariant, but with
``in_features`` > 1024 (SmolLM2's ``down_proj``: 1,536) a block of two or more rows takes
another path and some rows differ. :func:`linear_rows` therefore probes each weight shape once
(blocks of every verify width against the rows alone, on data that shows any other summation
order; cached) and, in a batch-invariant forward, computes a weight that fails the probe one row
at a time.

The price: a row costs what a one-token decode's attention costs (on this CPU in bf16 that
call is slow: ~0.3 ms per layer at 300 keys, ~3 ms at 1,400), so a verify of ``q`` rows pays
``q`` decodes' attention. float32 and float64 keep one masked call per forward (their linear
layers are not row-invariant on this CPU anyway, and the masked call is cheaper).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: dtypes whose verify rows are computed one query per call (batch-invariant attention).
ROW_EXACT_DTYPES = (torch.bfloat16, torch.float16)


def row_exact_default(dtype: torch.dtype) -> bool:
    """Whether verify rows get one attention call each: in half precision (where argmax flips)."""
    return dtype in ROW_EXACT_DTYPES


@dataclass(frozen=True)
class RowCalls:
    """A forward's attention computed one query row at a time, each with a decode's call.

    Attributes:
        lengths: ``[q]`` how many keys query row ``i`` attends over (its position + 1).
        order: rows in the order they are computed (depth-first for a tree: one slot write each).
        writes: for each step of ``order``, the ``(slot, tree_key)`` writes that put the row's
            ancestors in the slots after the committed text (empty for a chain).
        tree_base: for a tree, the number of committed keys before the tree nodes; ``None``
            for a chain.
    """

    lengths: tuple[int, ...]
    order: tuple[int, ...]
    writes: tuple[tuple[tuple[int, int], ...], ...] = ()
    tree_base: int | None = None


@dataclass(frozen=True)
class AttentionPlan:
    """How the queries of one forward attend, for the layers of one type.

    Attributes:
        mask: a ``[m, 1, q, kv]`` mask (bool for SDPA, additive for eager attention) or ``None``.
        is_causal: a prefill from an empty cache: SDPA's ``is_causal`` over the prompt's keys.
        lower_right: a chain verify served by :func:`~torch.nn.attention.bias.causal_lower_right`
            (on CUDA); ``mask`` then stays ``None`` on the fast path.
        rows: batch-invariant row calls (half precision); they take precedence over ``mask``.
        kernel_past: the forward runs through the row-invariant kernels
            (:mod:`selfspec.modeling.kernels`): a chain of new positions after this many cached
            keys (0 for a prefill; in the static round the cache's length, a one-element device
            tensor), every linear through :func:`~selfspec.modeling.kernels.linear` and the
            attention through :func:`~selfspec.modeling.kernels.chain_attention`.
    """

    mask: torch.Tensor | None = None
    is_causal: bool = False
    lower_right: bool = False
    rows: RowCalls | None = None
    kernel_past: int | torch.Tensor | None = None

    def __repr__(self) -> str:
        kind = (
            "kernels"
            if self.kernel_past is not None
            else "rows"
            if self.rows is not None
            else "causal"
            if self.is_causal
            else "lower_right"
            if self.lower_right
            else "mask"
            if self.mask is not None
            else "full"
        )
        return f"AttentionPlan({kind})"


#: one query over every cached key (a decode): no mask.
FULL = AttentionPlan()
#: a prefill from an empty cache.
PREFILL = AttentionPlan(is_causal=True)


def chain_rows(kv_length: int, num_queries: int) -> RowCalls:
    """Row calls for a chain: the last ``num_queries`` of ``kv_length`` slots, row ``i`` sees ``[0, kv - q + i]``."""
    first = kv_length - num_queries + 1
    return RowCalls(lengths=tuple(range(first, kv_length + 1)), order=tuple(range(num_queries)))


def tree_rows(allowed: Sequence[Sequence[bool]], tree_base: int) -> RowCalls:
    """Row calls for tree nodes held at the end of the cache.

    Args:
        allowed: ``[q][t]`` query ``j`` may see tree key ``c`` (the last ``t`` keys of the cache,
            ancestors before descendants, so a row's path in key order is its path from the root).
        tree_base: committed keys before the tree keys.
    """
    paths = [tuple(c for c, ok in enumerate(row) if ok) for row in allowed]
    order = sorted(range(len(paths)), key=lambda j: paths[j])  # depth-first: shared prefixes stay written
    num_keys = len(allowed[0]) if allowed else 0
    held = list(range(num_keys))  # held[s]: which tree key sits in tree slot s now
    writes = []
    for j in order:
        step = tuple((s, key) for s, key in enumerate(paths[j]) if held[s] != key)
        for s, key in step:
            held[s] = key
        writes.append(step)
    return RowCalls(
        lengths=tuple(tree_base + len(path) for path in paths),
        order=tuple(order),
        writes=tuple(writes),
        tree_base=tree_base,
    )


def format_mask(allowed: torch.Tensor, dtype: torch.dtype, attn_implementation: str) -> torch.Tensor:
    """A boolean ``allowed`` mask as the attention implementation takes it: bool for SDPA, else additive.

    The additive form holds ``0`` where attention is allowed and the dtype's minimum elsewhere
    (what eager attention adds to the scores).
    """
    if attn_implementation == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def causal_allowed(num_queries: int, num_cached: int, batch: int, device: torch.device) -> torch.Tensor:
    """``[batch, q, cached + q]``: query ``i`` sees every cached key and the new keys up to itself."""
    allowed = torch.ones(num_queries, num_cached + num_queries, dtype=torch.bool, device=device)
    return allowed.tril(num_cached)[None].expand(batch, -1, -1)


_ROW_INVARIANT: dict[tuple[tuple[int, ...], torch.dtype, str, bool], bool] = {}

#: block widths the probe compares with single rows (chain verifies of 1-32 drafts)
PROBE_WIDTHS = (2, 3, 4, 5, 8, 9, 16, 17, 33)


def cancelling_weight(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A probe weight of ``like``'s shape, dtype and device: ``[u, -u]`` (random ``u``; a last odd column 0).

    With :func:`cancelling_rows` every output is a sum of exact products that cancels to about zero, so
    any other summation order leaves another tiny value, which a bitwise comparison sees.
    """
    half = like.shape[1] // 2
    u = torch.randn(like.shape[0], half, generator=generator, device=like.device)
    probe = torch.zeros_like(like)
    probe[:, :half], probe[:, half : 2 * half] = u, -u
    return probe


def cancelling_rows(count: int, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``count`` probe rows ``[a, a]`` (random ``a``) for a weight like ``like``: see :func:`cancelling_weight`."""
    half = like.shape[1] // 2
    a = torch.randn(count, half, generator=generator, device=like.device)
    rows = like.new_zeros(count, like.shape[1])
    rows[:, :half], rows[:, half : 2 * half] = a, a
    return rows


def linear_is_row_invariant(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``F.linear`` with a weight of this shape gives each row of a block the bits it gets alone.

    Probed once per weight shape, dtype, device and bias, and cached. The probe is built so that
    any difference in summation order shows. Random data would hide most of it: the output's
    rounding masks a different order of the float32 sums, and on these CPUs a bf16
    ``256 x 1088`` block of two random rows differs from its rows alone in about one case in
    seven. So the probe's weight is ``[u, -u]`` and its rows ``[a, a]`` (random ``u``, ``a``):
    each output is a sum of exact products that cancels to about zero, so any other order of
    the sums leaves another tiny value, and half precision represents tiny values as exactly as
    large ones. Its rows are computed one at a time, then in a block of every width of
    :data:`PROBE_WIDTHS` (a kernel library may pick its algorithm by the number of rows); the
    shape is row-invariant only if every block equals its rows. The zero bias keeps the biased
    call's code path.
    """
    key = (tuple(weight.shape), weight.dtype, weight.device.type, bias is not None)
    if key not in _ROW_INVARIANT:
        generator = torch.Generator(device=weight.device).manual_seed(0)
        with torch.no_grad():
            probe = cancelling_weight(weight, generator)
            rows = cancelling_rows(max(PROBE_WIDTHS), weight, generator)
            zero = None if bias is None else torch.zeros_like(bias)
            alone = torch.cat([F.linear(row[None], probe, zero) for row in rows])
            _ROW_INVARIANT[key] = all(
                torch.equal(F.linear(rows[:width], probe, zero), alone[:width]) for width in PROBE_WIDTHS
            )
    return _ROW_INVARIANT[key]


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, exact_rows: bool) -> torch.Tensor:
    """``F.linear`` over ``[m, q, in]``; with ``exact_rows``, each position gets the bits it gets alone.

    A weight that passes :func:`linear_is_row_invariant` runs as one block; another runs one
    position at a time.
    """
    if not exact_rows or x.shape[-2] == 1 or linear_is_row_invariant(weight, bias):
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[..., i : i + 1, :], weight, bias) for i in range(x.shape[-2])], dim=-2)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Scaled dot-product attention of ``[m, heads, q, d]`` queries as ``plan`` says.

    ``key`` and ``value`` are ``[m, kv_heads, kv, d]``: every slot the forward may see (for a
    tree, the views of the cache itself, which row calls rewrite in place and restore).
    """
    if plan.kernel_past is not None:
        from .kernels import chain_attention

        return chain_attention(query, key, value, plan.kernel_past, scale=scale)
    if plan.rows is not None:
        return _attend_rows(query, key, value, plan.rows, scale, enable_gqa)
    if plan.is_causal:
        q_len = query.shape[-2]
        key, value = key[..., :q_len, :], value[..., :q_len, :]
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if plan.lower_right:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(query.shape[-2], key.shape[-2])
        if enable_gqa:
            # CausalBias hands flash / mem-efficient kernels K and V as they are, without enable_gqa
            # (torch 2.13): with fewer K/V heads, give SDPA the same attention as a mask instead
            mask = bias._materialize(query.device)
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=plan.mask, scale=scale, enable_gqa=enable_gqa)


def _attend_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: RowCalls, scale: float, enable_gqa: bool
) -> torch.Tensor:
    """Each query row alone over exactly its keys, no mask: the call a one-token decode makes."""
    outputs: list[torch.Tensor | None] = [None] * len(rows.lengths)
    if rows.tree_base is None:
        for i in rows.order:
            length = rows.lengths[i]
            outputs[i] = F.scaled_dot_product_attention(
                query[:, :, i : i + 1], key[..., :length, :], value[..., :length, :], scale=scale, enable_gqa=enable_gqa
            )
    else:
        base = rows.tree_base
        tree_keys, tree_values = key[..., base:, :].clone(), value[..., base:, :].clone()
        for i, writes in zip(rows.order, rows.writes, strict=True):
            for slot, tree_key in writes:  # put row i's ancestors right after the committed text
                key[..., base + slot, :] = tree_keys[..., tree_key, :]
                value[..., base + slot, :] = tree_values[..., tree_key, :]
            length = rows.lengths[i]
            outputs[i] = F.scaled_dot_product_attention(
                query[:, :, i : i + 1], key[..., :length, :], value[..., :length, :], scale=scale, enable_gqa=enable_gqa
            )
        key[..., base:, :] = tree_keys  # the cache holds the tree nodes again
        value[..., base:, :] = tree_values
    return torch.cat([out for out in outputs if out is not None], dim=-2)
