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
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_engine():
    """The bundled demo model, loaded once (skips cleanly if it was never trained)."""
    from selfspec import SpeculativeEngine, demo_model_path

    if not (demo_model_path() / "model.safetensors").is_file():
        pytest.fail("the bundled demo model is missing: run python -m selfspec.training.demo")
    return SpeculativeEngine.from_pretrained("selfspec-demo")
