"""bitsandbytes 4-bit (NF4) and 8-bit targets on CPU: greedy output equals the quantized
model's own ``generate`` (the reference for a quantized target is the same quantized model)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUANTIZABLE_SHAPE, make_model, reference_greedy

from selfspec import QuantizationError, SpeculativeEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama", dtype=torch.float32, **QUANTIZABLE_SHAPE).save_pretrained(path)
    return path


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_quantized_greedy_equals_quantized_generate(model_dir, quantization: str) -> None:
    import bitsandbytes as bnb

    engine = SpeculativeEngine.from_pretrained(
        model_dir, quantization=quantization, device="cpu", exit_layer=2, num_draft_tokens=3, drafter="early_exit"
    )
    linear = engine.model.model.layers[0].self_attn.q_proj
    assert isinstance(linear, bnb.nn.Linear4bit if quantization == "4bit" else bnb.nn.Linear8bitLt)
    for prompt in ([5, 9, 17, 33, 40, 41, 42], list(range(60, 90))):
        reference = reference_greedy(engine.model, prompt, 16)
        out = engine.generate_ids(prompt, max_new_tokens=16)
        assert out.token_ids == reference
    assert engine.generate_ids(prompt, max_new_tokens=16).stats.num_drafted > 0


def test_4bit_rejects_layer_sizes_bitsandbytes_cpu_cannot_run(tmp_path) -> None:
    make_model(
        "llama", dtype=torch.float32, hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    ).save_pretrained(tmp_path)
    with pytest.raises(QuantizationError, match="multiple of 32"):
        SpeculativeEngine.from_pretrained(tmp_path, quantization="4bit", device="cpu")


def test_unknown_quantization_is_refused(model_dir) -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        SpeculativeEngine.from_pretrained(model_dir, quantization="3bit", device="cpu")


def test_missing_bitsandbytes_is_a_clear_error(model_dir, monkeypatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real_find_spec(name, *a)
    )
    with pytest.raises(QuantizationError, match="pip install"):
        SpeculativeEngine.from_pretrained(model_dir, quantization="4bit", device="cpu")
