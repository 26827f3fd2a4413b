"""``SpeculativeLLM``: a LlamaIndex LLM on selfspec's lossless self-speculative decoding.

The model drafts tokens with its own first layers and verifies them with all of its layers in
one forward pass, so the text is exactly what the model alone would write (token-identical when
greedy), only sooner. Weights load on first use, and every ``SpeculativeLLM`` (and every LangChain
``ChatSpeculative``) with the same engine arguments shares one engine through
:func:`selfspec.get_engine`.

Where things live:

- chat messages -> the tokenizer's chat template: :func:`to_engine_messages`;
- tool schemas, forced tool calls, parsing the model's tool calls: :mod:`selfspec.tools` and
  :mod:`selfspec.grammar` (shared with the LangChain adapter);
- response objects, streamed or not: :meth:`SpeculativeLLM._chat_response` and
  :meth:`SpeculativeLLM._completion_response` (the sync, async and streaming paths all end there);
- endpoint mode (``base_url=...``: an OpenAI-compatible server instead of a local engine):
  :mod:`selfspec.endpoint` (shared with the LangChain adapter) and
  :meth:`SpeculativeLLM._endpoint_body`; its answers end in the same two response builders.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, ValidationError
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.types import PydanticProgramMode

from selfspec import GenerationOutput, GenerationStream, SpeculativeEngine, TokenConstraint, get_engine
from selfspec.endpoint import EndpointClient, EndpointResult, chat_body, text_body
from selfspec.errors import ConfigurationError
from selfspec.registry import engine_args
from selfspec.tools import ContentDelta, InvalidToolCall, StreamEvent, ToolCall

if TYPE_CHECKING:
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

logger = logging.getLogger(__name__)
dispatcher = instrument.get_dispatcher(__name__)

Model = TypeVar("Model", bound=BaseModel)

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {"developer": "system", "function": "tool", "model": "assistant", "chatbot": "assistant"}
#: ``tool_choice`` values that force some tool call, whichever the model picks.
_ANY_TOOL = ("required", "any")

#: Instruction added to the system message by :meth:`SpeculativeLLM.structured_predict`.
STRUCTURED_INSTRUCTION = "Answer with one JSON object that matches this JSON schema: "


class SpeculativeLLM(FunctionCallingLLM):
    """A LlamaIndex LLM that runs a Hugging Face causal LM with lossless self-speculation.

    The model drafts with its own early layers and verifies the draft with all of them in one
    forward pass: greedy output is token-identical to the model alone, sampled output follows
    its distribution exactly. Works in query engines, chat engines and agents (it is a
    ``FunctionCallingLLM``: tools are rendered by the chat template, tool calls are parsed from
    the model's own format, and forced tool calls and ``structured_predict`` are constrained to
    valid JSON by a grammar applied to draft and target alike).

    Weights load on first use; every instance with the same engine arguments shares one engine.
    With ``base_url`` set (endpoint mode) no engine is loaded: every call goes to that
    OpenAI-compatible server (``selfspec serve``, vLLM or SGLang), streaming, tools and token
    counts included.
    Responses carry token counts (``raw["usage"]`` and ``additional_kwargs``, read by
    ``TokenCountingHandler``) and the speculation statistics under the names of
    :class:`selfspec.GenerationStats`.

    Examples:
        ``pip install -e integrations/llama-index-llms-selfspec`` (from a selfspec checkout);
        this runs offline on the demo model bundled with selfspec:

        ```python
        from llama_index.core import Document, Settings, VectorStoreIndex
        from llama_index.core.embeddings import MockEmbedding
        from llama_index.core.llms import ChatMessage
        from llama_index.llms.selfspec import SpeculativeLLM

        llm = SpeculativeLLM(model="selfspec-demo", max_new_tokens=64)  # loads on first use
        print(llm.complete("Who is Mr. Darcy?").text)

        response = llm.chat([ChatMessage(role="user", content="Tell me about Longbourn.")])
        print(response.message.content, response.raw["usage"], response.raw["mean_accepted_length"])
        for chunk in llm.stream_chat([ChatMessage(role="user", content="Hello!")]):
            print(chunk.delta, end="")

        Settings.llm = llm
        Settings.embed_model = MockEmbedding(embed_dim=8)
        index = VectorStoreIndex.from_documents(
            [Document(text="Elizabeth Bennet lives at Longbourn with her four sisters.")]
        )
        print(index.as_query_engine().query("Where does Elizabeth live?"))
        ```
    """

    model: str = Field(
        default="selfspec-demo",
        description="A hub id, a local folder, or 'selfspec-demo' (the small model bundled with selfspec).",
    )
    quantization: str | None = Field(default=None, description="None, '4bit' (bitsandbytes NF4) or '8bit'.")
    exit_layer: int | str = Field(
        default="auto",
        description="Layers the draft runs; 'auto' uses the saved calibration, else num_layers // 4.",
    )
    num_draft_tokens: int | str = Field(
        default="auto",
        description="Tokens drafted per round; 'auto' starts from the saved calibration and adapts "
        "to recent acceptance.",
    )
    drafter: str = Field(
        default="early_exit",
        description="How drafts are made: 'early_exit' (self-speculation), 'prompt_lookup', 'hybrid', "
        "'layer_skip', 'draft_model', 'medusa' or 'none' (plain decoding); see selfspec.engine.DRAFTERS.",
    )
    draft_confidence: float | None = Field(
        default=None,
        description="With num_draft_tokens='auto', stop drafting when the draft's top probability "
        "falls below this (None: the engine's default).",
    )
    tree_nodes: int | Literal["auto"] | None = Field(
        default=None,
        description="None drafts a chain; an int drafts a token tree of at most that many nodes, "
        "verified in one forward; 'auto' uses the calibrated choice.",
    )
    batching: bool = Field(
        default=False,
        description="Decode concurrent calls on the shared engine together (selfspec.batching): each call "
        "keeps the text it gets alone; more throughput when many threads or tasks share the model.",
    )
    device: str = Field(default="auto", description="'auto' (CUDA when available), 'cpu' or 'cuda[:N]'.")
    dtype: str = Field(
        default="auto",
        description="'auto' (float32 on CPU, the checkpoint's dtype on GPU) or a name such as 'bfloat16'.",
    )
    trust_remote_code: bool = Field(default=False, description="Allow checkpoints that ship their own Python code.")
    allow_pickle: bool = Field(default=False, description="Allow .bin (pickle) weights when no safetensors exist.")
    calibrate: bool = Field(
        default=True,
        description="With 'auto' exit layer or draft length and no saved calibration, measure one on first load.",
    )
    draft_model: Any = Field(
        default=None,
        description="With drafter='draft_model': a smaller model sharing the tokenizer (a name, a folder "
        "or a loaded model) that drafts instead of the early exit.",
    )
    exit_adapter: str | None = Field(
        default=None,
        description="A trained exit adapter folder for the early-exit and hybrid drafters (selfspec "
        "train-adapter), 'auto' for the one saved beside the model, or None. Drafts only: the text never changes.",
    )
    medusa_heads: str | None = Field(
        default=None,
        description="With drafter='medusa': a folder of Medusa heads in the published layout "
        "(None: the heads saved beside the model, e.g. the demo model's).",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0 for greedy decoding; > 0 samples.")
    max_new_tokens: int = Field(default=256, gt=0, description="The most new tokens per response.")
    top_k: int | None = Field(default=None, gt=0, description="Sample among the top_k most likely tokens.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    stop: list[str] | None = Field(
        default=None, description="Strings that end a response (not part of the returned text)."
    )
    seed: int | None = Field(default=None, description="Seed for reproducible sampling.")
    constrain_tool_calls: bool = Field(
        default=True,
        description="With tools offered and no forced choice, generate the calls the model chooses to make "
        "under the tools' grammar too (valid names and arguments; free text stays unconstrained). Needs "
        "<tool_call> as a single token of the tokenizer; otherwise calls are only parsed.",
    )
    context_window: int | None = Field(
        default=None,
        gt=0,
        description="Prompt plus output tokens; None reads max_position_embeddings from the model config.",
    )
    truncate_prompt: bool = Field(
        default=False,
        description="When the prompt and max_new_tokens do not fit in the context window, keep only the "
        "prompt's end (left truncation) instead of raising InvalidPromptError.",
    )
    # -- endpoint mode: an OpenAI-compatible server instead of a local engine
    base_url: str | None = Field(
        default=None,
        description="Endpoint mode: the API root of an OpenAI-compatible server (selfspec serve, vLLM, "
        "SGLang), e.g. 'http://localhost:8000/v1'. No local engine is loaded; model is the id the server "
        "serves and the engine fields are ignored.",
    )
    api_key: str | None = Field(
        default=None,
        exclude=True,
        repr=False,
        description="Endpoint mode: the server's key; None reads $SELFSPEC_API_KEY, else $OPENAI_API_KEY.",
    )
    timeout: float | None = Field(
        default=None, description="Endpoint mode: seconds before a request fails (None: the openai client's 600 s)."
    )
    max_retries: int = Field(default=2, ge=0, description="Endpoint mode: retries of failed connections.")

    _endpoint: EndpointClient | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        """The name LlamaIndex serialises this class under."""
        return "SpeculativeLLM"

    def __repr__(self) -> str:
        return (
            f"SpeculativeLLM(model={self.model!r}, quantization={self.quantization!r}, "
            f"exit_layer={self.exit_layer!r}, num_draft_tokens={self.num_draft_tokens!r}, "
            f"drafter={self.drafter!r}, device={self.device!r}, temperature={self.temperature}, "
            f"max_new_tokens={self.max_new_tokens}"
            + (f", base_url={self.base_url!r})" if self.base_url is not None else ")")
        )

    # ----------------------------------------------------------------- engine and metadata
    @property
    def engine(self) -> SpeculativeEngine:
        """The shared :class:`selfspec.SpeculativeEngine` for this model (loaded on first use).

        Raises:
            ConfigurationError: in endpoint mode (``base_url`` set), which has no local engine.
        """
        if self.base_url is not None:
            raise ConfigurationError(
                f"SpeculativeLLM(base_url={self.base_url!r}) talks to a server and has no local engine; "
                "leave base_url unset to run the model in this process"
            )
        return get_engine(self.model, **self._engine_args())

    def endpoint(self) -> EndpointClient:
        """Endpoint mode's client of the server at ``base_url`` (created on first use)."""
        if self.base_url is None:
            raise ConfigurationError("endpoint() needs base_url (the API root of an OpenAI-compatible server)")
        if self._endpoint is None:
            self._endpoint = EndpointClient(
                self.base_url, self.api_key, timeout=self.timeout, max_retries=self.max_retries
            )
        return self._endpoint

    def _engine_args(self) -> dict[str, Any]:
        """The arguments of ``SpeculativeEngine.from_pretrained`` (they key the shared engine)."""
        return engine_args(self)

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, output budget and capabilities (reads the config, not the weights).

        In endpoint mode a model whose config is not on this machine counts as
        LlamaIndex's default window unless ``context_window`` is given.
        """
        window = self.context_window
        if window is None and self.base_url is not None:
            try:
                window = _config_context_window(self.model, self.trust_remote_code)
            except (OSError, ValueError):
                window = DEFAULT_CONTEXT_WINDOW
        window = window or _config_context_window(self.model, self.trust_remote_code)
        return LLMMetadata(
            context_window=window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model,
        )

    # ----------------------------------------------------------------- public LLM API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete a prompt (one user turn of the chat template; raw text when ``formatted``)."""
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream :meth:`complete`: each response holds the cumulative ``text`` and its ``delta``."""
        return self._stream_complete(prompt, formatted, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation rendered through the tokenizer's chat template.

        Keyword arguments override the fields ``max_new_tokens`` (or ``max_tokens``),
        ``temperature``, ``top_k``, ``top_p``, ``stop`` and ``seed`` for this call; ``tools``
        (LlamaIndex tools or OpenAI-style dicts) and ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or a tool name) offer tools, as :meth:`chat_with_tools` does.
        """
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream :meth:`chat`: cumulative ``message.content`` and ``delta``; the last one parsed."""
        return self._stream_chat(messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async :meth:`complete`, computed in a worker thread (the event loop stays free)."""
        if self.base_url is not None:
            body = self._endpoint_body(self._endpoint_prompt(prompt, formatted), dict(kwargs))
            return self._endpoint_completion(await self.endpoint().acreate(body))
        return await asyncio.to_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; each step of the engine runs in a worker thread."""
        if self.base_url is not None:
            body = self._endpoint_body(self._endpoint_prompt(prompt, formatted), dict(kwargs), stream=True)
            return _completions_from_events(self, _aiter_held(self.endpoint().astream(body)))
        responses = await asyncio.to_thread(self._stream_complete, prompt, formatted, kwargs)
        return _iterate_in_thread(responses)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat`, computed in a worker thread (the event loop stays free)."""
        if self.base_url is not None:
            body = self._endpoint_body(to_engine_messages(messages), dict(kwargs))
            return self._endpoint_chat(await self.endpoint().acreate(body))
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; each step of the engine runs in a worker thread."""
        if self.base_url is not None:
            body = self._endpoint_body(to_engine_messages(messages), dict(kwargs), stream=True)
            return _chats_from_events(self, _aiter_held(self.endpoint().astream(body)))
        responses = await asyncio.to_thread(self._stream_chat, messages, kwargs)
        return _iterate_in_thread(responses)

    # ----------------------------------------------------------------- tool calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The :meth:`chat` arguments that offer ``tools``.

        ``tool_required=True`` (or ``tool_choice="required"``) forces a call of some tool and
        ``tool_choice="<name>"`` a call of that tool: the call is then generated under a grammar
        of the tool's JSON schema, so it is always well formed.
        """
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        if tool_required and tool_choice in (None, "auto"):
            tool_choice = "required"
        return {"messages": messages, "tools": list(tools), "tool_choice": tool_choice, **kwargs}

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Keep only the first tool call unless parallel calls are allowed."""
        calls = response.message.additional_kwargs.get("tool_calls")
        if not allow_parallel_tool_calls and calls and len(calls) > 1:
            response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        """The tool calls of a response (from :meth:`chat_with_tools` or :meth:`chat`).

        Raises:
            ValueError: there is no valid tool call and ``error_on_no_tool_call`` is set (the
                message names any malformed call the model wrote).
        """
        selections = [
            ToolSelection(
                tool_id=call["id"],
                tool_name=call["function"]["name"],
                tool_kwargs=_arguments_dict(call["function"]["arguments"]),
            )
            for call in message_tool_calls(response.message)
        ]
        if not selections and error_on_no_tool_call:
            invalid = response.message.additional_kwargs.get("invalid_tool_calls") or []
            detail = f"; malformed tool calls: {invalid}" if invalid else ""
            raise ValueError(f"Expected at least one tool call, but got 0 tool calls{detail}.")
        return selections

    # ----------------------------------------------------------------- structured output
    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """Predict an object of ``output_cls`` by JSON decoding constrained to its schema.

        The default ``pydantic_program_mode`` generates the answer under a grammar of
        ``output_cls.model_json_schema()`` (applied to draft and target alike), so the text is
        always valid JSON of that schema unless ``max_new_tokens`` cuts it off. Other modes use
        LlamaIndex's programs.

        Raises:
            ValueError: the JSON was cut off at ``max_new_tokens``.
        """
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        messages, kwargs = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
        result = _validate_json(output_cls, self.chat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """Async :meth:`structured_predict`."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        messages, kwargs = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
        result = _validate_json(output_cls, await self.achat(messages, **kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    def _structured_request(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None,
        prompt_args: dict[str, Any],
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        """The messages (schema in the system message) and chat arguments of a structured call."""
        schema = output_cls.model_json_schema()
        messages = self._get_messages(prompt, **prompt_args)
        instruction = STRUCTURED_INSTRUCTION + json.dumps(schema, ensure_ascii=False)
        if messages and messages[0].role == MessageRole.SYSTEM:
            system = f"{messages[0].content or ''}\n\n{instruction}".strip()
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=system), *messages[1:]]
        else:
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=instruction), *messages]
        return messages, {**(llm_kwargs or {}), "json_schema": schema}

    # ----------------------------------------------------------------- the shared paths
    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        if self.base_url is not None:
            body = self._endpoint_body(self._endpoint_prompt(prompt, formatted), dict(kwargs))
            return self._endpoint_completion(self.endpoint().create(body))
        request = self._request(self._completion_prompt(prompt, formatted), dict(kwargs))
        return self._completion_response(request.generate())

    def _stream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseGen:
        if self.base_url is not None:
            body = self._endpoint_body(self._endpoint_prompt(prompt, formatted), dict(kwargs), stream=True)
            return _endpoint_completions(self, self.endpoint().stream(body))
        request = self._request(self._completion_prompt(prompt, formatted), dict(kwargs))
        stream = request.stream()

        def responses() -> CompletionResponseGen:
            for text, delta, output in _with_output(stream):
                if output is None:
                    yield CompletionResponse(text=text, delta=delta)
                else:
                    yield self._completion_response(output, delta=delta)

        return responses()

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        if self.base_url is not None:
            body = self._endpoint_body(to_engine_messages(messages), dict(kwargs))
            return self._endpoint_chat(self.endpoint().create(body))
        request = self._request(to_engine_messages(messages), dict(kwargs))
        return self._chat_response(request.generate(), request)

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        if self.base_url is not None:
            body = self._endpoint_body(to_engine_messages(messages), dict(kwargs), stream=True)
            return _endpoint_chats(self, self.endpoint().stream(body))
        request = self._request(to_engine_messages(messages), dict(kwargs))
        stream = request.stream()

        def responses() -> ChatResponseGen:
            for text, delta, output in _with_output(stream):
                if output is None:
                    message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                    yield ChatResponse(message=message, delta=delta)
                else:
                    yield self._chat_response(output, request, delta=delta)

        return responses()

    def _completion_prompt(self, prompt: str, formatted: bool) -> str | list[dict[str, Any]]:
        """A user turn of the chat template, or the raw text (``formatted`` or no template)."""
        if formatted:
            return prompt
        if getattr(self.engine.tokenizer, "chat_template", None) is None:
            to_prompt = self.completion_to_prompt or (lambda text: text)
            return to_prompt(prompt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _request(self, prompt: str | list[dict[str, Any]], kwargs: dict[str, Any]) -> _Request:
        """Encode the prompt (with any tools) and resolve the per-call options; consumes ``kwargs``."""
        engine = self.engine
        tools, tool_choice, json_schema = _tool_options(kwargs)
        prompt_ids = engine.encode_prompt(prompt, tools=tools or None)
        options = self._sampling_options(kwargs)
        window = engine.context_window
        if window is not None and len(prompt_ids) < window and not self.truncate_prompt:
            # LlamaIndex budgets num_output tokens for the answer; never overrun the window
            options["max_new_tokens"] = min(options["max_new_tokens"], window - len(prompt_ids))
        options["truncate_prompt"] = self.truncate_prompt
        options["constraint"] = kwargs.pop("constraint", None)
        if options["constraint"] is None:
            options["constraint"] = self._grammar(engine, tools, tool_choice, json_schema)
        if kwargs:
            logger.debug("SpeculativeLLM ignores the arguments %s", ", ".join(sorted(kwargs)))
        return _Request(engine=engine, prompt_ids=prompt_ids, options=options, parse_tools=bool(tools))

    def _sampling_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's sampling options (its keyword arguments over the fields); consumes them."""
        max_tokens = kwargs.pop("max_tokens", None)  # the name other LlamaIndex LLMs use
        max_new_tokens = kwargs.pop("max_new_tokens", None)
        if max_new_tokens is None:
            max_new_tokens = max_tokens if max_tokens is not None else self.max_new_tokens
        return {
            "max_new_tokens": max_new_tokens,
            "temperature": kwargs.pop("temperature", self.temperature),
            "top_k": kwargs.pop("top_k", self.top_k),
            "top_p": kwargs.pop("top_p", self.top_p),
            "stop": kwargs.pop("stop", self.stop),
            "seed": kwargs.pop("seed", self.seed),
        }

    # ----------------------------------------------------------------- endpoint mode
    def _endpoint_prompt(self, prompt: str, formatted: bool) -> str | list[dict[str, Any]]:
        """A user turn of the server's chat template, or the raw text when ``formatted``."""
        if formatted:
            return prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _endpoint_body(
        self, prompt: str | list[dict[str, Any]], kwargs: dict[str, Any], stream: bool = False
    ) -> dict[str, Any]:
        """Endpoint mode's request: the options of :meth:`_request` in OpenAI's form."""
        tools, tool_choice, json_schema = _tool_options(kwargs)
        options = self._sampling_options(kwargs)
        kwargs.pop("constraint", None)
        if kwargs:
            logger.debug("SpeculativeLLM ignores the arguments %s", ", ".join(sorted(kwargs)))
        sampling = {
            "model": self.model,
            "max_tokens": options["max_new_tokens"],
            "temperature": options["temperature"],
            "top_p": options["top_p"],
            "top_k": options["top_k"],
            "seed": options["seed"],
            "stop": options["stop"],
            "truncate_prompt": self.truncate_prompt,
            "stream": stream,
        }
        if isinstance(prompt, str):
            return text_body(prompt, **sampling)
        forced = _forced_tool(tools, tool_choice)
        choice: str | dict[str, Any] | None = None
        if forced == "":
            choice = "required"
        elif forced is not None:
            choice = {"type": "function", "function": {"name": forced}}
        elif tools:
            choice = "auto"
        response_format = None
        if json_schema is not None:
            response_format = {"type": "json_schema", "json_schema": {"name": "response", "schema": json_schema}}
        return chat_body(
            prompt,
            tools=tools or None,
            tool_choice=choice,
            response_format=response_format,
            constrain_tool_calls=self.constrain_tool_calls,
            **sampling,
        )

    def _endpoint_raw(self, result: EndpointResult) -> tuple[dict[str, Any], dict[str, Any]]:
        usage = {}
        if result.prompt_tokens is not None and result.completion_tokens is not None:
            usage = {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            }
        return _raw_and_extra(result.model or self.model, result.finish_reason, usage, result.stats)

    def _endpoint_completion(self, result: EndpointResult, delta: str | None = None) -> CompletionResponse:
        raw, extra = self._endpoint_raw(result)
        return CompletionResponse(text=result.text, delta=delta, raw=raw, additional_kwargs=extra)

    def _endpoint_chat(self, result: EndpointResult, delta: str | None = None) -> ChatResponse:
        raw, extra = self._endpoint_raw(result)
        message = _message_with_calls(result.text, result.tool_calls, result.invalid_tool_calls)
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)

    def _grammar(
        self,
        engine: SpeculativeEngine,
        tools: list[dict[str, Any]],
        tool_choice: str | dict[str, Any] | None,
        json_schema: dict[str, Any] | None,
    ) -> TokenConstraint | None:
        """The grammar constraint of a call: a JSON schema, a forced or an optional tool call."""
        from selfspec.grammar import has_tool_call_tokens, json_schema_constraint, tool_call_constraint

        common: dict[str, Any] = {"vocab_size": engine.adapter.vocab_size, "eos_token_ids": engine.eos_token_ids}
        if json_schema is not None:
            return json_schema_constraint(engine.tokenizer, json_schema, **common)
        forced = _forced_tool(tools, tool_choice)
        if forced is not None:
            return tool_call_constraint(engine.tokenizer, tools, tool_name=forced or None, **common)
        if tools and self.constrain_tool_calls and has_tool_call_tokens(engine.tokenizer):
            return tool_call_constraint(engine.tokenizer, tools, required=False, **common)
        return None

    def _usage_and_stats(self, output: GenerationOutput) -> tuple[dict[str, Any], dict[str, Any]]:
        """``raw`` and ``additional_kwargs`` of a finished response: token counts and stats."""
        completion_tokens = len(output.token_ids)
        usage = {
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": output.prompt_tokens + completion_tokens,
        }
        return _raw_and_extra(self.model, output.finish_reason, usage, output.stats.to_dict())

    def _completion_response(self, output: GenerationOutput, delta: str | None = None) -> CompletionResponse:
        raw, extra = self._usage_and_stats(output)
        return CompletionResponse(text=output.text or "", delta=delta, raw=raw, additional_kwargs=extra)

    def _chat_response(self, output: GenerationOutput, request: _Request, delta: str | None = None) -> ChatResponse:
        raw, extra = self._usage_and_stats(output)
        message = _assistant_message(output.text or "", parse_tools=request.parse_tools)
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)


def _raw_and_extra(
    model: str, finish_reason: str | None, usage: dict[str, int], stats: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``raw`` (``model``, ``finish_reason``, ``usage``, stats) and ``additional_kwargs`` (flat)."""
    raw = {"model": model, "finish_reason": finish_reason, "usage": usage, **stats}
    return raw, {**usage, "finish_reason": finish_reason, **stats}


def _tool_options(kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Any] | None]:
    """``(tools, tool_choice, json_schema)`` of a call; consumes them from ``kwargs``."""
    tools = [tool_schema(tool) for tool in kwargs.pop("tools", None) or []]
    tool_choice = kwargs.pop("tool_choice", None)
    if tool_choice == "none":
        tools = []
    return tools, tool_choice, kwargs.pop("json_schema", None)


# --------------------------------------------------------------------- endpoint streams
def _held(events: Iterator[StreamEvent | EndpointResult]) -> Iterator[tuple[str, str, EndpointResult | None]]:
    """``(cumulative text, delta, result)`` per text delta, ``result`` on the last one only.

    Tool-call chunks are gathered by the server's stream reader and arrive parsed in the
    result. Closing this closes the HTTP stream (the server cancels the generation).
    """
    text, pending = "", None
    try:
        for event in events:
            if isinstance(event, EndpointResult):
                yield text + (pending or ""), pending or "", event
                return
            if isinstance(event, ContentDelta) and event.text:
                if pending is not None:
                    text += pending
                    yield text, pending, None
                pending = event.text
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


async def _aiter_held(
    events: AsyncGenerator[StreamEvent | EndpointResult, None],
) -> AsyncGenerator[tuple[str, str, EndpointResult | None], None]:
    """Async :func:`_held`."""
    text, pending = "", None
    try:
        async for event in events:
            if isinstance(event, EndpointResult):
                yield text + (pending or ""), pending or "", event
                return
            if isinstance(event, ContentDelta) and event.text:
                if pending is not None:
                    text += pending
                    yield text, pending, None
                pending = event.text
    finally:
        await events.aclose()


def _endpoint_chats(llm: SpeculativeLLM, events: Iterator[StreamEvent | EndpointResult]) -> ChatResponseGen:
    for text, delta, result in _held(events):
        if result is None:
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
        else:
            yield llm._endpoint_chat(result, delta=delta)


def _endpoint_completions(llm: SpeculativeLLM, events: Iterator[StreamEvent | EndpointResult]) -> CompletionResponseGen:
    for text, delta, result in _held(events):
        yield CompletionResponse(text=text, delta=delta) if result is None else llm._endpoint_completion(result, delta)


async def _chats_from_events(
    llm: SpeculativeLLM, held: AsyncGenerator[tuple[str, str, EndpointResult | None], None]
) -> ChatResponseAsyncGen:
    try:
        async for text, delta, result in held:
            if result is None:
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)
            else:
                yield llm._endpoint_chat(result, delta=delta)
    finally:
        await held.aclose()


async def _completions_from_events(
    llm: SpeculativeLLM, held: AsyncGenerator[tuple[str, str, EndpointResult | None], None]
) -> CompletionResponseAsyncGen:
    try:
        async for text, delta, result in held:
            if result is None:
                yield CompletionResponse(text=text, delta=delta)
            else:
                yield llm._endpoint_completion(result, delta)
    finally:
        await held.aclose()


# --------------------------------------------------------------------- requests and streams
@dataclass
class _Request:
    """An encoded prompt with its engine options, ready to run once (blocking) or stream."""

    engine: SpeculativeEngine
    prompt_ids: list[int]
    options: dict[str, Any]
    parse_tools: bool

    def generate(self) -> GenerationOutput:
        return self.engine.generate_ids(self.prompt_ids, **self.options)

    def stream(self) -> GenerationStream:
        return self.engine.stream_ids(self.prompt_ids, **self.options)


def _with_output(stream: GenerationStream) -> Iterator[tuple[str, str, GenerationOutput | None]]:
    """``(cumulative text, delta, output)`` per delta; ``output`` is set on the last one only.

    One delta is held back so that the last response can carry the token counts and the
    statistics, which exist once the engine's stream is exhausted.
    """
    text, pending = "", None
    try:
        for delta in stream:
            if pending is not None:
                text += pending
                yield text, pending, None
            pending = delta
    finally:
        stream.close()
    pending = pending or ""
    assert stream.output is not None
    yield text + pending, pending, stream.output


_DONE = object()
_T = TypeVar("_T")


async def _iterate_in_thread(responses: Iterator[_T]) -> AsyncGenerator[_T, None]:
    """Iterate a blocking iterator from async code, each step in a worker thread.

    Steps and the final ``close`` hold one lock, so closing a stream whose consumer was
    cancelled mid-step waits for that step (one engine round) instead of failing.
    """
    lock = threading.Lock()

    def step() -> Any:
        with lock:
            return next(responses, _DONE)

    def close() -> None:
        with lock:
            getattr(responses, "close", lambda: None)()

    try:
        while True:
            item = await asyncio.to_thread(step)
            if item is _DONE:
                return
            yield item
    finally:
        await asyncio.to_thread(close)


# --------------------------------------------------------------------- messages and tools
def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as the ``{"role", "content", ...}`` dicts chat templates read.

    Assistant tool calls (``additional_kwargs["tool_calls"]`` or ``ToolCallBlock``) become
    ``tool_calls`` entries and tool results keep their ``tool_call_id``, so the template renders
    both in the model's own format.
    """
    converted = []
    for message in messages:
        role = _ROLE_ALIASES.get(message.role.value, message.role.value)
        entry: dict[str, Any] = {"role": role, "content": message.content or ""}
        calls = message_tool_calls(message)
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if message.additional_kwargs.get(key) is not None:
                    entry[key] = str(message.additional_kwargs[key])
        converted.append(entry)
    return converted


def message_tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's tool calls in OpenAI form, ``{"id", "type", "function": {"name", "arguments"}}``.

    Reads ``additional_kwargs["tool_calls"]`` (dicts, OpenAI objects, or flat
    ``{"name", "arguments"}``) and ``ToolCallBlock`` blocks; ``arguments`` is a dict when it is
    valid JSON.
    """
    calls: list[dict[str, Any]] = []
    for call in message.additional_kwargs.get("tool_calls") or []:
        if hasattr(call, "model_dump"):
            call = call.model_dump()
        if not isinstance(call, dict):
            continue
        function = call.get("function") or call
        if not function.get("name"):
            continue
        calls.append(_openai_call(function["name"], function.get("arguments"), call.get("id")))
    known_ids = {call["id"] for call in calls}
    for block in message.blocks:
        if isinstance(block, ToolCallBlock) and (block.tool_call_id or None) not in known_ids:
            calls.append(_openai_call(block.tool_name, block.tool_kwargs, block.tool_call_id))
    return calls


def _openai_call(name: str, arguments: Any, call_id: str | None) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the model wrote it
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": {} if arguments is None else arguments},
    }


def _arguments_dict(arguments: Any) -> dict[str, Any]:
    return arguments if isinstance(arguments, dict) else {}


def _assistant_message(text: str, *, parse_tools: bool) -> ChatMessage:
    """The assistant's message; with tools offered, tool calls are parsed out of the text."""
    if not parse_tools:
        return ChatMessage(role=MessageRole.ASSISTANT, content=text)
    from selfspec.tools import parse_tool_calls

    parsed = parse_tool_calls(text)
    return _message_with_calls(parsed.content, parsed.tool_calls, parsed.invalid_tool_calls)


def _message_with_calls(content: str, calls: Sequence[ToolCall], invalid: Sequence[InvalidToolCall]) -> ChatMessage:
    """The assistant's message with its tool calls in ``additional_kwargs`` (well formed or not)."""
    extra: dict[str, Any] = {}
    if calls:
        extra["tool_calls"] = [_openai_call(c.name, c.arguments, c.id) for c in calls]
    if invalid:
        extra["invalid_tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments, "error": c.error} for c in invalid
        ]
    return ChatMessage(role=MessageRole.ASSISTANT, content=content, additional_kwargs=extra)


def tool_schema(tool: Any) -> dict[str, Any]:
    """An OpenAI-style ``{"type": "function", "function": {...}}`` schema of a tool.

    Accepts LlamaIndex tools, plain functions (wrapped as ``FunctionTool``), Pydantic models
    and the dict forms :func:`selfspec.tools.tool_schema` reads.
    """
    from selfspec.tools import tool_schema as normalize

    metadata = getattr(tool, "metadata", None)
    if metadata is not None and hasattr(metadata, "to_openai_tool"):
        return normalize(metadata.to_openai_tool(skip_length_check=True))
    if isinstance(tool, type) and issubclass(tool, BaseModel):
        return normalize(tool.model_json_schema())
    if callable(tool) and not isinstance(tool, dict):
        from llama_index.core.tools import FunctionTool

        return normalize(FunctionTool.from_defaults(fn=tool).metadata.to_openai_tool(skip_length_check=True))
    return normalize(tool)


def _forced_tool(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> str | None:
    """``None``: no forced call; ``""``: some tool must be called; else the tool to call."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or tool_choice).get("name")
    if tool_choice in _ANY_TOOL:
        return ""
    names = [schema["function"]["name"] for schema in tools]
    if tool_choice not in names:
        raise ValueError(
            f"tool_choice {tool_choice!r} is not one of the offered tools ({', '.join(names)}); "
            "use 'auto', 'none', 'required' or a tool name"
        )
    return str(tool_choice)


def _validate_json(output_cls: type[Model], response: ChatResponse) -> Model:
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValidationError as exc:
        if response.additional_kwargs.get("finish_reason") == "length":
            raise ValueError(
                f"the {output_cls.__name__} JSON was cut off at max_new_tokens "
                f"({response.additional_kwargs.get('completion_tokens')} tokens); raise max_new_tokens"
            ) from exc
        raise


@functools.lru_cache(maxsize=64)
def _config_context_window(model: str, trust_remote_code: bool) -> int:
    """``max_position_embeddings`` from the model's config (the weights are not loaded)."""
    from selfspec.loading import load_config, resolve_model_path

    config = load_config(resolve_model_path(model), trust_remote_code=trust_remote_code)
    return int(getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT_WINDOW)
