"""The exact-argmax LM head (:mod:`selfspec.modeling.argmax_head`): a bf16 screen, then the float32 candidates.

Its argmax must be the full float32 head's whatever the input, near-ties and exact ties included,
and the candidates' values must carry the full one-row call's bits (they are what a decode step,
and transformers' ``generate``, compares). Then the plain loop and speculation with it stay
identical to ``generate`` in float32 on a real checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfspec import SpeculativeEngine
from selfspec.modeling.argmax_head import FP32_SCREEN_ROWS, ArgmaxHead
from selfspec.modeling.loading import native_dtypes

native_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in native_dtypes(torch.device("cpu")),
    reason="the exact-argmax head needs a CPU that computes bf16 natively (AVX512-BF16 or AMX)",
)


def _head(vocab: int = 4096, hidden: int = 192, offset: int = 10, seed: int = 0) -> nn.Linear:
    """A float32 head whose weight starts ``offset`` floats into its storage (not on a 64-byte line)."""
    generator = torch.Generator().manual_seed(seed)
    storage = torch.randn(vocab * hidden + offset, generator=generator) * 0.05
    head = nn.Linear(hidden, vocab, bias=False)
    head.weight = nn.Parameter(storage[offset:].view(vocab, hidden), requires_grad=False)
    return head


def _built(head: nn.Linear) -> ArgmaxHead:
    """The head's :class:`ArgmaxHead` (its build-time self-check passed)."""
    screen = ArgmaxHead.build(head)
    assert screen is not None
    return screen


def _check_row(screen: ArgmaxHead, head: nn.Linear, x: torch.Tensor) -> int:
    """Assert the screened row's argmax and candidate bits match the full one-row call; return the candidates."""
    return _check_screened(screen.logits(x[None, None])[0, 0], head, x)


def _check_screened(screened: torch.Tensor, head: nn.Linear, x: torch.Tensor) -> int:
    """Assert screened logits give the argmax and candidate bits of ``x``'s one-row call; return the candidates."""
    full = head(x[None, None])[0, 0]  # the one-token call a decode step (and generate) makes
    kept = torch.isfinite(screened)
    assert int(screened.argmax()) == int(full.argmax())
    assert torch.equal(screened[kept], full[kept]), "a candidate's value differs from the full head's bits"
    return int(kept.sum())


@native_bf16
def test_argmax_and_candidate_bits_match_the_full_head_on_random_rows() -> None:
    head = _head()
    screen = _built(head)
    generator = torch.Generator().manual_seed(1)
    scales = (0.1, 1.0, 30.0) * 40
    counts = [_check_row(screen, head, torch.randn(192, generator=generator) * scale) for scale in scales]
    assert max(counts) < 4096 // 8, "the screen kept too much of the vocabulary to be worth it"


@native_bf16
def test_near_ties_and_exact_ties_resolve_as_the_full_head_does() -> None:
    head = _head()
    weight = head.weight
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(192, generator=generator)
    best = int(F.linear(x[None], weight)[0].argmax())
    with torch.no_grad():  # a later row equal to the best (an exact tie: the first index wins), one a hair below
        weight[best + 7] = weight[best]
        weight[best - 5] = weight[best] * (1 - 1e-6)
    screen = _built(head)
    assert _check_row(screen, head, x) >= 3  # the three (near-)tied rows are all candidates
    with torch.no_grad():  # an earlier exact tie now wins (the screen sees the in-place change)
        weight[best - 3] = weight[best]
    assert _check_row(screen, head, x) >= 4


@native_bf16
def test_several_positions_and_a_non_finite_row() -> None:
    head = _head()
    screen = _built(head)
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(1, 5, 192, generator=generator)
    states[0, 2] = math.inf  # its screen overflows: that row gets the full head
    screened = screen.logits(states)
    full = head(states)
    assert screened.shape == full.shape
    for position in (0, 1, 3, 4):
        assert int(screened[0, position].argmax()) == int(full[0, position].argmax())
    assert torch.allclose(screened[0, 2], full[0, 2], equal_nan=True)


@native_bf16
def test_one_or_two_rows_are_screened_in_float32_and_keep_fewer_candidates() -> None:
    head = _head()
    screen = _built(head)
    generator = torch.Generator().manual_seed(5)
    states = torch.randn(24, 3, 192, generator=generator) * torch.tensor([0.1, 1.0, 30.0]).repeat(8)[:, None, None]
    kept: dict[int, list[int]] = {1: [], 2: [], 3: []}
    for rows in (1, 2, 3):
        assert (screen._screen(states[0, :rows]).out_scale == 0.0) == (rows <= FP32_SCREEN_ROWS)
        for block in states[:, :rows]:
            screened = screen.logits(block[None])[0]
            for position, x in enumerate(block):
                kept[rows].append(_check_screened(screened[position], head, x))
    float32_kept = sum(kept[1] + kept[2]) / len(kept[1] + kept[2])
    bf16_kept = sum(kept[3]) / len(kept[3])
    assert float32_kept <= bf16_kept, (float32_kept, bf16_kept)


@native_bf16
def test_weights_changed_in_place_are_screened_afresh() -> None:
    head = _head()
    screen = _built(head)
    x = torch.randn(192, generator=torch.Generator().manual_seed(4))
    _check_row(screen, head, x)
    with torch.no_grad():
        head.weight[123] = x * 10  # now row 123 wins by far
    assert int(screen.logits(x[None, None]).argmax()) == 123
    _check_row(screen, head, x)


def test_build_declines_where_it_does_not_apply() -> None:
    assert ArgmaxHead.build(nn.Linear(8, 16, bias=True)) is None  # a bias
    assert ArgmaxHead.build(nn.Linear(8, 16, bias=False).double()) is None  # not float32
    assert ArgmaxHead.build(nn.Linear(8, 16, bias=False).to(torch.bfloat16)) is None  # already half precision
    assert ArgmaxHead.build(nn.Embedding(16, 8)) is None  # not a plain linear layer


@native_bf16
@pytest.mark.slow
def test_smollm2_float32_greedy_with_the_screen_equals_generate(smollm2_path) -> None:
    """The plain loop and prompt lookup, screened, against transformers' float32 ``generate``."""
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(smollm2_path, dtype="float32", device="cpu")
    prompts = [
        "Summarize in one sentence: the Eiffel Tower was built from 1887 to 1889 for the World's Fair in Paris.",
        "Write a Python function that returns the largest of three numbers.",
        "What should I pack for a weekend hike?",
    ]
    engines = {
        name: SpeculativeEngine(model, tokenizer, drafter=name, num_draft_tokens=3, calibration={})
        for name in ("none", "prompt_lookup")
    }
    for text in prompts:
        prompt = engines["none"].encode_prompt([{"role": "user", "content": text}])
        with torch.inference_mode():
            reference = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt) :]
        for name, engine in engines.items():
            out = engine.generate_ids(prompt, max_new_tokens=40)
            assert out.token_ids == reference.tolist()[: len(out.token_ids)], f"{name} differs from generate"
    for name, engine in engines.items():
        head = engine.runner.argmax_head
        assert head is not None and head.screened > 0, f"{name}: the screen never ran, so nothing new was checked"
