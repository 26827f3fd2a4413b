"""A verify padded to a cheaper, wider forward keeps the text (issue 27: the fp32 verify curve is not monotone).

On the AMD EPYC this project measures on, fp32 matmuls run 4 rows faster than 2 or 3, so where
the calibrated curve says so the loop verifies a short draft padded with filler rows
(:meth:`selfspec.core.speed.CostModel.padded`). The filler rows' outputs are never read and their
cache slots are cropped: greedy text still equals ``generate`` and sampled text is unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tiny_models import make_model, reference_greedy

import selfspec.decoding.loop as loop
from selfspec import Draft, SpeculativeEngine
from selfspec.drafting.eagle.head import EagleHead

PROMPT = [5, 17, 33, 8, 9, 41, 3, 60, 22, 14, 5, 17, 33, 8, 9]  # repeats: prompt lookup drafts
#: one or two drafts cost 3 plain steps, three drafts 1.2, six 1.1: every short draft is padded
PADDING = {"draft": 0.01, "verify": {"1": 3.0, "2": 3.0, "3": 1.2, "6": 1.1}}


@pytest.fixture
def widths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every verify's ``(draft length, padded width)``, recorded as the loop asks for it."""
    seen: list[tuple[int, int]] = []
    chosen = loop.verify_width

    def recording(row: Any, draft: Any) -> int:
        width = chosen(row, draft)
        seen.append((len(draft), width))
        return width

    monkeypatch.setattr(loop, "verify_width", recording)
    return seen


def engines(model: Any) -> dict[str, dict[str, Any]]:
    return {
        "prompt_lookup": {"drafter": "prompt_lookup", "num_draft_tokens": 2},
        "early_exit": {"drafter": "early_exit", "exit_layer": 2, "num_draft_tokens": 2},
        "early_exit_tree": {"drafter": "early_exit", "exit_layer": 2, "num_draft_tokens": 2, "tree_nodes": 2},
        "eagle": {"drafter": "eagle", "eagle_head": EagleHead(model), "num_draft_tokens": 1},
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", ["prompt_lookup", "early_exit", "early_exit_tree", "eagle"])
def test_padded_verify_keeps_greedy_text_equal_to_generate(arch: str, name: str, widths) -> None:
    model = make_model(arch)
    reference = reference_greedy(model, PROMPT, 24)
    engine = SpeculativeEngine(model, calibration={"costs": PADDING}, **engines(model)[name])
    out = engine.generate_ids(PROMPT, max_new_tokens=24)
    assert out.token_ids == reference
    padded = [(k, w) for k, w in widths if w > k]
    assert padded, f"no verify was padded: {widths}"
    assert all(w in (3, 6) for _, w in padded)


@pytest.mark.parametrize("name", ["prompt_lookup", "early_exit", "eagle"])
def test_padded_verify_keeps_sampled_text(name: str, widths) -> None:
    """Same seed, same tokens: acceptance reads only the draft's rows, whatever the width."""
    model = make_model("llama")
    settings = engines(model)[name]
    padded = SpeculativeEngine(model, calibration={"costs": PADDING}, **settings)
    plain_width = SpeculativeEngine(model, calibration={"costs": {**PADDING, "verify": {"1": 1.1}}}, **settings)
    for seed in (0, 1):
        a = padded.generate_ids(PROMPT, max_new_tokens=24, temperature=0.8, seed=seed)
        b = plain_width.generate_ids(PROMPT, max_new_tokens=24, temperature=0.8, seed=seed)
        assert a.token_ids == b.token_ids
    assert any(w > k for k, w in widths)


def test_no_padding_without_a_curve(widths) -> None:
    model = make_model("llama")
    fixed = SpeculativeEngine(model, drafter="early_exit", exit_layer=2, num_draft_tokens=2, calibration={})
    fixed.generate_ids(PROMPT, max_new_tokens=12)
    assert widths and all(w == k for k, w in widths)  # fixed settings: no calibrated curve


def test_the_cache_keeps_room_to_pad_to_the_end_and_nothing_pads_past_it(widths) -> None:
    model = make_model("llama")
    engine = SpeculativeEngine(
        model, drafter="early_exit", exit_layer=2, num_draft_tokens=2, calibration={"costs": PADDING}
    )
    out = engine.generate_ids(PROMPT, max_new_tokens=3)  # the last rounds draft 1 token: still padded
    assert out.token_ids == reference_greedy(model, PROMPT, 3)
    drafted = [(k, w) for k, w in widths if k > 0]
    assert drafted and all(w == 6 for _, w in drafted)
    costs = engine.controller.costs
    for room, expected in ((10, 6), (6, 6), (5, 1)):  # slots left after the last token
        row = SimpleNamespace(
            run=SimpleNamespace(controller=SimpleNamespace(costs=costs)),
            state=SimpleNamespace(cache=SimpleNamespace(max_length=100), position=99 - room),
        )
        assert loop.verify_width(row, Draft(tokens=[7])) == expected  # type: ignore[arg-type]
