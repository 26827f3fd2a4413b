"""The Triton kernels behind :mod:`selfspec.modeling.kernels` (imports triton: load it lazily).

Every reduction here has an order fixed by the kernel's constants and by the row's own data, never
by how many rows the call holds:

- :func:`linear_kernel`: one program per ``[BLOCK_M, BLOCK_N]`` output tile, K walked from 0 in
  steps of ``BLOCK_K``, no split-K. A row is one of the ``BLOCK_M`` rows of its tile whatever the
  call's row count; rows past the end are loaded as zeros and never stored.
- :func:`chain_attention_split_kernel`: one program per (batch, KV head, query row, key split); the
  query heads of the KV head's group are the rows of its dot (grouped-query attention natively).
  Split ``s`` covers keys ``[s * SPLIT, (s + 1) * SPLIT)`` of the row's own keys, walked in blocks
  of ``BLOCK_N`` with an online softmax; keys past the row's length are loaded as zeros, masked to
  ``-inf`` and contribute exact zeros.
- :func:`chain_attention_merge_kernel`: merges a row's splits in split order 0, 1, ...

``UPCAST`` loads the tiles in float32 before each ``tl.dot``: Triton 3.9's CPU interpreter returns
garbage for ``tl.dot`` on bfloat16 operands (measured: 8.7e10 for true values up to 27),
so the interpreter path always multiplies float32 tiles (exact products of bf16 values, float32
accumulation). On a GPU half-precision tiles go to the tensor cores as they are, accumulating in
float32. The interpreter also rounds float32 to bfloat16 by truncation, so there the kernels store float32
and the caller rounds (see :func:`.launch.store_dtype`). ``IEEE`` asks for full float32 products
(no TF32) when the operands are float32, as ``F.linear`` and SDPA compute them by default.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[M, N] = x[M, K] @ w[N, K].T (+ b[N])``, one fixed-shape tile per program."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + offs_k
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: the weight's [N, K] tile read transposed
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += bias[None, :]
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def chain_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    past_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_qb,
    stride_qh,
    stride_qr,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    num_heads,
    num_kv_heads,
    group,
    head_dim,
    num_rows,
    num_splits,
    scale,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """One key split of one query row for the ``group`` query heads of one KV head: softmax partials."""
    batch_kv = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    batch = batch_kv // num_kv_heads
    kv_head = batch_kv % num_kv_heads
    length = tl.load(past_ptr) + row + 1  # row `row` sees the cache and the chain up to itself
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    heads = kv_head * group + g
    q = tl.load(
        q_ptr + batch * stride_qb + heads[:, None] * stride_qh + row * stride_qr + d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    running_max = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for key_start in range(start, end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k = tl.load(
            k_base + keys[None, :] * stride_ks + d[:, None] * stride_kd,
            mask=key_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = tl.where(key_ok[None, :], scores * scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(probs, axis=1)
        v = tl.load(
            v_base + keys[:, None] * stride_vs + d[None, :] * stride_vd,
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        else:
            probs = probs.to(v.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(probs, v)
        running_max = new_max

    slot = ((batch * num_heads + heads) * num_rows + row) * num_splits + split  # [BLOCK_G]
    tl.store(part_max_ptr + slot, running_max, mask=g_ok)
    tl.store(part_sum_ptr + slot, running_sum, mask=g_ok)
    tl.store(part_acc_ptr + slot[:, None] * BLOCK_D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def chain_attention_merge_kernel(
    past_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    stride_or,
    stride_od,
    num_heads,
    head_dim,
    num_rows,
    num_splits,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Merge one (batch, head, row)'s key splits in split order 0, 1, ... and normalise."""
    batch_head = tl.program_id(0)
    row = tl.program_id(1)
    batch = batch_head // num_heads
    head = batch_head % num_heads
    length = tl.load(past_ptr) + row + 1
    used = (length + SPLIT - 1) // SPLIT  # the splits that hold any of the row's keys
    d = tl.arange(0, BLOCK_D)
    base = (batch_head * num_rows + row) * num_splits

    running_max = tl.load(part_max_ptr + base)
    running_sum = tl.load(part_sum_ptr + base)
    acc = tl.load(part_acc_ptr + base * BLOCK_D + d)
    for split in range(1, used):
        split_max = tl.load(part_max_ptr + base + split)
        split_sum = tl.load(part_sum_ptr + base + split)
        split_acc = tl.load(part_acc_ptr + (base + split) * BLOCK_D + d)
        new_max = tl.maximum(running_max, split_max)
        old_scale = tl.exp(running_max - new_max)
        split_scale = tl.exp(split_max - new_max)
        running_sum = running_sum * old_scale + split_sum * split_scale
        acc = acc * old_scale + split_acc * split_scale
        running_max = new_max
    out = acc / running_sum
    tl.store(
        out_ptr + batch * stride_ob + head * stride_oh + row * stride_or + d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=d < head_dim,
    )
