"""Offline, single-threaded torch; the demo-model fixtures shared by this package's tests."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["SELFSPEC_THREADS"] = "1"  # threads="auto" (the default) uses one thread without timing

import pytest
import torch

torch.set_num_threads(1)

#: Short answers keep the whole suite to a few CPU minutes.
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="session")
def demo_llm():
    """A ``SpeculativeLLM`` on the bundled demo model (its engine is shared process-wide)."""
    from selfspec import demo_model_path

    from llama_index.llms.selfspec import SpeculativeLLM

    if not (demo_model_path() / "model.safetensors").is_file():
        pytest.fail("the bundled demo model is missing: run python -m demo_model.demo")
    return SpeculativeLLM(model="selfspec-demo", max_new_tokens=MAX_NEW_TOKENS)


#: The key the loopback server of endpoint-mode tests requires.
SERVER_KEY = "endpoint-test-key"


@pytest.fixture(scope="session")
def selfspec_server(demo_llm):
    """``selfspec serve`` on loopback (a free port, uvicorn in a thread) over the shared demo engine.

    Yields the endpoint-mode arguments: ``{"base_url": "http://127.0.0.1:PORT/v1", "api_key": ...}``.
    """
    pytest.importorskip("uvicorn")
    from selfspec.serving.server import serve_in_background

    with serve_in_background(demo_llm.engine, model_id="selfspec-demo", api_key=SERVER_KEY) as root:
        yield {"base_url": f"{root}/v1", "api_key": SERVER_KEY}
