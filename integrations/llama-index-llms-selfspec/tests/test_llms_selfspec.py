"""Unit tests of SpeculativeLLM that need no model: class shape, messages, tool handling."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, ToolCallBlock
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, ValidationError

from llama_index.llms.selfspec import SpeculativeLLM
from llama_index.llms.selfspec import base as selfspec_base


def multiply(x: int, y: int) -> int:
    """Multiply two integers."""
    return x * y


def test_class_is_a_function_calling_llm():
    names_of_base_classes = [b.__name__ for b in SpeculativeLLM.__mro__]
    assert BaseLLM.__name__ in names_of_base_classes
    assert FunctionCallingLLM.__name__ in names_of_base_classes


def test_all_exports():
    import llama_index.llms.selfspec as package

    assert package.__all__ == ["SpeculativeLLM", "__version__"]
    assert isinstance(package.__version__, str)


def test_namespace_packages_have_no_init():
    from pathlib import Path

    import llama_index.llms.selfspec as package

    llms = Path(package.__file__).parent.parent
    assert not (llms / "__init__.py").exists()
    assert not (llms.parent / "__init__.py").exists()


def test_construction_loads_nothing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the engine must load on first use, not at construction")

    monkeypatch.setattr(selfspec_base, "get_engine", fail)
    llm = SpeculativeLLM(model="/no/such/model", temperature=0.5, context_window=512, max_new_tokens=32)
    assert llm.metadata.context_window == 512
    assert llm.metadata.num_output == 32
    assert llm.metadata.is_chat_model and llm.metadata.is_function_calling_model
    assert llm.metadata.model_name == "/no/such/model"
    assert "model='/no/such/model'" in repr(llm)
    assert llm.class_name() == "SpeculativeLLM"


def test_max_tokens_and_its_alias_max_new_tokens() -> None:
    """The budget is max_tokens, as in ChatSpeculative and OpenAI; max_new_tokens (the engine's name) is an alias."""
    assert SpeculativeLLM(model="m", max_tokens=32).max_tokens == 32
    alias = SpeculativeLLM(model="m", max_new_tokens=16, context_window=512)
    assert alias.max_tokens == alias.max_new_tokens == 16 and alias.metadata.num_output == 16
    assert "max_tokens=16" in repr(alias)
    assert SpeculativeLLM.from_dict(alias.to_dict()).max_tokens == 16  # serialised under the field's name
    for name in ("max_tokens", "max_new_tokens"):
        with pytest.raises(ValidationError, match=rf"{name}\n  Input should be greater than 0"):
            SpeculativeLLM(model="m", **{name: 0})  # the error names what was written
    with pytest.raises(ValidationError, match="either max_tokens or its alias max_new_tokens"):
        SpeculativeLLM(model="m", max_tokens=8, max_new_tokens=8)


def test_a_calls_options_are_the_planners_declaration() -> None:
    """Local and endpoint mode read one RequestOptions: the call's arguments over the fields."""
    from selfspec.serving.requests import RequestOptions

    llm = SpeculativeLLM(model="m", temperature=0.3, stop=["a"], truncate_prompt=True, constrain_tool_calls=False)
    options = llm._options({"max_new_tokens": 9, "seed": 2, "json_schema": {"type": "object"}, "verbose": True})
    assert options == RequestOptions(
        max_tokens=9,
        budget_name="max_new_tokens",
        temperature=0.3,
        seed=2,
        stop=["a"],
        tools=[],
        json_schema={"type": "object"},
        truncate_prompt=True,
        constrain_tool_calls=False,
    )
    with pytest.raises(ValueError, match="unknown argument 'truncate_prompt'"):
        llm._options({"truncate_prompt": False})  # a field, not a call's option
    body = SpeculativeLLM(model="m", base_url="http://127.0.0.1:9/v1")._body("hi", llm._options({"seed": 1}))
    assert body["prompt"] == "hi" and body["seed"] == 1 and body["extra_body"] == {"truncate_prompt": True}


def test_engine_arguments_follow_the_fields(monkeypatch):
    calls = []
    monkeypatch.setattr(selfspec_base, "get_engine", lambda model, **args: calls.append((model, args)))
    llm = SpeculativeLLM(model="m", quantization="4bit", exit_layer=3, num_draft_tokens=2, drafter="none")
    llm.engine  # noqa: B018
    assert calls == [
        (
            "m",
            {
                "quantization": "4bit",
                "dtype": "auto",
                "device": "auto",
                "exit_layer": 3,
                "num_draft_tokens": 2,
                "drafter": "none",
                "draft_confidence": None,
                "trust_remote_code": False,
                "allow_pickle": False,
                "threads": "auto",
                "calibrate": True,
                "gguf_file": None,
                "draft_model": None,
                "exit_adapter": None,
                "medusa_heads": None,
                "eagle_head": None,
                "learn_online": False,
                "tree_nodes": None,
                "batching": False,
                "compile": "auto",
                "row_exact": "auto",
                "escape_special_tokens": False,
                "calibration_budget": 300.0,
            },
        )
    ]


def test_messages_render_tool_calls_and_results():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "multiply", "arguments": '{"x": 2, "y": 3}'},
    }
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="What is 2 times 3?"),
        ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [call]}),
        ChatMessage(role=MessageRole.TOOL, content="6", additional_kwargs={"tool_call_id": "call_1"}),
        ChatMessage(
            role=MessageRole.ASSISTANT,
            blocks=[ToolCallBlock(tool_call_id="call_2", tool_name="multiply", tool_kwargs={"x": 1, "y": 1})],
        ),
    ]
    assert selfspec_base.to_engine_messages(messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 times 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": {"x": 2, "y": 3}},
                }
            ],
        },
        {"role": "tool", "content": "6", "tool_call_id": "call_1"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "multiply", "arguments": {"x": 1, "y": 1}},
                }
            ],
        },
    ]


def _assistant_message(text, parse_tools=True):
    """The assistant message the adapter builds from a local answer (the one response builder)."""
    from selfspec.serving.tools import ParsedOutput, parse_tool_calls

    parsed = parse_tool_calls(text) if parse_tools else ParsedOutput(content=text)
    answer = selfspec_base._Answer(parsed.content, parsed.tool_calls, parsed.invalid_tool_calls, "stop", {}, {}, "m", 8)
    return selfspec_base._final_response("chat", answer).message


def test_tool_calls_are_parsed_from_the_models_format():
    text = 'Let me compute.\n<tool_call>{"name": "multiply", "arguments": {"x": 7, "y": 6}}</tool_call>'
    message = _assistant_message(text, parse_tools=True)
    assert message.content == "Let me compute."
    llm = SpeculativeLLM()
    (selection,) = llm.get_tool_calls_from_response(ChatResponse(message=message))
    assert selection.tool_name == "multiply"
    assert selection.tool_kwargs == {"x": 7, "y": 6}
    assert selection.tool_id.startswith("call_")
    # the call renders back into the chat template's form
    (rendered,) = selfspec_base.to_engine_messages([message])
    assert rendered["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"x": 7, "y": 6}}


def test_no_tool_call():
    llm = SpeculativeLLM()
    message = _assistant_message('<tool_call>{"name": "multiply", "argu', parse_tools=True)
    response = ChatResponse(message=message)
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="malformed tool calls"):
        llm.get_tool_calls_from_response(response)
    plain = _assistant_message("<tool_call> is only text here", parse_tools=False)
    assert plain.content == "<tool_call> is only text here"


def test_parallel_tool_calls_are_trimmed_unless_allowed():
    llm = SpeculativeLLM()
    text = "".join(
        f'<tool_call>{{"name": "multiply", "arguments": {{"x": {i}, "y": 1}}}}</tool_call>' for i in range(2)
    )
    response = ChatResponse(message=_assistant_message(text, parse_tools=True))
    assert len(llm.get_tool_calls_from_response(response)) == 2
    llm._validate_chat_with_tools_response(response, [], allow_parallel_tool_calls=False)
    assert len(llm.get_tool_calls_from_response(response)) == 1


def test_prepare_chat_with_tools():
    llm = SpeculativeLLM()
    tool = FunctionTool.from_defaults(fn=multiply)
    history = [ChatMessage(role=MessageRole.USER, content="hi")]
    kwargs = llm._prepare_chat_with_tools([tool], "What is 2 times 3?", chat_history=history, tool_required=True)
    assert len(history) == 1  # the caller's history is not modified
    assert [m.content for m in kwargs["messages"]] == ["hi", "What is 2 times 3?"]
    assert kwargs["tools"] == [tool]
    assert kwargs["tool_choice"] == "required"
    kwargs = llm._prepare_chat_with_tools([tool], "x", tool_choice="multiply")
    assert kwargs["tool_choice"] == "multiply"


def test_tool_schemas_and_forced_choice():
    class Person(BaseModel):
        """A person."""

        name: str

    schemas = [selfspec_base.tool_schema(t) for t in (FunctionTool.from_defaults(fn=multiply), Person, multiply)]
    assert [s["function"]["name"] for s in schemas] == ["multiply", "Person", "multiply"]
    assert schemas[0]["function"]["parameters"]["required"] == ["x", "y"]
    from selfspec.serving.requests import forced_tool, normalize_tool_choice

    names = [s["function"]["name"] for s in schemas]

    def forced(tools, choice):
        return forced_tool(normalize_tool_choice(choice, names), tools)

    assert forced(schemas, None) is None
    assert forced(schemas, "auto") is None
    assert forced(schemas, "required") == ""
    assert forced(schemas, "Person") == "Person"
    assert forced(schemas, {"type": "function", "function": {"name": "multiply"}}) == "multiply"
    with pytest.raises(ValueError, match="not one of the tools"):
        forced(schemas, "divide")


def test_every_engine_argument_is_a_field():
    from selfspec import EngineOptions  # the one declaration (from_pretrained's parameters are pinned to it)

    parameters = set(EngineOptions.names())
    assert parameters <= set(SpeculativeLLM.model_fields)
    # every engine argument is passed; the registry fills defaults, so both adapters share one key
    assert set(SpeculativeLLM()._engine_args()) == parameters
    assert (
        SpeculativeLLM(drafter="draft_model", draft_model="small/model")._engine_args()["draft_model"] == "small/model"
    )
    assert SpeculativeLLM(drafter="medusa", medusa_heads="heads/")._engine_args()["medusa_heads"] == "heads/"
