"""The bundled draft model ``selfspec-demo-draft`` and the exit adapter shipped beside it.

``selfspec-demo-draft`` (6 layers x 192) was trained on the demo model's corpus with the demo
tokenizer and *without* early-exit losses: it is both the demo model's draft model and our
"stock" model for exit adapters. Exactness is checked in float64 against ``generate``; the
tau bounds sit well below what was measured (see ``benchmarks/results/``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec import SpeculativeEngine, demo_model_path
from selfspec.drafting.exit_adapter.adapter import find_exit_adapter, load_exit_adapter
from selfspec.modeling.loading import DEMO_DRAFT_MODEL

HELD_OUT = json.loads((Path(__file__).parents[1] / "data" / "heldout_austen.json").read_text(encoding="utf-8"))


def heldout_prompts(count: int = 2, words: int = 40) -> list[str]:
    return [" ".join(p.split()[:words]) for p in HELD_OUT["paragraphs"][:count]]


def reference(engine: SpeculativeEngine, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` with the model's own generation config."""
    inputs = torch.tensor([ids])
    out = engine.model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=engine.tokenizer.pad_token_id,
    )
    return out[0, len(ids) :].tolist()


def test_ships_a_small_draft_model_sharing_the_demo_tokenizer() -> None:
    folder = demo_model_path(DEMO_DRAFT_MODEL)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "training_args.json"):
        assert (folder / name).is_file(), name
    assert (folder / "tokenizer.json").read_bytes() == (demo_model_path() / "tokenizer.json").read_bytes()
    args = json.loads((folder / "training_args.json").read_text())
    assert args["exit_layers"] == [] and args["layers"] == 6  # a stock model: no early-exit losses
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["dtype"] == "float16"
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20 < 12
    shipped = find_exit_adapter(str(folder))  # shipped beside the model, read only
    assert shipped == folder / "exit_adapter"
    adapter = load_exit_adapter(shipped)
    assert adapter.config.num_layers == 6 and adapter.config.hidden_size == 192


@pytest.mark.slow
def test_demo_with_its_draft_model_equals_generate_in_float64() -> None:
    engine = SpeculativeEngine.from_pretrained(
        "selfspec-demo", dtype="float64", drafter="draft_model", draft_model=DEMO_DRAFT_MODEL, num_draft_tokens=3
    )
    taus = []
    for prompt in heldout_prompts():
        ids = engine.encode_prompt(prompt)
        out = engine.generate_ids(ids, max_new_tokens=40)
        assert out.token_ids == reference(engine, ids, 40)
        taus.append(out.stats.mean_accepted_length)
    assert sum(taus) / len(taus) > 1.8, taus  # measured 2.6 and 1.95 on these prompts


@pytest.mark.slow
def test_shipped_exit_adapter_raises_tau_of_the_stock_model() -> None:
    adapted = SpeculativeEngine.from_pretrained(
        DEMO_DRAFT_MODEL, dtype="float64", exit_adapter="auto", num_draft_tokens=3
    , drafter="early_exit")
    assert adapted.exit_adapter is not None
    plain = SpeculativeEngine(
        adapted.model, adapted.tokenizer, exit_layer=adapted.exit_layer, num_draft_tokens=3, exit_adapter=None
    , drafter="early_exit")
    with_adapter, without = [], []
    for prompt in heldout_prompts(3):
        ids = adapted.encode_prompt(prompt)
        expected = reference(adapted, ids, 40)
        a, b = adapted.generate_ids(ids, max_new_tokens=40), plain.generate_ids(ids, max_new_tokens=40)
        assert a.token_ids == expected and b.token_ids == expected
        with_adapter.append(a.stats.mean_accepted_length)
        without.append(b.stats.mean_accepted_length)
    # measured: 3.0, 3.0, 2.79 with the adapter; 2.6, 2.29, 1.77 without
    assert sum(with_adapter) > sum(without) + 0.3 * len(without), (with_adapter, without)


def test_training_script_makes_a_stock_draft_model_with_the_target_tokenizer(tmp_path) -> None:
    """The options that made ``selfspec-demo-draft``: shape, a reused tokenizer, no early-exit loss."""
    from demo_model import demo

    out = tmp_path / "draft"
    argv = ["--data", str(Path(__file__).parents[1] / "data" / "austen_excerpt.txt"), "--out", str(out)]
    argv += ["--steps", "2", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--layers", "2"]
    argv += ["--hidden", "64", "--tokenizer", str(demo_model_path()), "--exit-layers", "--layer-dropout", "0"]
    threads = torch.get_num_threads()
    try:
        assert demo.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (2, 64, 1)
    assert (out / "tokenizer.json").read_bytes() == (demo_model_path() / "tokenizer.json").read_bytes()
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config
    args = json.loads((out / "training_args.json").read_text())
    assert args["exit_layers"] == [] and args["loss"] == "final CE only (no early-exit losses)"
    assert json.loads((out / "selfspec.json").read_text())["exit_layer"] == 1  # only layer 1 of 2 can exit
    with pytest.raises(ValueError, match="multiple of 64"):
        demo.model_config(demo.PreTrainedTokenizerFast.from_pretrained(str(out)), 4096, 2, 100)
