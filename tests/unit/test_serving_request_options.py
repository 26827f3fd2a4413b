"""A request's options are declared once (:class:`RequestOptions`) and every front door reads them.

The planner takes them, the endpoint body sends them, and ``selfspec serve``'s two routes spell
their request bodies in them: these tests pin that each one covers the whole declaration, so an
option added to it and forgotten in one door fails here. No model runs.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from selfspec.serving.endpoint import chat_body, text_body
from selfspec.serving.requests import RequestOptions, plan_request

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
#: The options only the local planner reads (an OpenAI server has its own budget rules and no
#: alias for ``max_tokens``; the adapters ask for no log-probabilities).
PLANNER_ONLY = {"logprobs", "fit_max_tokens", "budget_name"}
#: A value other than the default for every option.
GIVEN: dict[str, Any] = {
    "max_tokens": 5,
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 3,
    "seed": 1,
    "stop": "x",
    "tools": [TOOL],
    "tool_choice": "required",
    "response_format": {"type": "json_object"},
    "json_schema": {"type": "object", "properties": {"a": {"type": "string"}}},
    "truncate_prompt": True,
    "constrain_tool_calls": False,
    "parallel_tool_calls": False,
    "escape_special_tokens": True,
    "logprobs": 2,
    "fit_max_tokens": False,
    "budget_name": "max_new_tokens",
}


def test_every_option_is_declared_once_with_its_default() -> None:
    assert RequestOptions.names() == list(GIVEN)
    defaults = RequestOptions()
    for name, value in GIVEN.items():
        assert getattr(defaults, name) != value, name
    assert (defaults.max_tokens, defaults.temperature, defaults.parallel_tool_calls) == (None, 0.0, True)
    assert RequestOptions.of(None, {"seed": 3}) == RequestOptions(seed=3)
    assert RequestOptions.of(RequestOptions(seed=3), {"top_k": 2}) == RequestOptions(seed=3, top_k=2)
    assert RequestOptions(stop="x").stop_list == ["x"] and RequestOptions(stop=("a", "b")).stop_list == ["a", "b"]


@pytest.mark.parametrize("call", [plan_request, chat_body, text_body])
def test_an_unknown_option_is_refused_naming_the_closest(call: Any) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'temprature' \(did you mean 'temperature'\?\)"):
        if call is plan_request:
            call(object(), "hi", temprature=0.5)
        else:
            call("hi", model="m", temprature=0.5)
    with pytest.raises(TypeError, match="options must be a RequestOptions"):
        chat_body([], {"temperature": 0.5}, model="m")  # type: ignore[arg-type]


def test_the_endpoint_body_sends_every_option_but_the_planners_own() -> None:
    options = RequestOptions(**GIVEN)
    body = chat_body([{"role": "user", "content": "hi"}], options, model="m")
    sent = {
        "max_tokens": body["max_tokens"],
        "temperature": body["temperature"],
        "top_p": body["top_p"],
        "top_k": body["extra_body"]["top_k"],
        "seed": body["seed"],
        "stop": body["stop"],
        "tools": body["tools"],
        "tool_choice": body["tool_choice"],
        "response_format": body["response_format"],  # json_schema wins, as in the planner
        "json_schema": body["response_format"]["json_schema"]["schema"],
        "truncate_prompt": body["extra_body"]["truncate_prompt"],
        "constrain_tool_calls": body["extra_body"]["constrain_tool_calls"],
        "parallel_tool_calls": body["parallel_tool_calls"],
        "escape_special_tokens": body["extra_body"]["escape_special_tokens"],
    }
    assert set(sent) | PLANNER_ONLY == set(RequestOptions.names())
    assert sent["json_schema"] == GIVEN["json_schema"] and sent["stop"] == ["x"]
    assert (sent["truncate_prompt"], sent["constrain_tool_calls"], sent["parallel_tool_calls"]) == (True, False, False)
    assert not PLANNER_ONLY & (set(body) | set(body["extra_body"]))
    # the keyword form is the same body
    assert chat_body([{"role": "user", "content": "hi"}], model="m", **GIVEN) == body
    # a raw prompt sends the sampling options only
    text = text_body("hi", options, model="m")
    assert set(text) - set(body) == {"prompt"} and "tools" not in text and "response_format" not in text


def test_tool_choice_none_offers_no_tools_as_the_planner_reads_it() -> None:
    body = chat_body([], RequestOptions(tools=[TOOL], tool_choice="none", parallel_tool_calls=False), model="m")
    assert not {"tools", "tool_choice", "parallel_tool_calls"} & set(body)


def test_the_servers_routes_spell_their_bodies_in_the_declaration() -> None:
    pytest.importorskip("pydantic")
    from selfspec.serving.server.protocol import ChatCompletionRequest, CompletionRequest

    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            **{name: GIVEN[name] for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")},
            **{name: GIVEN[name] for name in ("tools", "tool_choice", "response_format", "truncate_prompt")},
            "constrain_tool_calls": False,
            "parallel_tool_calls": False,
            "escape_special_tokens": True,
            "logprobs": True,
            "top_logprobs": 2,
        }
    ).request_options()
    changed = {declared.name for declared in fields(chat) if getattr(chat, declared.name) != declared.default}
    # every option but the adapters' json_schema and SpeculativeLLM's budget alias
    assert changed == set(RequestOptions.names()) - {"json_schema", "budget_name"}
    assert chat.fit_max_tokens is False and chat.logprobs == 2 and chat.stop == "x"
    text = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 1})
    assert text.request_options() == RequestOptions(max_tokens=3, temperature=1.0, logprobs=1, fit_max_tokens=False)
    legacy = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [], "functions": [TOOL["function"]], "function_call": {"name": "f"}}
    ).request_options()
    assert legacy.tools == [TOOL] and legacy.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert legacy.parallel_tool_calls is False
