"""The row-invariant Triton kernels under Triton's CPU interpreter (``TRITON_INTERPRET=1``).

For each kernel, at toy sizes, in float32 and bfloat16: every row of a call of ``R`` rows (1 to 33,
at every position of the block) has bitwise the bits of the same row computed alone, and the
result agrees with torch (``F.linear``, SDPA) within the dtype's rounding. The interpreter runs the
kernels' indexing, masks and reduction order for real (its dots are numpy's on float32 tiles); the
bits of a GPU's tensor cores need the GPU check.
"""

from __future__ import annotations

import os
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first loaded: they run in the interpreter

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the row-invariant kernels need triton (pip install 'selfspec[kernels]')")

from tiny_models import VOCAB, make_model

from selfspec import SpeculativeEngine
from selfspec.core.tree import TreeMask
from selfspec.errors import ConfigurationError
from selfspec.modeling import ModelRunner
from selfspec.modeling.kernels import AttentionTiles, chain_attention, linear, use_row_invariant_kernels
from selfspec.modeling.kernels.launch import interpreted

DTYPES = [torch.float32, torch.bfloat16]
ROW_COUNTS = range(1, 34)
# attention runs one interpreted program per (KV head, row, split): a spread of 1..33 keeps it to seconds
ATTENTION_ROW_COUNTS = [1, 2, 3, 5, 9, 16, 17, 33]
MAX_NEW = 10
SMALL_SPLIT = AttentionTiles(split=16, block_n=8)  # several splits and steps per row at toy lengths
TWO_SPLITS = AttentionTiles(split=32, block_n=16)  # rows of one split and of two in the row sweep


def test_the_kernels_run_in_the_interpreter() -> None:
    assert interpreted(), "the kernels were loaded before TRITON_INTERPRET=1 was set"


def test_interpreting_after_triton_was_imported_is_refused_with_what_to_do() -> None:
    """TRITON_INTERPRET=1 set after triton's import (torch._dynamo imports it) names the cause, not a kernel error."""
    import subprocess
    import sys

    code = (
        "import os, triton; os.environ['TRITON_INTERPRET'] = '1'\n"
        "from selfspec.errors import ConfigurationError\n"
        "from selfspec.modeling.kernels.launch import triton_code\n"
        "try:\n    triton_code()\nexcept ConfigurationError as error:\n    print(error)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "set after triton was imported" in result.stdout, result.stdout + result.stderr


def _linear_operands(dtype: torch.dtype, bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    # K = 260: three K steps with a tail; N = 40: two column tiles with a tail
    x = torch.randn(40, 260, generator=generator).to(dtype)
    weight = (torch.randn(40, 260, generator=generator) / 260**0.5).to(dtype)
    return x, weight, torch.randn(40, generator=generator).to(dtype) if bias else None


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_row_count_or_position(dtype: torch.dtype) -> None:
    x, weight, bias = _linear_operands(dtype, bias=True)
    alone = torch.cat([linear(x[i : i + 1], weight, bias) for i in range(len(x))])  # [40, 40]
    for rows in ROW_COUNTS:
        start = rows % 8  # the blocks start at different rows: each row meets several tile positions
        block = linear(x[start : start + rows], weight, bias)
        assert torch.equal(block, alone[start : start + rows]), (dtype, rows, start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_agrees_with_f_linear(dtype: torch.dtype, bias: bool) -> None:
    x, weight, bias_ = _linear_operands(dtype, bias)
    exact = F.linear(x.double(), weight.double(), None if bias_ is None else bias_.double())
    got = linear(x, weight, bias_)
    torch.testing.assert_close(got, F.linear(x, weight, bias_))
    if dtype == torch.bfloat16:  # float32 accumulation, one rounding to bf16: correctly rounded here
        assert torch.equal(got, exact.to(dtype))


def test_linear_keeps_f_linear_contract() -> None:
    x, weight, bias = _linear_operands(torch.float32, bias=True)
    batched = x[:12].reshape(2, 2, 3, 260)
    got = linear(batched, weight, bias)
    assert got.shape == (2, 2, 3, 40)
    assert torch.equal(got.reshape(12, 40), linear(x[:12], weight, bias))
    assert linear(x[:0], weight).shape == (0, 40)
    assert torch.equal(linear(x.t().contiguous().t()[:5], weight), linear(x[:5].contiguous(), weight))  # strides
    lm_head = torch.randn(96, 260) / 260**0.5  # a wide head: more column tiles than rows
    torch.testing.assert_close(linear(x[:3], lm_head), F.linear(x[:3], lm_head))
    with pytest.raises(ConfigurationError, match="does not match"):
        linear(x, weight[:, :10])
    with pytest.raises(ConfigurationError, match="one dtype"):
        linear(x, weight.double())


def _chain_operands(
    dtype: torch.dtype, capacity: int, num_heads: int = 4, num_kv_heads: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, num_heads, 33, 8, generator=generator).to(dtype)  # grouped-query heads
    key = torch.randn(1, num_kv_heads, capacity, 8, generator=generator).to(dtype)
    value = torch.randn(1, num_kv_heads, capacity, 8, generator=generator).to(dtype)
    return query, key, value


def _sdpa_chain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: int) -> torch.Tensor:
    rows = query.shape[2]
    keys = past + rows
    allowed = torch.ones(rows, keys, dtype=torch.bool).tril(past)  # row r sees keys 0 .. past + r
    return F.scaled_dot_product_attention(
        query, key[:, :, :keys], value[:, :, :keys], attn_mask=allowed, enable_gqa=True
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_attention_rows_do_not_depend_on_the_row_count_or_position(dtype: torch.dtype) -> None:
    past = 10
    query, key, value = _chain_operands(dtype, capacity=past + 33 + 3, num_heads=2, num_kv_heads=1)
    key[:, :, past + 33 :] = float("nan")  # a bucket's unused tail is never read
    # row r alone is a decode at position past + r (rows 22 on reduce their keys in two splits)
    alone = torch.cat(
        [chain_attention(query[:, :, r : r + 1], key, value, past + r, tiles=TWO_SPLITS) for r in range(33)], dim=2
    )
    assert not alone.isnan().any()
    for rows in ATTENTION_ROW_COUNTS:
        start = 33 - rows if rows % 2 else 0  # blocks at the start and at the end of the chain
        block = chain_attention(query[:, :, start : start + rows], key, value, past + start, tiles=TWO_SPLITS)
        assert torch.equal(block, alone[:, :, start : start + rows]), (dtype, rows, start)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [SMALL_SPLIT, AttentionTiles()], ids=["split16", "default"])
def test_chain_attention_agrees_with_sdpa(dtype: torch.dtype, tiles: AttentionTiles) -> None:
    past = 40
    query, key, value = _chain_operands(dtype, capacity=past + 9)
    got = chain_attention(query[:, :, :9], key, value, past, tiles=tiles)
    expected = _sdpa_chain(query[:, :, :9], key, value, past)
    # bf16: torch's own result is off by up to an output ulp; allow two at the outputs' scale (~1)
    torch.testing.assert_close(got, expected, **({"atol": 2**-7, "rtol": 2**-7} if dtype == torch.bfloat16 else {}))
    exact = _sdpa_chain(query[:, :, :9].double(), key.double(), value.double(), past)
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-8
    assert (got.double() - exact).abs().max() <= 4 * ulp * exact.abs().max()


def test_chain_attention_checks_its_inputs() -> None:
    query, key, value = _chain_operands(torch.float32, capacity=12)
    with pytest.raises(ConfigurationError, match="does not fit"):
        chain_attention(query[:, :, :4], key, value, 9)
    with pytest.raises(ConfigurationError, match="multiple of num_kv_heads"):
        chain_attention(query[:, :3, :1], key, value, 0)
    with pytest.raises(ConfigurationError, match="multiple of block_n"):
        AttentionTiles(split=20, block_n=8)
    one = chain_attention(query[:, :, :1], key, value, torch.tensor(5))  # the length as a device tensor
    assert torch.equal(one, chain_attention(query[:, :, :1], key, value, 5))


@pytest.fixture(scope="module")
def tiny_bf16_on_kernels() -> Any:
    return use_row_invariant_kernels(make_model("llama", dtype=torch.bfloat16, agreeing=True, num_hidden_layers=3))


@pytest.fixture(scope="module")
def plain_text_on_kernels(tiny_bf16_on_kernels) -> tuple[list[int], list[int]]:
    """A prompt and the plain loop's greedy text through the kernels."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (9,), generator=generator).tolist()
    prompt = prompt + prompt  # repeated text: lookup drafts get matched
    plain_engine = SpeculativeEngine(tiny_bf16_on_kernels, None, drafter="none", calibration={})
    assert plain_engine.runner.row_kernels
    plans = plain_engine.runner._chain_plans(torch.arange(5, 9)[None], 9, torch.bfloat16)
    assert {plan.kernel_past for plan in plans.values()} == {5}  # a verify of 4 rows after 5 cached keys
    return prompt, plain_engine.generate_ids(prompt, max_new_tokens=MAX_NEW).token_ids


@pytest.mark.parametrize(
    "drafter",
    [
        {"drafter": "prompt_lookup", "num_draft_tokens": 8},  # verify blocks of up to 9 rows
        {"drafter": "early_exit", "exit_layer": 1, "num_draft_tokens": 3},
    ],
    ids=["prompt_lookup", "early_exit"],
)
def test_bf16_speculation_through_the_kernels_gives_the_plain_text(
    tiny_bf16_on_kernels, plain_text_on_kernels, drafter
) -> None:
    """End to end: a bf16 tiny Llama whose forwards run through the kernels; speculative == plain."""
    prompt, plain = plain_text_on_kernels
    engine = SpeculativeEngine(tiny_bf16_on_kernels, None, calibration={}, **drafter)
    out = engine.generate_ids(prompt, max_new_tokens=MAX_NEW)
    assert out.stats.num_drafted > 0 and out.stats.num_accepted > 0  # multi-row verifies ran and were used
    assert out.token_ids == plain


def test_the_runner_refuses_what_the_kernels_do_not_cover(tiny_bf16_on_kernels) -> None:
    runner = ModelRunner(tiny_bf16_on_kernels)
    tree = TreeMask(allowed=torch.ones(1, 1, dtype=torch.bool), key_positions=torch.tensor([3]))
    hidden = runner.embed(torch.tensor([[5]]))
    with pytest.raises(ConfigurationError, match="token trees"):
        runner.run_layers(hidden, 0, runner.num_layers, torch.tensor([3]), runner.new_cache(8), tree=tree)
    with pytest.raises(ConfigurationError, match="lean path"):
        ModelRunner(tiny_bf16_on_kernels, fast_path=False)


# ----------------------------------------------------------------------------- the static round's steps
STATIC_NEW = 9  # plain tokens decoded one at a time, then re-verified in blocks of every width up to 9


@pytest.fixture(scope="module")
def two_layer_bf16_on_kernels() -> Any:
    """Item 3's toy: a random 2-layer Llama, hidden 32, in bf16, every forward through the kernels."""
    model = make_model("llama", dtype=torch.bfloat16, agreeing=False, num_hidden_layers=2, seed=3)
    return use_row_invariant_kernels(model)


def test_the_static_step_through_the_kernels_gives_each_row_its_decode_bits_at_every_width(
    two_layer_bf16_on_kernels,
) -> None:
    """The static round's forwards (fixed width, the length on the device) through the kernels.

    The plain loop of width-1 greedy steps gives the eager plain text through the kernels, and a
    verify of every fixed width up to 9 over the same text gives every row bitwise the logits its
    one-token decode gave: so a greedy round's acceptance sees exactly the plain loop's argmaxes.
    """
    from selfspec.modeling.static_step import WIDTHS, StaticStep, bucket_for, static_prefill

    model = two_layer_bf16_on_kernels
    prompt = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = SpeculativeEngine(model, None, drafter="none", calibration={}).generate_ids(
        prompt, max_new_tokens=STATIC_NEW + 1
    )
    runner = ModelRunner(model)
    assert runner.row_kernels
    step = StaticStep(runner)  # eager steps: the interpreter cannot be traced by torch.compile
    slots = len(prompt) + STATIC_NEW + WIDTHS[-1]
    cache, bucket = step.reserve(slots), bucket_for(slots)
    with torch.inference_mode():
        _, first = static_prefill(runner, cache, torch.tensor([prompt]))
        text, decoded = [int(first.argmax())], []
        for _ in range(STATIC_NEW):  # the plain loop: width 1, nothing drafted
            decided, _, logits = step.greedy(torch.tensor([[text[-1]]]), torch.tensor(0), bucket)
            decoded.append(logits[0])
            text.append(int(decided[1]))
        assert text == plain.token_ids, "the static step's plain loop left the eager plain loop through the kernels"
        for width in (w for w in WIDTHS if 1 < w <= STATIC_NEW):
            cache.length.fill_(len(prompt))  # re-verify the same text from the first new token
            _, logits = step.forward(torch.tensor([text[:width]]), bucket)
            for row in range(width):
                assert torch.equal(logits[row], decoded[row]), (width, row)


def test_bf16_speculation_in_the_static_round_through_the_kernels_gives_the_plain_text(
    two_layer_bf16_on_kernels,
) -> None:
    """End to end in the static round (fixed widths, acceptance on the device) through the kernels.

    On a GPU ``row_exact`` compiles these steps; the interpreter cannot be traced by
    ``torch.compile``, so here the engine's static round runs its steps eagerly
    (``StaticStep(runner)``, no backend): the same forwards, kernels and acceptance.
    """
    from selfspec.decoding.static_round import StaticRounds
    from selfspec.modeling.static_step import StaticStep

    model = two_layer_bf16_on_kernels
    prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist() * 2
    plain = SpeculativeEngine(model, None, drafter="none", calibration={}).generate_ids(prompt, max_new_tokens=12)
    engine = SpeculativeEngine(model, None, drafter="prompt_lookup", num_draft_tokens=8, calibration={})
    assert engine.row_exactness.kernels and "selfspec's plain text bit for bit" in engine.exactness
    engine._static = StaticRounds(StaticStep(engine.runner))  # the static round, its steps eager
    out = engine.generate_ids(prompt, max_new_tokens=12)
    assert engine.static_round is not None and engine.static_round.step.compiled  # the round's steps ran
    assert out.stats.num_drafted > 0 and out.stats.num_accepted > 0
    assert out.token_ids == plain.token_ids
