"""Row invariance of every op of a verify forward, per dtype, on this machine's CPU kernels.

Greedy speculation equals the plain loop in half precision only if each verify row gets the
bits its position gets when decoded alone (``selfspec.modeling.attention``). These tests pin
what the batch-invariant forward relies on, op by op, so that a kernel or library change that
breaks it fails here rather than as a rare text difference: RMSNorm and rotary tables batched,
linear layers through :func:`linear_rows` (a weight the probe calls row-invariant must really be,
on fresh data), the LM head through the runner, and attention through :func:`attend` for chain
and tree plans against the one-token decode call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model

from selfspec.core.tree import tree_attention
from selfspec.modeling import ModelRunner
from selfspec.modeling.attention import (
    _ROW_INVARIANT,
    FULL,
    AttentionPlan,
    attend,
    chain_rows,
    linear_is_row_invariant,
    linear_rows,
    tree_rows,
)
from selfspec.modeling.fastpath import rms_norm


def _cpu_computes(dtype: torch.dtype) -> bool:
    try:
        F.linear(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))
        F.scaled_dot_product_attention(*(torch.ones(1, 1, 2, 4, dtype=dtype),) * 3)
    except RuntimeError:
        return False
    return True


DTYPES = [d for d in (torch.float32, torch.bfloat16, torch.float16) if _cpu_computes(d)]
ROWS = 9  # a verify of 8 drafts + the last token


def _random(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_is_row_invariant(dtype: torch.dtype) -> None:
    hidden = _random(1, ROWS, 576, dtype=dtype, scale=3.0)
    weight = _random(576, dtype=dtype, seed=1)
    block = rms_norm(hidden, weight, 1e-5)
    for i in range(ROWS):
        assert torch.equal(block[:, i : i + 1], rms_norm(hidden[:, i : i + 1], weight, 1e-5)), i


# shapes of SmolLM2-135M (576 -> q/kv/gate, 1536 -> down) and of larger models (4096 in)
@pytest.mark.parametrize("shape", [(192, 576), (1536, 576), (576, 1536), (512, 2048), (256, 4096)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_rows_give_each_row_its_bits_alone(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """At every verify width: a kernel may pick its algorithm by the number of rows."""
    weight = _random(*shape, dtype=dtype, scale=0.05)
    bias = _random(shape[0], dtype=dtype, seed=2)
    for width in (2, 3, 4, 5, ROWS, 10, 17):
        for seed in range(2):
            x = _random(1, width, shape[1], dtype=dtype, seed=10 + seed)
            alone = torch.cat([F.linear(x[:, i : i + 1], weight, bias) for i in range(width)], dim=1)
            assert torch.equal(linear_rows(x, weight, bias, exact_rows=True), alone), width
            if linear_is_row_invariant(weight, bias):  # the verdict holds on data it never saw
                assert torch.equal(F.linear(x, weight, bias), alone), width


def test_the_probe_sees_the_measured_bf16_split() -> None:
    """On these CPUs (oneDNN) bf16 matmuls are row-invariant up to 1,024 inputs, not beyond.

    Beyond, a block of random rows differs from its rows alone only now and then (the rounded
    output hides most of another summation order): measured here, for the ``256 x 1088`` shape
    below at two rows, one block in about seven. The probe's cancelling data shows it at every
    width. If this fails, the kernels changed: re-measure (``linear_rows`` stays exact either
    way, only its cost moves).
    """
    if torch.bfloat16 not in DTYPES:
        pytest.skip("no bf16 matmul on this CPU")
    _ROW_INVARIANT.clear()
    for shape in ((576, 576), (1536, 576), (256, 1024), (49152, 576)):
        assert linear_is_row_invariant(_random(*shape, dtype=torch.bfloat16)), shape
    for shape in ((256, 1088), (576, 1536), (512, 2048)):
        assert not linear_is_row_invariant(_random(*shape, dtype=torch.bfloat16)), shape
        bias = _random(shape[0], dtype=torch.bfloat16)
        assert not linear_is_row_invariant(_random(*shape, dtype=torch.bfloat16), bias), shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_probe_finds_what_random_rows_miss(dtype: torch.dtype) -> None:
    """A weight the probe calls row-invariant gives 400 fresh random rows, in blocks of 2 to 17, their bits alone.

    And one it does not is really not: some block of such rows differs.
    """
    _ROW_INVARIANT.clear()
    for shape in ((256, 256), (256, 1088)):
        weight = _random(*shape, dtype=dtype, scale=0.05)
        differs = False
        for width in (2, 3, 5, 9, 17):
            for seed in range(400 // width):
                x = _random(width, shape[1], dtype=dtype, seed=1000 + seed)
                alone = torch.cat([F.linear(row[None], weight) for row in x])
                differs |= not torch.equal(F.linear(x, weight), alone)
        assert differs == (not linear_is_row_invariant(weight)), (shape, differs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lm_head_rows_equal_one_token_logits(dtype: torch.dtype) -> None:
    # 1,088 inputs: past the length where bf16 matmuls stop being row-invariant here
    model = make_model("llama", dtype=dtype, hidden_size=1088, num_hidden_layers=1, agreeing=False)
    runner = ModelRunner(model)
    runner.row_exact = True
    hidden = _random(1, ROWS, 1088, dtype=dtype, seed=3)
    block = runner.row_logits(hidden)
    for i in range(ROWS):
        assert torch.equal(block[:, i : i + 1], runner.row_logits(hidden[:, i : i + 1])), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_tables_are_row_invariant(dtype: torch.dtype) -> None:
    runner = ModelRunner(make_model("llama", dtype=dtype))
    hidden = _random(1, ROWS, 32, dtype=dtype)
    positions = torch.arange(300, 300 + ROWS)[None]
    cos, sin = runner.rotary_emb(hidden, positions)
    for i in range(ROWS):
        one_cos, one_sin = runner.rotary_emb(hidden[:, i : i + 1], positions[:, i : i + 1])
        assert torch.equal(cos[:, i : i + 1], one_cos) and torch.equal(sin[:, i : i + 1], one_sin)


def _decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The call a one-token decode makes: one query over every key it sees, no mask."""
    return attend(query, keys, values, FULL, 0.125, True)


# 40: one kernel block; 300 and 700: a partial and a split block of 512 keys (as the CPU kernel splits)
@pytest.mark.parametrize("cached", [40, 300, 700])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chain_rows_equal_the_decode_call(dtype: torch.dtype, cached: int) -> None:
    kv_length = cached + ROWS
    buffer_k = _random(1, 3, kv_length + 16, 64, dtype=dtype, seed=4, scale=2.0)
    buffer_v = _random(1, 3, kv_length + 16, 64, dtype=dtype, seed=5)
    keys, values = buffer_k[:, :, :kv_length], buffer_v[:, :, :kv_length]  # views of a cache, as the fast path has
    query = _random(1, ROWS, 9, 64, dtype=dtype, seed=6, scale=2.0).transpose(1, 2)
    out = attend(query, keys, values, AttentionPlan(rows=chain_rows(kv_length, ROWS)), 0.125, True)
    for i in range(ROWS):
        length = cached + i + 1
        alone = _decode(query[:, :, i : i + 1], keys[:, :, :length], values[:, :, :length])
        assert torch.equal(out[:, :, i : i + 1], alone), (i, length)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_rows_equal_the_decode_of_each_path(dtype: torch.dtype) -> None:
    """A node attends as if its ancestors had been decoded one by one right after the text."""
    parents = [-1, -1, 0, 0, 1, 2, 2, 4]  # two branches off the root, depth up to 4
    cached = 300
    allowed = tree_attention(parents)  # [n + 1, n + 1]: root first
    nodes = allowed.shape[0]
    kv_length = cached + nodes
    keys = _random(1, 3, kv_length, 64, dtype=dtype, seed=7, scale=2.0)
    values = _random(1, 3, kv_length, 64, dtype=dtype, seed=8)
    original_k, original_v = keys.clone(), values.clone()
    query = _random(1, nodes, 9, 64, dtype=dtype, seed=9, scale=2.0).transpose(1, 2)
    plan = AttentionPlan(rows=tree_rows(allowed.tolist(), cached))
    out = attend(query, keys, values, plan, 0.125, True)
    assert torch.equal(keys, original_k) and torch.equal(values, original_v)  # the cache holds the tree again
    for j in range(nodes):
        path = [cached + c for c in range(nodes) if allowed[j, c]]
        index = torch.tensor([*range(cached), *path])
        alone = _decode(query[:, :, j : j + 1], keys[:, :, index], values[:, :, index])
        assert torch.equal(out[:, :, j : j + 1], alone), j
