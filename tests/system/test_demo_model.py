"""The bundled demo model: exact greedy decoding, and drafts its early exits get accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec import SpeculativeEngine, demo_model_path

HELD_OUT = json.loads((Path(__file__).parents[1] / "data" / "heldout_austen.json").read_text(encoding="utf-8"))


def heldout_prompts(count: int = 4, words: int = 40) -> list[str]:
    return [" ".join(p.split()[:words]) for p in HELD_OUT["paragraphs"][:count]]


@pytest.fixture(scope="module")
def demo64():
    """The demo model in float64, where rounding cannot hide or fake a mismatch."""
    return SpeculativeEngine.from_pretrained(
        "selfspec-demo", dtype="float64", exit_layer=4, num_draft_tokens=3, drafter="early_exit"
    )


def test_ships_weights_tokenizer_and_calibration() -> None:
    folder = demo_model_path()
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "selfspec.json"):
        assert (folder / name).is_file(), name
    assert not list(folder.glob("*.bin"))
    size_mb = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    assert size_mb < 25


def test_auto_uses_the_shipped_calibration(demo_engine) -> None:
    saved = json.loads((demo_model_path() / "selfspec.json").read_text())
    assert demo_engine.exit_layer == saved["exit_layer"]
    assert demo_engine.num_draft_tokens == saved["num_draft_tokens"]
    assert demo_engine.runner.dtype == torch.float32 and demo_engine.runner.num_layers == 16


@pytest.mark.slow
def test_greedy_equals_generate_in_float64(demo64) -> None:
    model, tokenizer = demo64.model, demo64.tokenizer
    chat = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    prompts = [demo64.encode_prompt(p) for p in (*heldout_prompts(2), chat)]
    for ids in prompts:
        inputs = torch.tensor([ids])
        reference = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            do_sample=False,
            max_new_tokens=40,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()
        for exit_layer, num_draft in ((2, 4), (4, 3), (8, 6)):
            engine = SpeculativeEngine(
                model, tokenizer, exit_layer=exit_layer, num_draft_tokens=num_draft, drafter="early_exit"
            )
            out = engine.generate_ids(ids, max_new_tokens=40)
            assert out.token_ids == reference, (exit_layer, num_draft)
            assert out.text == tokenizer.decode(reference, skip_special_tokens=True)


@pytest.mark.slow
def test_tau_above_two_on_heldout_austen(demo_engine) -> None:
    model, tokenizer = demo_engine.model, demo_engine.tokenizer
    taus = {}
    for exit_layer in (2, 4, 8):
        engine = SpeculativeEngine(model, tokenizer, exit_layer=exit_layer, num_draft_tokens=4, drafter="early_exit")
        runs = [engine.generate(p, max_new_tokens=48).stats.mean_accepted_length for p in heldout_prompts()]
        taus[exit_layer] = sum(runs) / len(runs)
    assert max(taus.values()) > 2.0, taus
    assert taus[8] >= taus[2]  # deeper exits agree more often


def test_chat_template_and_generation(demo_engine) -> None:
    out = demo_engine.generate([{"role": "user", "content": "Hello! Who are you?"}], max_new_tokens=24)
    assert out.text and out.finish_reason in ("stop", "length")
    assert out.stats.target_forwards >= 1
