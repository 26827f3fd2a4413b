"""Offline, single-threaded torch; async tests run without ``asyncio_mode=auto``; the demo model.

The repository runs every test folder in one pytest invocation whose configuration keeps
pytest-asyncio in strict mode, while LangChain's standard tests are plain ``async def``
methods: the hook below marks this package's coroutine tests with ``asyncio`` as they are
collected, which is what ``asyncio_mode = "auto"`` (set in this package's own pyproject) does.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Generator
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["SELFSPEC_THREADS"] = "1"  # threads="auto" (the default) uses one thread without timing

import pytest
import torch

torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Generator[None, Any, None]:
    outcome = yield
    result = outcome.get_result()
    if not result:
        return
    items = list(result) if isinstance(result, (list, tuple)) else [result]
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(getattr(item, "obj", None)):
            if item.get_closest_marker("asyncio") is None:
                item.add_marker(pytest.mark.asyncio)
    outcome.force_result(items)


def require_demo_model() -> None:
    from selfspec import demo_model_path

    if not (demo_model_path() / "model.safetensors").is_file():
        pytest.fail("the bundled demo model is missing: run python -m demo_model.demo")


@pytest.fixture(scope="session")
def demo_engine() -> Any:
    """The shared engine of ``ChatSpeculative(model="selfspec-demo")`` (default engine args)."""
    require_demo_model()
    from langchain_selfspec import ChatSpeculative

    return ChatSpeculative(model="selfspec-demo").get_engine()


#: The key the loopback server of endpoint-mode tests requires.
SERVER_KEY = "endpoint-test-key"


@pytest.fixture(scope="session")
def selfspec_server(demo_engine: Any) -> Any:
    """``selfspec serve`` on loopback (a free port, uvicorn in a thread) over the shared demo engine.

    Yields the endpoint-mode arguments: ``{"base_url": "http://127.0.0.1:PORT/v1", "api_key": ...}``.
    """
    pytest.importorskip("uvicorn")
    from selfspec.serving.server import serve_in_background

    with serve_in_background(demo_engine, model_id="selfspec-demo", api_key=SERVER_KEY) as root:
        yield {"base_url": f"{root}/v1", "api_key": SERVER_KEY}
