"""Greedy speculation is exact in bf16: speculative text == selfspec's plain loop == ``generate``.

In half precision rounding flips argmaxes, so equality needs every verify row to get the bits
its position gets decoded alone (``selfspec.modeling.attention``: batch-invariant rows) and a
prefill that makes transformers' own call (``is_causal``). Checked for prompt lookup, early-exit
chains and trees, and EAGLE chains and trees, on a tiny random model (whose 1,088-wide MLP
exercises the row-by-row linear path) and on SmolLM2-135M-Instruct with its shipped head.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_drafting_eagle import shipped_smollm2_head
from tiny_models import VOCAB, make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import EagleHead, load_eagle_head

MAX_NEW = 24


def _drafters(head: Any, exit_layer: int) -> dict[str, dict[str, Any]]:
    return {
        "prompt_lookup": {"drafter": "prompt_lookup", "num_draft_tokens": 8},
        "early_exit_chain": {"drafter": "early_exit", "exit_layer": exit_layer, "num_draft_tokens": 4},
        "early_exit_tree": {"drafter": "early_exit", "exit_layer": exit_layer, "num_draft_tokens": 3, "tree_nodes": 8},
        "eagle_chain": {"drafter": "eagle", "eagle_head": head, "num_draft_tokens": 6},
        "eagle_tree": {"drafter": "eagle", "eagle_head": head, "num_draft_tokens": 4, "tree_nodes": 16},
    }


def _check(model: Any, tokenizer: Any, prompt: list[int], drafter: dict[str, Any], max_new: int) -> Any:
    reference = reference_greedy(model, prompt, max_new)
    plain = SpeculativeEngine(model, tokenizer, drafter="none", calibration={}).generate_ids(
        prompt, max_new_tokens=max_new
    )
    assert plain.token_ids == reference, "selfspec's bf16 plain loop differs from transformers' bf16 generate"
    engine = SpeculativeEngine(model, tokenizer, calibration={}, **drafter)
    assert engine.runner.row_exact
    out = engine.generate_ids(prompt, max_new_tokens=max_new)
    assert out.token_ids == reference
    return out.stats


@pytest.fixture(scope="module")
def tiny_bf16() -> Any:
    # a wide MLP (1,088 inputs to down_proj) where bf16 matmuls are not row-invariant on these CPUs
    return make_model("llama", dtype=torch.bfloat16, agreeing=True, intermediate_size=1088)


@pytest.mark.parametrize("name", list(_drafters(None, 2)))
def test_tiny_model_bf16_speculation_is_exact(tiny_bf16, name: str) -> None:
    torch.manual_seed(0)
    head = EagleHead(tiny_bf16)  # random: its drafts are mostly rejected, which must not change the text
    generator = torch.Generator().manual_seed(1)
    drafted = 0
    for length in (7, 40):
        prompt = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        prompt = prompt + prompt[: length // 2]  # repeated text: lookup drafts get matched
        stats = _check(tiny_bf16, None, prompt, _drafters(head, 2)[name], MAX_NEW)
        drafted += stats.num_drafted
    assert drafted > 0


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_path) -> Any:
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(smollm2_path, dtype="bfloat16", device="cpu")
    return model, tokenizer


SMOLLM2_PROMPTS = {
    "code": "Write a Python function that returns the square of a number.",
    "chat": "Give me three tips for sleeping better.",
    "rag": (
        "Context: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
        "named after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.\n"
        "Question: Who is the Eiffel Tower named after, and when was it built? Answer from the context."
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_drafters(None, 8)))
def test_smollm2_bf16_speculation_is_exact(smollm2_bf16, name: str) -> None:
    model, tokenizer = smollm2_bf16
    head = load_eagle_head(shipped_smollm2_head(), model)
    accepted = 0
    for text in SMOLLM2_PROMPTS.values():
        engine = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
        prompt = engine.encode_prompt([{"role": "user", "content": text}])
        stats = _check(model, tokenizer, prompt, _drafters(head, 8)[name], 32)
        accepted += stats.num_accepted
    assert accepted > 0, "no draft was accepted: the test would not exercise a multi-row verify"


def _verify_and_decode_logits(
    runner: Any, prompt: torch.Tensor, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``new`` scored in one verify forward, and the same positions decoded one at a time."""
    cached, count = prompt.shape[1], new.shape[1]
    verify_cache, decode_cache = runner.new_cache(cached + count), runner.new_cache(cached + count)
    with torch.inference_mode():
        for cache in (verify_cache, decode_cache):
            runner.run_layers(runner.embed(prompt), 0, runner.num_layers, torch.arange(cached), cache)
        positions = torch.arange(cached, cached + count)
        verify = runner.logits(runner.run_layers(runner.embed(new), 0, runner.num_layers, positions, verify_cache))
        decoded = [
            runner.logits(
                runner.run_layers(
                    runner.embed(new[:, i : i + 1]), 0, runner.num_layers, positions[i : i + 1], decode_cache
                )
            )
            for i in range(count)
        ]
    return verify, torch.cat(decoded)


@pytest.mark.parametrize("row_exact", [True, False], ids=["row_exact", "batched"])
def test_verify_logits_are_the_decode_logits_bit_for_bit(row_exact: bool) -> None:
    """The sensitive check: every bit of every verify row, not only its argmax.

    The batched forward (``row_exact=False``, what float32 uses) is shown to differ here, so
    this test would notice if the batch-invariant path silently stopped being used.
    """
    from selfspec.modeling import ModelRunner

    model = make_model("llama", dtype=torch.bfloat16, agreeing=False, hidden_size=256, intermediate_size=1088,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    runner = ModelRunner(model)
    runner.row_exact = row_exact
    generator = torch.Generator().manual_seed(0)
    same = []
    for cached in (40, 300, 600):
        prompt = torch.randint(3, VOCAB, (1, cached), generator=generator)
        new = torch.randint(3, VOCAB, (1, 9), generator=generator)
        verify, decoded = _verify_and_decode_logits(runner, prompt, new)
        same.append(torch.equal(verify, decoded))
    assert all(same) if row_exact else not all(same), same


def test_auto_dtype_runs_a_bf16_checkpoint_in_bf16_where_the_cpu_computes_it(tmp_path, tiny_bf16) -> None:
    """``dtype="auto"`` (the default) loads a bf16 checkpoint in bf16 on a CPU with AVX512-BF16 or AMX, exactly."""
    from selfspec.modeling.loading import native_dtypes

    folder = tmp_path / "bf16-model"
    tiny_bf16.save_pretrained(folder)
    engine = SpeculativeEngine.from_pretrained(folder, drafter="prompt_lookup", num_draft_tokens=8, calibrate=False)
    native = torch.bfloat16 in native_dtypes(torch.device("cpu"))
    assert engine.runner.dtype == (torch.bfloat16 if native else torch.float32)
    assert "bfloat16" in repr(engine) if native else "float32" in repr(engine)
    prompt = list(range(5, 25)) * 2
    assert engine.generate_ids(prompt, max_new_tokens=MAX_NEW).token_ids == reference_greedy(
        engine.model, prompt, MAX_NEW
    )
    forced = SpeculativeEngine.from_pretrained(folder, drafter="none", dtype="float32", calibrate=False)
    assert forced.runner.dtype == torch.float32


def test_row_exact_chooses_the_verify_and_the_plan_says_what_holds(tiny_bf16) -> None:
    """``row_exact=``: "auto" on a CPU in bf16 is the row-by-row verify; ``False`` batches it, and says so."""
    auto = SpeculativeEngine(tiny_bf16, None, drafter="auto", calibration={})
    assert auto.runner.row_exact and not auto.runner.row_kernels
    assert auto.plan is not None and "the plain text bit for bit" in auto.plan.exactness
    off = SpeculativeEngine(tiny_bf16, None, drafter="prompt_lookup", calibration={}, row_exact=False)
    assert not off.runner.row_exact and not off.runner.row_kernels
    assert off.exactness.startswith("not row-exact (row_exact=False)") and "may differ" in off.exactness
    fp32 = SpeculativeEngine(make_model("llama"), None, drafter="none", calibration={})
    assert not fp32.runner.row_exact and fp32.exactness.startswith("float32")
