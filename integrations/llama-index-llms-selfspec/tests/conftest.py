"""Offline, single-threaded torch; the demo-model fixtures shared by this package's tests."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
        pytest.fail("the bundled demo model is missing: run python -m selfspec.training.demo")
    return SpeculativeLLM(model="selfspec-demo", max_new_tokens=MAX_NEW_TOKENS)


#: The key the loopback server of endpoint-mode tests requires.
SERVER_KEY = "endpoint-test-key"


@pytest.fixture(scope="session")
def selfspec_server(demo_llm):
    """``selfspec serve`` on loopback (a free port, uvicorn in a thread) over the shared demo engine.

    Yields the endpoint-mode arguments: ``{"base_url": "http://127.0.0.1:PORT/v1", "api_key": ...}``.
    """
    import socket
    import threading
    import time

    uvicorn = pytest.importorskip("uvicorn")
    from selfspec.server import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    app = create_app(demo_llm.engine, model_id="selfspec-demo", api_key=SERVER_KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield {"base_url": f"http://127.0.0.1:{port}/v1", "api_key": SERVER_KEY}
    server.should_exit = True
    thread.join(timeout=30)
