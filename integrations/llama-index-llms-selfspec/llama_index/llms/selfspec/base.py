"""``SpeculativeLLM``: a LlamaIndex LLM on selfspec's lossless self-speculative decoding.

The model drafts tokens with its own first layers and verifies them with all of its layers in
one forward pass, so the text is exactly what the model alone would write (token-identical when
greedy), only sooner. Weights load on first use, and every ``SpeculativeLLM`` (and every LangChain
``ChatSpeculative``) with the same engine arguments shares one engine through
:func:`selfspec.get_engine`.

Where things live:

- chat messages -> the tokenizer's chat template: :func:`to_engine_messages`;
- tool schemas, forced tool calls, parsing the model's tool calls: :mod:`selfspec.serving.tools` and
  :mod:`selfspec.serving.grammar` (shared with the LangChain adapter);
- response objects, streamed or not: :meth:`SpeculativeLLM._chat_response` and
  :meth:`SpeculativeLLM._completion_response` (the sync, async and streaming paths all end there);
- endpoint mode (``base_url=...``: an OpenAI-compatible server instead of a local engine):
  :mod:`selfspec.serving.endpoint` (shared with the LangChain adapter) and
  :meth:`SpeculativeLLM._endpoint_body`; its answers end in the same two response builders.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence
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
from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.llms.utils import parse_partial_json
from llama_index.core.program.utils import FlexibleModel, create_flexible_model
from llama_index.core.types import PydanticProgramMode
from pydantic import AliasChoices

from selfspec.decoding.options import adapter_fields
from selfspec.errors import ConfigurationError
from selfspec.serving.endpoint import EndpointClient, EndpointResult, chat_body, text_body
from selfspec.serving.requests import (
    DEFAULT_MAX_TOKENS,
    INCOMPLETE_REASONS,
    RequestOptions,
    RequestPlan,
    TokenUsage,
    adapter_arguments,
    agenerate,
    aiterate,
    check_adapter_drafter,
    check_arguments,
    cut_off_message,
    plan_request,
)
from selfspec.serving.tools import (
    ContentDelta,
    InvalidToolCall,
    StreamEvent,
    ToolCall,
    ToolCallChunk,
    ToolCallStreamParser,
)

if TYPE_CHECKING:  # the engine imports torch: imported on first use (model load)
    from llama_index.core.prompts import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

    from selfspec import GenerationOutput, GenerationStream, SpeculativeEngine

logger = logging.getLogger(__name__)


def get_engine(model: str, **engine_args: Any) -> SpeculativeEngine:
    """:func:`selfspec.get_engine`, imported on first use (the engine imports torch and transformers)."""
    from selfspec import get_engine as shared_engine

    return shared_engine(model, **engine_args)


dispatcher = instrument.get_dispatcher(__name__)

Model = TypeVar("Model", bound=BaseModel)

#: LlamaIndex roles that chat templates know under another name.
_ROLE_ALIASES = {"developer": "system", "function": "tool", "model": "assistant", "chatbot": "assistant"}


#: A field per drafter option (``eagle_head``, ``medusa_heads``, ``draft_model``, ``exit_adapter``,
#: ``learn_online``, and any drafter registered before this module was imported), from their declarations.
_DrafterOptionFields = adapter_fields("SpeculativeLLMDrafterOptions")


class SpeculativeLLM(FunctionCallingLLM, _DrafterOptionFields):  # type: ignore[misc, valid-type]
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
        Install from a selfspec clone, at its root (see the package README: CPU torch first
        where there is no GPU, then ``pip install -e ".[grammar]"``, then ``pip install -e
        integrations/llama-index-llms-selfspec``); this runs offline on the demo model bundled
        with selfspec:

        ```python
        from llama_index.core import Document, Settings, VectorStoreIndex
        from llama_index.core.embeddings import MockEmbedding
        from llama_index.core.llms import ChatMessage
        from llama_index.llms.selfspec import SpeculativeLLM

        llm = SpeculativeLLM(model="selfspec-demo", max_tokens=64)  # loads on first use
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
    gguf_file: str | None = Field(
        default=None,
        description="The name of a .gguf file inside the folder (or hub repository) model; a model that is "
        "itself a path ending in .gguf needs none.",
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
        default="auto",
        description="How drafts are made: 'auto' (the default: the plan calibration measured fastest for "
        "this model and hardware, plain decoding when nothing pays), 'early_exit' (for models trained for "
        "it), 'prompt_lookup', 'hybrid', 'layer_skip', 'draft_model', 'medusa', 'eagle' or 'none' (plain "
        "decoding); see selfspec.list_drafters().",
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
        description="Decode concurrent calls on the shared engine together (selfspec.decoding.batching): each call "
        "keeps the text it gets alone; more throughput when many threads or tasks share the model.",
    )
    compile: bool | str = Field(
        default="auto",
        description="Run single calls in the static round (fixed shapes, one host read per round) compiled with "
        "torch.compile: 'auto' (on CUDA), True, False or a backend name; same text either way.",
    )
    row_exact: bool | Literal["auto"] = Field(
        default="auto",
        description="Give every verify row a one-token decode's bits, so that the speculative text is the plain "
        "text bit for bit in half precision: on CUDA through the row-invariant Triton kernels, on a CPU a "
        "row-by-row verify; 'auto' (where half precision needs it), True, or False (library kernels, faster; "
        "the text may differ).",
    )
    device: str = Field(default="auto", description="'auto' (CUDA when available), 'cpu' or 'cuda[:N]'.")
    dtype: str = Field(
        default="auto",
        description=(
            "'auto' (the checkpoint's half precision where the hardware computes it natively: GPUs, CPUs with "
            "AMX or AVX512-BF16; float32 elsewhere) or a name such as 'float32' or 'bfloat16'."
        ),
    )
    trust_remote_code: bool = Field(default=False, description="Allow checkpoints that ship their own Python code.")
    allow_pickle: bool = Field(default=False, description="Allow .bin (pickle) weights when no safetensors exist.")
    threads: int | Literal["auto"] | None = Field(
        default="auto",
        description="torch CPU threads (process-wide): 'auto' (the default) times the plain decode step at 1..N "
        "threads on a CPU at load and keeps the fastest, re-checking when the machine's load changes a lot; an "
        "int fixes the count; None leaves torch's setting alone.",
    )
    calibrate: bool = Field(
        default=True,
        description="With 'auto' exit layer or draft length and no saved calibration, measure one on first load.",
    )
    calibration_budget: float | None = Field(
        default=300.0,
        description="Seconds first-load calibration may take (None: no limit); what does not fit is skipped and said.",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0 for greedy decoding; > 0 samples.")
    max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS,
        gt=0,
        validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
        description="The most new tokens per response, as ChatSpeculative and OpenAI name it (max_new_tokens, "
        "the engine's name, is an alias; default: selfspec.serving.requests.DEFAULT_MAX_TOKENS, the default of "
        "selfspec serve and ChatSpeculative too); never past the context window.",
    )
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
    escape_special_tokens: bool = Field(
        default=False,
        description="Encode special-token strings written in messages, tools and history as plain text, so "
        "that only the chat template's markup becomes control tokens ('<|im_start|>' in a user's message "
        "cannot open a turn). Default False, as transformers and vLLM. Endpoint mode asks selfspec serve.",
    )
    context_window: int | None = Field(
        default=None,
        gt=0,
        description="Prompt plus output tokens; None reads max_position_embeddings from the model config.",
    )
    truncate_prompt: bool = Field(
        default=False,
        description="When the prompt and max_tokens do not fit in the context window, keep only the "
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

    def __init__(self, **kwargs: Any) -> None:
        """Check ``drafter`` before anything else (:func:`~selfspec.serving.requests.check_adapter_drafter`).

        Raises:
            ConfigurationError: an unknown drafter name, with the valid names and the closest one.
        """
        check_adapter_drafter(kwargs)
        super().__init__(**kwargs)

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, values: Any) -> Any:
        """The aliases ``model_name`` (of ``model``) and ``max_new_tokens`` (of ``max_tokens``); no unknown names."""
        if not isinstance(values, dict):
            return values
        if "max_tokens" in values and "max_new_tokens" in values:
            raise ValueError("pass either max_tokens or its alias max_new_tokens, not both")
        return adapter_arguments("SpeculativeLLM", values, cls.model_fields, {"max_new_tokens", "class_name"})

    @property
    def max_new_tokens(self) -> int:
        """The alias of :attr:`max_tokens` (the engine's name for the budget)."""
        return self.max_tokens

    @classmethod
    def class_name(cls) -> str:
        """The name LlamaIndex serialises this class under."""
        return "SpeculativeLLM"

    def __repr__(self) -> str:
        return (
            f"SpeculativeLLM(model={self.model!r}, quantization={self.quantization!r}, "
            f"exit_layer={self.exit_layer!r}, num_draft_tokens={self.num_draft_tokens!r}, "
            f"drafter={self.drafter!r}, device={self.device!r}, temperature={self.temperature}, "
            f"max_tokens={self.max_tokens}" + (f", base_url={self.base_url!r})" if self.base_url is not None else ")")
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
        from selfspec.serving.engines import engine_args  # the engine (torch, transformers) loads on first use

        return engine_args(self)

    @property
    def metadata(self) -> LLMMetadata:
        """Context window, output budget and capabilities (reads the config, not the weights).

        In endpoint mode a model whose config is not on this machine counts as
        LlamaIndex's default window unless ``context_window`` is given; a local ``.gguf`` file
        is read by loading its engine.
        """
        window = self.context_window
        if window is None and self.base_url is not None:
            try:
                window = _config_context_window(self.model, self.trust_remote_code)
            except (OSError, ValueError):
                window = DEFAULT_CONTEXT_WINDOW
        if window is None and self.base_url is None and _named_by_file(self.model, self.gguf_file):
            window = self.engine.context_window or DEFAULT_CONTEXT_WINDOW  # a GGUF file: its engine knows
        window = window or _config_context_window(self.model, self.trust_remote_code)
        return LLMMetadata(
            context_window=window,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model if self.base_url is not None else _display_name(self.model),
        )

    # ----------------------------------------------------------------- public LLM API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete a prompt (one user turn of the chat template; raw text when ``formatted``)."""
        return self._answer("completion", self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream :meth:`complete`: each response holds the cumulative ``text`` and its ``delta``."""
        return self._stream("completion", self._completion_prompt(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation rendered through the tokenizer's chat template.

        Keyword arguments override the fields ``max_tokens`` (or its alias ``max_new_tokens``),
        ``temperature``, ``top_k``, ``top_p``, ``stop`` and ``seed`` for this call; ``tools``
        (LlamaIndex tools or OpenAI-style dicts), ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or a tool name) and ``parallel_tool_calls`` offer tools, as
        :meth:`chat_with_tools` does; ``json_schema`` constrains the answer to a JSON schema.
        """
        return self._answer("chat", to_engine_messages(messages), kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Stream :meth:`chat`: cumulative ``message.content`` and ``delta``; tool calls as they arrive.

        While a tool call is generated, ``message.additional_kwargs["tool_calls"]`` holds the
        calls so far (arguments: the JSON text so far); the last response has them parsed.
        """
        return self._stream("chat", to_engine_messages(messages), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Async :meth:`complete` (a worker thread runs the engine; cancelling stops it within a round)."""
        return await self._aanswer("completion", self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """Async :meth:`stream_complete`; closing or cancelling it stops the generation within a round."""
        return self._astream("completion", self._completion_prompt(prompt, formatted), kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Async :meth:`chat` (a worker thread runs the engine; cancelling stops it within a round)."""
        return await self._aanswer("chat", to_engine_messages(messages), kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """Async :meth:`stream_chat`; closing or cancelling it stops the generation within a round."""
        return self._astream("chat", to_engine_messages(messages), kwargs)

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
        # a streamed response holds the arguments so far: read what is complete of them
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
        always valid JSON of that schema unless ``max_tokens`` cuts it off. Other modes use
        LlamaIndex's programs.

        Raises:
            ValueError: the JSON was cut off at ``max_tokens``.
        """
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        messages, kwargs = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
        result = _validate_json(output_cls, self.chat(messages, **kwargs), _budget_name(kwargs))
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
        result = _validate_json(output_cls, await self.achat(messages, **kwargs), _budget_name(kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model | FlexibleModel, None, None]:
        """Stream :meth:`structured_predict`: partial objects that fill in as the JSON arrives.

        Each item is a partial object (a ``FlexibleModel`` of ``output_cls`` whose fields are
        ``None`` until their value is complete); the last is the validated ``output_cls``.
        Other program modes use LlamaIndex's programs (which read the streamed tool calls).

        Raises:
            ValueError: the JSON was cut off at ``max_tokens``.
        """
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            yield from super().stream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
            return
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        messages, kwargs = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
        partials = _PartialObjects(output_cls)
        response = None
        for response in self.stream_chat(messages, **kwargs):
            yield from partials.feed(response.message.content or "")
        assert response is not None
        result = _validate_json(output_cls, response, _budget_name(kwargs))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        yield result

    @dispatcher.span
    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        """Async :meth:`stream_structured_predict`."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astream_structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)

        async def gen() -> AsyncGenerator[Model | FlexibleModel, None]:
            dispatcher.event(
                LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
            )
            messages, kwargs = self._structured_request(output_cls, prompt, llm_kwargs, prompt_args)
            partials = _PartialObjects(output_cls)
            response = None
            async for response in await self.astream_chat(messages, **kwargs):
                for partial in partials.feed(response.message.content or ""):
                    yield partial
            assert response is not None
            result = _validate_json(output_cls, response, _budget_name(kwargs))
            dispatcher.event(LLMStructuredPredictEndEvent(output=result))
            yield result

        return gen()

    def _structured_request(
        self,
        output_cls: type[BaseModel],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None,
        prompt_args: dict[str, Any],
    ) -> tuple[list[ChatMessage], dict[str, Any]]:
        """The messages and chat arguments of a structured call (the planner states the schema)."""
        messages = self._get_messages(prompt, **prompt_args)
        return messages, {**(llm_kwargs or {}), "json_schema": output_cls.model_json_schema()}

    # ----------------------------------------------------------------- the one request path
    # Every public method ends in one of these four; each branches once on endpoint mode, and
    # every response (chat or completion, streamed or not, local or endpoint) is built by
    # _ResponseBuilder.
    def _answer(self, kind: _Kind, prompt: _Prompt, kwargs: dict[str, Any]) -> Any:
        options = self._options(kwargs)
        if self.base_url is not None:
            return _final_response(kind, _endpoint_answer(self.endpoint().create(self._body(prompt, options)), options))
        plan = self._plan(prompt, options)
        return _final_response(kind, _local_answer(plan, self.model, plan.generate()))

    async def _aanswer(self, kind: _Kind, prompt: _Prompt, kwargs: dict[str, Any]) -> Any:
        options = self._options(kwargs)
        if self.base_url is not None:
            result = await self.endpoint().acreate(self._body(prompt, options))
            return _final_response(kind, _endpoint_answer(result, options))
        plans: list[RequestPlan] = []

        def stream() -> GenerationStream:  # planned in the worker: templates and grammars take time
            plans.append(self._plan(prompt, options))
            return plans[0].stream()

        output = await agenerate(stream)  # cancelling the caller stops the engine within a round
        return _final_response(kind, _local_answer(plans[0], self.model, output))

    def _stream(self, kind: _Kind, prompt: _Prompt, kwargs: dict[str, Any]) -> Generator[Any, None, None]:
        options = self._options(kwargs)
        if self.base_url is not None:
            events = _endpoint_events(self.endpoint().stream(self._body(prompt, options, stream=True)), options)
        else:
            events = _local_events(self._plan(prompt, options), self.model)
        return _ResponseBuilder(kind).responses(events)

    async def _astream(self, kind: _Kind, prompt: _Prompt, kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        options = self._options(kwargs)
        builder = _ResponseBuilder(kind)
        if self.base_url is not None:
            events: AsyncIterator[StreamEvent | _Answer] = _aendpoint_events(
                self.endpoint().astream(self._body(prompt, options, stream=True)), options
            )
        else:
            events = aiterate(lambda: _local_events(self._plan(prompt, options), self.model))
        try:
            async for event in events:
                for response in builder.feed(event):
                    yield response
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def _completion_prompt(self, prompt: str, formatted: bool) -> _Prompt:
        """A user turn of the chat template, or the raw text (``formatted``, or a local model without one)."""
        if formatted:
            return prompt
        if self.base_url is None and getattr(self.engine.tokenizer, "chat_template", None) is None:
            to_prompt = self.completion_to_prompt or (lambda text: text)
            return to_prompt(prompt)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def _options(self, kwargs: dict[str, Any]) -> RequestOptions:
        """A call's options in the planner's declaration: its keyword arguments over the fields.

        Local mode plans them (:meth:`_plan`), endpoint mode sends them (:meth:`_body`).

        Raises:
            ValueError: an argument a call does not take, or ``max_tokens`` and ``max_new_tokens``
                both given and different.
        """
        kwargs = dict(kwargs)
        budget = _call_budget(kwargs, self.max_tokens)
        call = {name: kwargs.pop(name) for name in _CALL_OPTIONS if name in kwargs}
        call["tools"] = [tool_schema(tool) for tool in call.get("tools") or []]
        call["parallel_tool_calls"] = call.get("parallel_tool_calls", True) is not False
        for ignored in _IGNORED_CALL_ARGS:  # LlamaIndex passes these to every LLM
            kwargs.pop(ignored, None)
        check_arguments("SpeculativeLLM call", kwargs, ())
        return RequestOptions.of_fields(self, max_tokens=budget.value, budget_name=budget.name, **call)

    def _plan(self, prompt: _Prompt, options: RequestOptions) -> RequestPlan:
        """The call planned on the local engine (:func:`selfspec.serving.requests.plan_request`)."""
        return plan_request(self.engine, prompt, options)

    def _body(self, prompt: _Prompt, options: RequestOptions, stream: bool = False) -> dict[str, Any]:
        """Endpoint mode's request: the same options, in OpenAI's form."""
        if isinstance(prompt, str):
            return text_body(prompt, options, model=self.model, stream=stream)
        return chat_body(prompt, options, model=self.model, stream=stream)


# --------------------------------------------------------------------- answers and responses
_Kind = Literal["chat", "completion"]
_Prompt = str | list[dict[str, Any]]
#: The request options a call may set (besides ``max_tokens`` and its alias ``max_new_tokens``);
#: the rest are the fields'.
_CALL_OPTIONS = (
    "temperature",
    "top_k",
    "top_p",
    "stop",
    "seed",
    "tools",
    "tool_choice",
    "json_schema",
    "parallel_tool_calls",
)
#: Call arguments LlamaIndex hands every LLM, which mean nothing here.
_IGNORED_CALL_ARGS = ("formatted", "allow_parallel_tool_calls", "verbose", "tool_required")


@dataclass
class _Answer:
    """A finished answer, local or from the endpoint: what the last response is built from."""

    text: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]
    finish_reason: str | None
    usage: dict[str, int]
    stats: dict[str, Any]
    model: str
    max_tokens: int | None


@dataclass(frozen=True)
class _CallBudget:
    """A call's token budget and the name its caller gave it (a bad budget's error names it)."""

    value: int
    name: str


def _call_budget(kwargs: dict[str, Any], default: int) -> _CallBudget:
    """``max_tokens`` or its alias ``max_new_tokens`` from a call's keyword arguments (popped), else the field.

    Raises:
        ValueError: both names given, with different values.
    """
    given = {name: kwargs.pop(name) for name in ("max_tokens", "max_new_tokens") if kwargs.get(name) is not None}
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"pass either max_tokens or its alias max_new_tokens, not both (got {given})")
    name = _budget_name(given)
    return _CallBudget(given.get(name, default), name)


def _budget_name(kwargs: dict[str, Any]) -> str:
    """``max_new_tokens`` when a call's keyword arguments use that alias, else ``max_tokens``."""
    return "max_new_tokens" if kwargs.get("max_new_tokens") is not None else "max_tokens"


def _local_answer(plan: RequestPlan, model: str, output: GenerationOutput) -> _Answer:
    parsed = plan.parse(output.text or "")
    usage = TokenUsage.of(output).openai()
    return _Answer(
        parsed.content if plan.parse_tools else output.text or "",
        parsed.tool_calls,
        parsed.invalid_tool_calls,
        plan.finish_reason(output),
        usage,
        output.stats.to_dict(),
        _display_name(model),
        plan.max_new_tokens,
    )


def _endpoint_answer(result: EndpointResult, options: RequestOptions) -> _Answer:
    usage = result.usage.openai() if result.usage is not None else {}
    return _Answer(
        result.text,
        result.tool_calls,
        result.invalid_tool_calls,
        result.finish_reason,
        usage,
        result.stats,
        result.model,
        options.max_tokens,
    )


def _local_events(plan: RequestPlan, model: str) -> Iterator[StreamEvent | _Answer]:
    """A local stream's events (text and tool-call pieces), then its :class:`_Answer`.

    Closing this closes the engine's stream (the generation stops within a round).
    """
    stream = plan.stream()
    parser = ToolCallStreamParser() if plan.parse_tools else None
    try:
        for delta in stream:
            yield from parser.feed(delta) if parser else [ContentDelta(delta)]
        yield from parser.finish() if parser else []
    finally:
        stream.close()
    assert stream.output is not None
    yield _local_answer(plan, model, stream.output)


def _endpoint_events(
    events: Iterator[StreamEvent | EndpointResult], options: RequestOptions
) -> Iterator[StreamEvent | _Answer]:
    """An endpoint stream's events, then its :class:`_Answer` (closing closes the HTTP stream)."""
    try:
        for event in events:
            yield _endpoint_answer(event, options) if isinstance(event, EndpointResult) else event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


async def _aendpoint_events(
    events: AsyncGenerator[StreamEvent | EndpointResult, None], options: RequestOptions
) -> AsyncGenerator[StreamEvent | _Answer, None]:
    """Async :func:`_endpoint_events`."""
    try:
        async for event in events:
            yield _endpoint_answer(event, options) if isinstance(event, EndpointResult) else event
    finally:
        await events.aclose()


class _ResponseBuilder:
    """Turns a stream's events into LlamaIndex responses: the one place responses are built.

    Text deltas are held back by one, so that the last response carries both the last delta and
    the token counts and statistics (which exist once the answer is finished); tool-call pieces
    are sent as they arrive, in ``additional_kwargs["tool_calls"]`` (the calls so far).
    """

    def __init__(self, kind: _Kind) -> None:
        self.kind = kind
        self.text = ""
        self.pending: str | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # index -> {"id", "name", "arguments" so far}

    def responses(self, events: Iterator[StreamEvent | _Answer]) -> Generator[Any, None, None]:
        """The responses of a sync stream (closing this closes ``events``)."""
        try:
            for event in events:
                yield from self.feed(event)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def feed(self, event: StreamEvent | _Answer) -> list[Any]:
        """The responses one event completes."""
        if isinstance(event, _Answer):
            return [_final_response(self.kind, event, delta=self.pending or "")]
        out = []
        if isinstance(event, ToolCallChunk):
            out += self._flush()
            call = self.calls.setdefault(event.index, {"id": event.id, "name": event.name, "arguments": ""})
            call["id"] = call["id"] or event.id
            call["name"] = call["name"] or event.name
            call["arguments"] += event.arguments
            out.append(self._partial(""))
        elif event.text:
            out += self._flush()
            self.pending = event.text
        return out

    def _flush(self) -> list[Any]:
        if self.pending is None:
            return []
        delta, self.pending = self.pending, None
        self.text += delta
        return [self._partial(delta)]

    def _partial(self, delta: str) -> Any:
        if self.kind == "completion":
            return CompletionResponse(text=self.text, delta=delta)
        extra: dict[str, Any] = {}
        if self.calls:
            extra["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for _, c in sorted(self.calls.items())
            ]
        message = ChatMessage(role=MessageRole.ASSISTANT, content=self.text, additional_kwargs=extra)
        return ChatResponse(message=message, delta=delta)


def _final_response(kind: _Kind, answer: _Answer, delta: str | None = None) -> Any:
    """The finished answer as a chat or completion response (text, calls, counts, statistics)."""
    raw = {
        "model": answer.model,
        "finish_reason": answer.finish_reason,
        "max_tokens": answer.max_tokens,
        "usage": answer.usage,
        **answer.stats,
    }
    extra = {**answer.usage, "finish_reason": answer.finish_reason, "max_tokens": answer.max_tokens, **answer.stats}
    if kind == "completion":
        return CompletionResponse(text=answer.text, delta=delta, raw=raw, additional_kwargs=extra)
    message = _message_with_calls(answer.text, answer.tool_calls, answer.invalid_tool_calls)
    return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)


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
    """A call's arguments as a dict; the part that is complete of a streamed JSON text."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments.strip():
        try:
            value = parse_partial_json(arguments)
        except (ValueError, json.JSONDecodeError):
            return {}
        return value if isinstance(value, dict) else {}
    return {}


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
    and the dict forms :func:`selfspec.serving.tools.tool_schema` reads.
    """
    from selfspec.serving.tools import tool_schema as normalize

    metadata = getattr(tool, "metadata", None)
    if metadata is not None and hasattr(metadata, "to_openai_tool"):
        return normalize(metadata.to_openai_tool(skip_length_check=True))
    if isinstance(tool, type) and issubclass(tool, BaseModel):
        return normalize(tool.model_json_schema())
    if callable(tool) and not isinstance(tool, dict):
        from llama_index.core.tools import FunctionTool

        return normalize(FunctionTool.from_defaults(fn=tool).metadata.to_openai_tool(skip_length_check=True))
    return normalize(tool)


def _validate_json(output_cls: type[Model], response: ChatResponse, budget_name: str = "max_tokens") -> Model:
    """The validated object, or a clear ``ValueError`` naming the budget when the JSON was cut off."""
    text = response.message.content or ""
    try:
        return output_cls.model_validate_json(text)
    except ValidationError as exc:
        extra = response.additional_kwargs
        reason = extra.get("finish_reason")
        if reason in INCOMPLETE_REASONS:
            what = f"{output_cls.__name__} JSON"
            used = extra.get("completion_tokens")
            raise ValueError(cut_off_message(what, extra.get("max_tokens"), used, reason, name=budget_name)) from exc
        raise


class _PartialObjects:
    """Partial objects of ``output_cls`` from a growing JSON text (each new state once)."""

    def __init__(self, output_cls: type[BaseModel]) -> None:
        self.flexible = create_flexible_model(output_cls)
        self.last: Any = None

    def feed(self, text: str) -> list[Any]:
        if not text.strip():
            return []
        try:
            value = parse_partial_json(text)
            partial = self.flexible.model_validate(value)
        except (ValueError, ValidationError, json.JSONDecodeError):
            return []
        if self.last is not None and partial.model_dump() == self.last.model_dump():
            return []
        self.last = partial
        return [partial]


def _named_by_file(model: str, gguf_file: str | None) -> bool:
    """A ``.gguf`` file or a real model's short name: no config to read without loading the engine."""
    from selfspec.modeling.realmodels import is_real_model  # local mode only (it imports torch)

    return str(model).endswith(".gguf") or gguf_file is not None or is_real_model(model)


def _display_name(model: str) -> str:
    """A real model's short name, never its file in the cache (local mode only: it imports torch)."""
    from selfspec.modeling.realmodels import display_name

    return display_name(model)


@functools.lru_cache(maxsize=64)
def _config_context_window(model: str, trust_remote_code: bool) -> int:
    """``max_position_embeddings`` from the model's config (the weights are not loaded)."""
    from selfspec.modeling.loading import load_config, resolve_model_path

    config = load_config(resolve_model_path(model), trust_remote_code=trust_remote_code)
    return int(getattr(config, "max_position_embeddings", None) or DEFAULT_CONTEXT_WINDOW)
