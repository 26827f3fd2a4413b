"""LangChain's standard integration tests on the bundled demo model, with honest capability flags.

No inherited test is overridden. Tool calling, tool choice, structured output and JSON mode
are on; images, audio, PDF and Anthropic-style inputs are off (the model reads text only).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_selfspec import ChatSpeculative

#: Short answers keep the suite within a few CPU minutes (the standard default is 100).
MAX_TOKENS = 64


@pytest.fixture(scope="module", autouse=True)
def _demo_model(demo_engine: Any) -> None:
    """Load the shared engine once, before the first test (and fail clearly if it is missing)."""


class TestChatSpeculativeStandard(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpeculative]:
        return ChatSpeculative

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "selfspec-demo", "max_tokens": MAX_TOKENS}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        # the same weights through their folder: a second engine, so the override is real
        from selfspec import demo_model_path

        return str(demo_model_path())
