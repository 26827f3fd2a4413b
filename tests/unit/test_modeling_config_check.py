"""``selfspec.modeling.config_check``: a model config's sizes checked against bounds and its weights' headers.

The weights are tiny safetensors files written to ``tmp_path``; only their headers are read.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from selfspec.errors import CorruptCheckpointError, ModelConfigError, SelfSpecError
from selfspec.modeling.config_check import (
    CONFIG_BOUNDS,
    check_config_values,
    check_config_weights,
    read_safetensors_header,
    read_weight_shapes,
)

FILE = "/models/tiny/config.json"
#: A Llama-shaped config: 2 layers, 4 heads of 4 (2 key/value heads), a 32-token vocabulary.
CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 16,
    "intermediate_size": 24,
    "vocab_size": 32,
    "max_position_embeddings": 128,
}


def tiny_weights(folder: Path, *, layers: int = 2, vocab: int = 32, hidden: int = 16, kv_rows: int = 8) -> Path:
    """A ``model.safetensors`` holding the tensors a Llama checkpoint of these sizes holds (no MLP)."""
    tensors = {"model.embed_tokens.weight": torch.zeros(vocab, hidden), "model.norm.weight": torch.zeros(hidden)}
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.zeros(hidden, hidden)
        tensors[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(kv_rows, hidden)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def config(**changes: Any) -> SimpleNamespace:
    """A resolved config object (what transformers' ``AutoConfig`` gives), ``head_dim`` unset."""
    return SimpleNamespace(**{**CONFIG, "head_dim": None, **changes})


def test_a_sane_config_passes() -> None:
    check_config_values(CONFIG, FILE)
    check_config_values({}, FILE)  # absent fields: the architecture's defaults, checked once resolved


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_hidden_layers", 1_000_000),  # the config bomb: transformers would build a million layers
        ("num_hidden_layers", 0),
        ("num_hidden_layers", -3),
        ("num_hidden_layers", True),
        ("num_hidden_layers", 2.0),
        ("num_attention_heads", 0),  # transformers: ZeroDivisionError
        ("num_attention_heads", "4"),
        ("num_attention_heads", None),
        ("hidden_size", [16]),
        ("vocab_size", 1.5),
        ("max_position_embeddings", -1),
        ("intermediate_size", 2**40),
        ("num_key_value_heads", 0),
        ("head_dim", -1),
        ("sliding_window", 0),
    ],
)
def test_a_size_out_of_bounds_names_the_file_the_field_the_value_and_the_range(field: str, value: Any) -> None:
    with pytest.raises(ModelConfigError) as caught:
        check_config_values({**CONFIG, field: value}, FILE)
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, SelfSpecError)
    assert (error.file, error.field, error.value) == (FILE, field, value)
    bound = CONFIG_BOUNDS[field]
    assert str(error) == f"{FILE}: {field}={value!r} is invalid; it must be {error.valid}"
    assert f"[{bound.low}, {bound.high}]" in str(error) and "\n" not in str(error)


def test_optional_sizes_may_be_null() -> None:
    check_config_values({**CONFIG, "head_dim": None, "sliding_window": None, "num_key_value_heads": None}, FILE)


def test_sizes_that_disagree_with_each_other() -> None:
    with pytest.raises(ModelConfigError, match=r"hidden_size=18 .*multiple of num_attention_heads \(4\)"):
        check_config_values({**CONFIG, "hidden_size": 18}, FILE)
    check_config_values({**CONFIG, "hidden_size": 18, "head_dim": 4}, FILE)  # Gemma: heads set their own width
    with pytest.raises(ModelConfigError, match=r"num_key_value_heads=3 .*divisor of num_attention_heads \(4\)"):
        check_config_values({**CONFIG, "num_key_value_heads": 3}, FILE)


def test_the_header_is_read_without_the_tensor_data(tmp_path: Path) -> None:
    tiny_weights(tmp_path)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    assert header["model.embed_tokens.weight"].shape == (32, 16)
    assert header["model.layers.1.self_attn.k_proj.weight"].dtype == "F32"
    weights = read_weight_shapes(tmp_path)
    assert weights is not None and weights.layer_indices() == [0, 1] and weights.shown == "model.safetensors"
    assert read_weight_shapes(tmp_path / "missing") is None


def test_matching_weights_pass(tmp_path: Path) -> None:
    weights = read_weight_shapes(tiny_weights(tmp_path))
    assert weights is not None
    check_config_weights(config(), weights, FILE)


@pytest.mark.parametrize(
    ("changes", "field", "valid"),
    [
        ({"num_hidden_layers": 5}, "num_hidden_layers", "2: model.safetensors holds 2 layers"),
        ({"num_hidden_layers": 1}, "num_hidden_layers", "2: model.safetensors holds 2 layers"),
        ({"vocab_size": 64}, "vocab_size", "32: model.safetensors's embedding is [32, 16]"),
        ({"hidden_size": 32}, "hidden_size", "16: model.safetensors's embedding is [32, 16]"),
        ({"num_attention_heads": 8, "head_dim": 4}, "num_attention_heads", "4: model.safetensors's q_proj"),
        ({"num_key_value_heads": 4}, "num_key_value_heads", "2: model.safetensors's k_proj has 8 rows"),
    ],
)
def test_a_config_that_is_not_its_weights(tmp_path: Path, changes: dict[str, Any], field: str, valid: str) -> None:
    weights = read_weight_shapes(tiny_weights(tmp_path))
    assert weights is not None
    with pytest.raises(ModelConfigError) as caught:
        check_config_weights(config(**changes), weights, FILE)
    assert caught.value.field == field and caught.value.value == changes[field]
    assert caught.value.valid.startswith(valid) and str(caught.value).startswith(f"{FILE}: {field}=")


def test_sharded_weights_are_read_through_their_index(tmp_path: Path) -> None:
    first, second = "model-1-of-2.safetensors", "model-2-of-2.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(32, 16)}, str(tmp_path / first))
    save_file({"model.layers.0.mlp.w": torch.zeros(2), "model.layers.1.mlp.w": torch.zeros(2)}, str(tmp_path / second))
    weight_map = {"model.embed_tokens.weight": first, "model.layers.0.mlp.w": second, "model.layers.1.mlp.w": second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    weights = read_weight_shapes(tmp_path)
    assert weights is not None and weights.layer_indices() == [0, 1] and weights.shown.endswith("(+1 shards)")
    check_config_weights(config(), weights, FILE)
    with pytest.raises(ModelConfigError, match="holds 2 layers"):
        check_config_weights(config(num_hidden_layers=3), weights, FILE)


def test_packed_quantized_weights_are_counted_not_measured(tmp_path: Path) -> None:
    save_file({"model.embed_tokens.weight": torch.zeros(256, 1, dtype=torch.uint8),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(128, 1, dtype=torch.uint8),
               "model.layers.1.self_attn.q_proj.weight": torch.zeros(128, 1, dtype=torch.uint8)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    weights = read_weight_shapes(tmp_path)
    assert weights is not None
    check_config_weights(config(), weights, FILE)


@pytest.mark.parametrize(
    "content",
    [
        b"",  # empty
        b"\x05\x00",  # shorter than the length prefix
        struct.pack("<Q", 10**12) + b"{}",  # a header longer than the file
        struct.pack("<Q", 6) + b"not js",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 24) + b'{"a": {"dtype": "F32"}} ',  # no shape
    ],
)
def test_a_corrupt_header_is_a_clear_error_naming_the_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        read_weight_shapes(tmp_path)


def test_a_corrupt_shard_index_names_it(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors\.index\.json is not a readable shard index"):
        read_weight_shapes(tmp_path)
