"""A bitsandbytes-quantized target in the static round (issue 40 item 6), on CPU under ``compile="eager"``.

The lean layer path calls a quantized projection as a module (``module(x)``), so a 4-bit (NF4)
target runs the static round: greedy text equals the same quantized model's own plain loop and its
``generate``, with the early exit (drafting through the quantized layers) and with prompt lookup,
and the rounds ran there (their steps were traced), not in the eager loop. The round verifies only
at widths where the quantized kernels give a block's rows the bits they get alone
(:func:`~selfspec.modeling.static_step.exact_widths`): every width for NF4 on this CPU, width 1
alone for 8-bit (its outlier columns are chosen over the whole block). The row-invariant kernels,
which read weights, refuse a quantized layer.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUANTIZABLE_SHAPE, lean_and_module_logits, make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.errors import ConfigurationError
from selfspec.modeling.fastpath import row_invariant_widths
from selfspec.modeling.static_step import WIDTHS

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.slow

REPEATED = list(range(10, 30)) * 2  # prompt lookup drafts land
RANDOM = [5, 9, 17, 33, 40, 41, 42, 77, 31, 2]
NEW_TOKENS = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama", dtype=torch.float32, **QUANTIZABLE_SHAPE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def plain_4bit(model_dir):
    """The quantized target's own plain loop (the eager loop, no drafts), and its text for each prompt."""
    engine = SpeculativeEngine.from_pretrained(
        model_dir, quantization="4bit", device="cpu", drafter="none", compile=False, calibrate=False
    )
    texts = {tuple(p): engine.generate_ids(p, max_new_tokens=NEW_TOKENS).token_ids for p in (REPEATED, RANDOM)}
    return engine, texts


def static_4bit(model_dir, drafter: str) -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(
        model_dir,
        quantization="4bit",
        device="cpu",
        drafter=drafter,
        compile="eager",
        exit_layer=1,
        num_draft_tokens=4,
        calibrate=False,
    )


def test_4bit_layers_are_called_as_modules_and_row_invariant_here(plain_4bit) -> None:
    """The measurement the round's widths rest on: NF4 on this CPU keeps a row's bits at every width."""
    engine, _ = plain_4bit
    fast = engine.runner.fast_layers
    assert fast is not None  # the lean path, quantized
    modules = fast[0].modules
    assert len(modules) == 7 and all(isinstance(m, bnb.nn.Linear4bit) for m in modules)
    for module in modules:
        assert row_invariant_widths(module, torch.float32, WIDTHS) == WIDTHS, type(module).__name__


def test_4bit_lean_path_is_bitwise_identical_to_the_model(plain_4bit) -> None:
    """The lean path calls the quantized modules as transformers' layers do: the same float32 numbers."""
    engine, _ = plain_4bit
    outputs = lean_and_module_logits(engine.runner, torch.tensor([RANDOM]))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("drafter", ["none", "early_exit", "prompt_lookup"])
def test_4bit_static_round_greedy_equals_its_plain_loop(model_dir, plain_4bit, drafter: str) -> None:
    plain, texts = plain_4bit
    engine = static_4bit(model_dir, drafter)
    assert engine.static_round is not None and engine.static_round.step.widths == WIDTHS
    drafted = accepted = 0
    for prompt in (REPEATED, RANDOM):
        out = engine.generate_ids(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == texts[tuple(prompt)]
        assert out.token_ids == reference_greedy(plain.model, prompt, NEW_TOKENS)  # the quantized generate
        drafted, accepted = drafted + out.stats.num_drafted, accepted + out.stats.num_accepted
    # the rounds ran in the static round: its steps were traced, at the widths the drafts needed
    kinds = {(kind, width) for kind, width, _ in engine.static_round.step.compiled}
    if drafter == "none":
        assert kinds == {("greedy", 1)}, kinds
        return
    assert accepted > 5, (drafted, accepted)
    if drafter == "early_exit":
        assert {("exit_draft@1", 1), ("exit_state@1", 1), ("exit_greedy@1", 5)} <= kinds, kinds
    else:
        assert ("greedy", 5) in kinds, kinds


def test_4bit_runner_refuses_the_row_invariant_kernels(plain_4bit) -> None:
    """The Triton kernels read a weight; a quantized layer's is packed: refused, not computed otherwise."""
    runner = plain_4bit[0].runner
    assert "not quantized" in (runner.row_kernels_refusal() or "")
    with pytest.raises(ConfigurationError, match="not quantized"):
        runner.use_row_kernels(True)


def test_8bit_static_round_verifies_one_row_and_keeps_the_text(model_dir) -> None:
    """LLM.int8 picks its outlier columns over the whole block: the round stays at width 1, same text."""
    engine = SpeculativeEngine.from_pretrained(
        model_dir,
        quantization="8bit",
        device="cpu",
        drafter="early_exit",
        compile="eager",
        exit_layer=1,
        num_draft_tokens=4,
        calibrate=False,
    )
    assert engine.static_round is not None and engine.static_round.step.widths == (1,)
    out = engine.generate_ids(RANDOM, max_new_tokens=16)
    assert out.token_ids == reference_greedy(engine.model, RANDOM, 16)
    assert out.stats.num_drafted == 0
    assert {width for _, width, _ in engine.static_round.step.compiled} == {1}


def test_4bit_bfloat16_row_exact_verify_equals_its_plain_loop(model_dir) -> None:
    """The eager loop's row-exact verify (half precision) calls a quantized layer one row at a time."""
    options = {"quantization": "4bit", "device": "cpu", "dtype": "bfloat16", "compile": False, "calibrate": False}
    plain = SpeculativeEngine.from_pretrained(model_dir, drafter="none", **options)
    engine = SpeculativeEngine.from_pretrained(
        model_dir, drafter="early_exit", exit_layer=1, num_draft_tokens=4, **options
    )
    assert engine.runner.row_exact and engine.runner.fast_layers is not None
    for prompt in (REPEATED, RANDOM):
        out = engine.generate_ids(prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == plain.generate_ids(prompt, max_new_tokens=NEW_TOKENS).token_ids
        assert out.stats.num_accepted > 5
