"""``ChatSpeculative``: a LangChain chat model on selfspec's lossless self-speculative engine.

Where each part lives:

- the engine, loaded once per distinct set of engine arguments: :func:`selfspec.get_engine`;
- reading the model's tool calls, streaming them, normalising tool schemas:
  :mod:`selfspec.serving.tools` (shared with the LlamaIndex adapter);
- forced tool calls and structured output by constrained decoding: :mod:`selfspec.serving.grammar`;
- endpoint mode (``base_url=...``: an OpenAI-compatible server instead of a local engine):
  :mod:`selfspec.serving.endpoint` (shared with the LlamaIndex adapter);
- here: LangChain messages to chat-template messages (:func:`to_engine_messages`), one
  request per call (:meth:`ChatSpeculative._request`, :meth:`ChatSpeculative._endpoint_body`),
  and the one place that builds messages and chunks (:func:`_ai_message`, :func:`_chunk`,
  :func:`_last_chunk`) for every sync, async and streaming path, local or endpoint.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    BaseMessageChunk,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticToolsParser
from langchain_core.output_parsers.pydantic import PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableGenerator, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator
from selfspec.decoding.options import adapter_fields
from selfspec.errors import ConfigurationError
from selfspec.serving.endpoint import API_KEY_ENV_VARS, EndpointClient, EndpointResult, chat_body
from selfspec.serving.requests import (
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
    normalize_tool_choice,
    plan_request,
)
from selfspec.serving.tools import (
    ContentDelta,
    InvalidToolCall,
    StreamEvent,
    ToolCall,
    ToolCallStreamParser,
    tool_schema,
)

if TYPE_CHECKING:  # the engine imports torch: imported on first use (model load), not with this module
    from selfspec import GenerationOutput, SpeculativeEngine

#: Content-block types that carry no text for the model and are skipped (tool calls are
#: rendered from ``AIMessage.tool_calls``; reasoning is not replayed).
_SKIPPED_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "function_call", "thinking", "reasoning"})
#: Per-call keyword arguments this model understands (besides ``stop``); ``stream`` and the
#: tracing-only structured-output format are accepted and ignored.
_CALL_ARGS = frozenset(
    {
        "model",
        "temperature",
        "max_tokens",
        "top_p",
        "top_k",
        "seed",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "stream",
        "ls_structured_output_format",
        "structured_output_format",
    }
)


#: A field per drafter option (``eagle_head``, ``medusa_heads``, ``draft_model``, ``exit_adapter``,
#: ``learn_online``, and any drafter registered before this module was imported), from their declarations.
_DrafterOptionFields = adapter_fields("ChatSpeculativeDrafterOptions")


class ChatSpeculative(BaseChatModel, _DrafterOptionFields):  # type: ignore[misc, valid-type]
    """Chat with a Hugging Face causal LM through lossless self-speculative decoding.

    The model drafts tokens with its own first layers and verifies them with all of them in
    one forward pass: the text is exactly what the model alone would write (greedy output is
    token-identical; sampling follows the same distribution), sooner.

    Setup:
        From a clone of the selfspec repository (neither package is on PyPI), at its root:
        the CPU build of torch first where there is no GPU, then the core, then this package.
        The examples use ``"selfspec-demo"``, the small chat and tool-calling model bundled
        with ``selfspec``; everything runs offline on a CPU.

        .. code-block:: bash

            pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
            pip install -e ".[grammar]"
            pip install -e integrations/langchain-selfspec

    Key init args — completion params:
        temperature: float
            0 for greedy decoding (the default); > 0 samples.
        max_tokens: int | None
            Most new tokens per answer; ``None`` allows up to the context window.
        top_p, top_k: float | None, int | None
            Nucleus and top-k sampling.
        stop: list[str] | None
            Strings that end the answer (not included in it).
        seed: int | None
            Seed for reproducible sampling.

    Key init args — engine params:
        model: str
            A hub id, a local folder, or ``"selfspec-demo"``.
        quantization: str | None
            ``None``, ``"4bit"`` or ``"8bit"`` (bitsandbytes).
        exit_layer, num_draft_tokens: int | "auto"
            Where drafts exit and how many are drafted per step (``"auto"``: the model's
            saved calibration, else a default).
        drafter: str
            ``"auto"`` (the default: the plan calibration measured fastest), a name from
            ``selfspec.list_drafters()`` (``"early_exit"``, ``"prompt_lookup"``, ...), or
            ``"none"`` (plain decoding).
        threads: int | "auto" | None
            torch CPU threads: ``"auto"`` (the default: the fastest count, timed at load and
            re-checked when the machine's load changes), an int, or ``None`` (torch's setting).
        draft_model, medusa_heads, draft_confidence, exit_adapter, tree_nodes, batching, compile, row_exact, calibrate,
        calibration_budget, learn_online,
        dtype, device, trust_remote_code, allow_pickle:
            As in ``SpeculativeEngine.from_pretrained``.

        Weights load on first use; every instance with the same engine arguments shares one
        engine in the process.

    Key init args — endpoint mode:
        base_url: str | None
            An OpenAI-compatible server's API root (``selfspec serve``, vLLM, SGLang), e.g.
            ``"http://localhost:8000/v1"``: no local engine is loaded, ``model`` is the id
            the server serves, and the engine params above are the server's business.
        api_key: SecretStr | None
            The server's key (default: ``$SELFSPEC_API_KEY``, else ``$OPENAI_API_KEY``).
        timeout, max_retries: float | None, int
            Per-request timeout in seconds and retries of failed connections.

    Instantiate:
        .. code-block:: python

            from langchain_selfspec import ChatSpeculative

            llm = ChatSpeculative(model="selfspec-demo", max_tokens=48)

    Invoke:
        .. code-block:: python

            messages = [
                ("system", "You are a helpful assistant."),
                ("human", "What is the capital of France?"),
            ]
            ai_msg = llm.invoke(messages)
            ai_msg.content  # the model's answer (the small demo model's facts are unreliable)

    Stream:
        .. code-block:: python

            for chunk in llm.stream(messages):
                print(chunk.text, end="", flush=True)

            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            full.content  # the same text as invoke gives

    Async:
        .. code-block:: python

            import asyncio

            async def main():
                ai_msg = await llm.ainvoke(messages)
                async for chunk in llm.astream(messages):
                    print(chunk.text, end="", flush=True)
                return await llm.abatch([messages, messages])

            asyncio.run(main())

        The engine runs in a worker thread: the event loop is never blocked.

    Tool calling:
        .. code-block:: python

            from langchain_core.tools import tool

            @tool
            def get_weather(location: str) -> str:
                '''Get the weather at a location.'''
                return "It's sunny."

            llm_with_tools = llm.bind_tools([get_weather])
            ai_msg = llm_with_tools.invoke("What is the weather in San Francisco, CA?")
            ai_msg.tool_calls  # [{'name': 'get_weather', 'args': {'location': ...}, 'id': 'call_...', ...}]

            # tool_choice="any" (or "required", or a tool's name) forces a well-formed call
            forced = llm.bind_tools([get_weather], tool_choice="get_weather")
            forced.invoke("Hello!").tool_calls[0]["name"]  # 'get_weather'

        Calls are read from the model's own format (``<tool_call>{...}</tool_call>``, or
        Llama 3.1's JSON); malformed ones are in ``invalid_tool_calls``. Calls are generated
        under a grammar of the tools' JSON schemas (constrained decoding, applied to draft
        and target alike, so speculation stays lossless): a forced call always, and with
        ``tool_choice="auto"`` any call the model chooses to make (``constrain_tool_calls``).

    Structured output:
        .. code-block:: python

            from pydantic import BaseModel, Field

            class Joke(BaseModel):
                '''Joke to tell user.'''

                setup: str = Field(description="question to set up a joke")
                punchline: str = Field(description="answer to resolve the joke")

            structured_llm = llm.with_structured_output(Joke)
            structured_llm.invoke("Tell me a joke about cats.")  # Joke(setup=..., punchline=...)

            # also method="json_schema" (the answer itself is the JSON) and "json_mode"
            llm.with_structured_output(Joke, method="json_schema").invoke("Tell me a joke about cats.")

    Usage metadata:
        .. code-block:: python

            ai_msg = llm.invoke(messages)
            ai_msg.usage_metadata  # {'input_tokens': ..., 'output_tokens': ..., 'total_tokens': ...}

        Streams carry it in exactly one chunk (the last).

    Response metadata:
        .. code-block:: python

            ai_msg = llm.invoke(messages)
            ai_msg.response_metadata["finish_reason"]  # 'stop' or 'length'
            ai_msg.response_metadata["mean_accepted_length"]  # tokens per verify step

        Keys: ``model_name``, ``finish_reason`` and the speculation statistics under the
        names of ``selfspec.GenerationStats``: ``target_forwards``, ``num_drafted``,
        ``num_accepted``, ``mean_accepted_length``, ``acceptance_rate``,
        ``accepted_length_histogram``, ``draft_seconds``, ``verify_seconds``,
        ``tokens_per_second``.
    """

    model: str = "selfspec-demo"
    """The model: a hub id, a local folder, or ``"selfspec-demo"`` (bundled with selfspec)."""

    gguf_file: str | None = None
    """The name of a ``.gguf`` file inside the folder (or hub repository) ``model``; a ``model``
    that is itself a path ending in ``.gguf`` needs none."""

    quantization: Literal["4bit", "8bit"] | None = None
    """``None`` (full precision), ``"4bit"`` (bitsandbytes NF4) or ``"8bit"``."""

    dtype: str = "auto"
    """Weights dtype: ``"auto"`` (the checkpoint's half precision where the hardware computes it natively:
    GPUs, CPUs with AMX or AVX512-BF16; float32 elsewhere) or a name such as ``"float32"``."""

    device: str = "auto"
    """``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda[:N]"``."""

    exit_layer: int | Literal["auto"] = "auto"
    """Layers the draft runs; ``"auto"`` uses the model's saved calibration, else ``L // 4``."""

    num_draft_tokens: int | Literal["auto"] = "auto"
    """Tokens drafted per step; ``"auto"`` uses the saved calibration, else 4."""

    drafter: str = "auto"
    """How drafts are made: ``"auto"`` (the default: the plan calibration measured fastest for this
    model and hardware, plain decoding when nothing pays), another name from
    ``selfspec.list_drafters()`` (``"early_exit"`` for models trained for it, such as LayerSkip
    checkpoints), or ``"none"`` (plain decoding, the baseline)."""

    draft_confidence: float | None = None
    """With ``num_draft_tokens="auto"``, stop drafting when the draft's top probability falls below
    this (``None``: the engine's default)."""

    tree_nodes: int | Literal["auto"] | None = None
    """``None`` drafts a chain; an int drafts a token tree of at most that many nodes, verified in
    one forward; ``"auto"`` uses the calibrated choice."""

    batching: bool = False
    """Decode concurrent calls on the shared engine together (``selfspec.decoding.batching``): each call
    keeps the text it gets alone; more throughput when many threads or tasks share the model."""

    compile: bool | str = "auto"
    """Run single calls in the static round (fixed shapes, one host read per round) compiled with
    ``torch.compile``: ``"auto"`` (on CUDA), ``True``, ``False`` or a backend name; same text either way."""

    row_exact: bool | Literal["auto"] = "auto"
    """Give every verify row a one-token decode's bits, so that the speculative text is the plain text bit
    for bit in half precision: on CUDA through the row-invariant Triton kernels, on a CPU a row-by-row
    verify; ``"auto"`` (where half precision needs it), ``True``, or ``False`` (library kernels, faster;
    the text may differ)."""

    trust_remote_code: bool = False
    """Allow checkpoints that ship their own Python code."""

    allow_pickle: bool = False
    """Allow ``.bin`` (pickle) weights when a checkpoint has no safetensors."""

    threads: int | Literal["auto"] | None = "auto"
    """torch CPU threads (process-wide): ``"auto"`` (the default) times the plain decode step at 1..N
    threads on a CPU at load and keeps the fastest, re-checking when the machine's load changes a lot
    (on a busy machine one thread can be several times faster than all); an int fixes the count;
    ``None`` leaves torch's setting alone."""

    calibrate: bool = True
    """With ``"auto"`` exit layer or draft length and no saved calibration, measure one on first load."""

    calibration_budget: float | None = 300.0
    """Seconds first-load calibration may take (``None``: no limit); what does not fit is skipped and said."""

    temperature: float = 0.0
    """Sampling temperature: 0 for greedy decoding, > 0 samples."""

    max_tokens: int | None = None
    """Most new tokens per answer; ``None``: ``selfspec.serving.requests.DEFAULT_MAX_TOKENS`` (256, the
    default of ``selfspec serve`` and ``SpeculativeLLM`` too), never past the context window."""

    top_p: float | None = None
    """Nucleus sampling: sample among the most likely tokens whose probabilities sum to ``top_p``."""

    top_k: int | None = None
    """Sample only among the ``top_k`` most likely tokens."""

    stop: list[str] | None = None
    """Strings that end the answer (not part of it); a call's own ``stop`` replaces these."""

    seed: int | None = None
    """Seed of the random generator: the same seed gives the same sampled text."""

    streaming: bool = False
    """Whether ``invoke`` streams internally (so that callbacks see each token)."""

    constrain_tool_calls: bool = True
    """With tools bound and ``tool_choice="auto"``, generate the calls the model chooses to make
    under the tools' grammar too (valid names and arguments; free text stays unconstrained).
    Needs ``<tool_call>`` as a single token of the tokenizer; otherwise calls are only parsed."""

    escape_special_tokens: bool = False
    """Encode special-token strings written in messages, tools and history as plain text, so that only
    the chat template's markup becomes control tokens (``<|im_start|>`` in a user's message cannot open
    a turn). Default ``False``, as transformers and vLLM. Endpoint mode asks ``selfspec serve``."""

    truncate_prompt: bool = False
    """When the prompt and the answer do not fit in the context window, keep only the prompt's end
    (left truncation) instead of raising ``InvalidPromptError``. Without ``max_tokens``, a prompt
    that fills the window leaves room for ``min(DEFAULT_MAX_TOKENS, window // 2)`` new tokens."""

    # -- endpoint mode: an OpenAI-compatible server instead of a local engine
    base_url: str | None = None
    """Endpoint mode: the API root of an OpenAI-compatible server (``selfspec serve``, vLLM,
    SGLang), e.g. ``"http://localhost:8000/v1"``. No local engine is loaded; ``model`` is the id
    the server serves and the engine fields are ignored."""

    api_key: SecretStr | None = Field(default_factory=secret_from_env(list(API_KEY_ENV_VARS), default=None))
    """Endpoint mode: the server's key (sent as ``Authorization: Bearer``); default:
    ``$SELFSPEC_API_KEY``, else ``$OPENAI_API_KEY``, else none."""

    timeout: float | None = None
    """Endpoint mode: seconds before a request fails (``None``: the ``openai`` client's 600 s)."""

    max_retries: int = 2
    """Endpoint mode: retries of failed connections and 429/5xx answers."""

    _endpoint: EndpointClient | None = PrivateAttr(default=None)

    model_config = ConfigDict(use_attribute_docstrings=True)

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
        """``model_name`` is an alias of ``model``; an unknown argument names the closest field."""
        if not isinstance(values, dict):
            return values
        return adapter_arguments("ChatSpeculative", values, cls.model_fields)

    # ------------------------------------------------------------------ LangChain hooks
    @property
    def _llm_type(self) -> str:
        return "selfspec"

    @property
    def lc_secrets(self) -> dict[str, str]:
        """Secrets are serialised as the name of their environment variable."""
        return {"api_key": API_KEY_ENV_VARS[0]}

    @property
    def _identifying_params(self) -> dict[str, Any]:
        engine = {"base_url": self.base_url} if self.base_url is not None else self._engine_args()
        return {
            "model": self.model,
            **engine,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="selfspec",
            ls_model_name=str(kwargs.get("model") or self.model),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    # ------------------------------------------------------------------ engine
    def _engine_args(self) -> dict[str, Any]:
        """The arguments of ``SpeculativeEngine.from_pretrained`` (they key the shared engine)."""
        from selfspec.serving.engines import engine_args  # the engine (torch, transformers) loads on first use

        return engine_args(self)

    def get_engine(self, model: str | None = None) -> SpeculativeEngine:
        """The shared engine of this model (loaded on first use).

        Args:
            model: another model to use with the same engine arguments (a per-call override).

        Raises:
            ConfigurationError: in endpoint mode (``base_url`` set), which has no local engine.
        """
        if self.base_url is not None:
            raise ConfigurationError(
                f"ChatSpeculative(base_url={self.base_url!r}) talks to a server and has no local engine; "
                "leave base_url unset to run the model in this process"
            )
        from selfspec import get_engine

        return get_engine(model or self.model, **self._engine_args())

    def endpoint(self) -> EndpointClient:
        """Endpoint mode's client of the server at ``base_url`` (created on first use)."""
        if self.base_url is None:
            raise ConfigurationError("endpoint() needs base_url (the API root of an OpenAI-compatible server)")
        if self._endpoint is None:
            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self._endpoint = EndpointClient(self.base_url, key, timeout=self.timeout, max_retries=self.max_retries)
        return self._endpoint

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` under the model's own tokenizer (endpoint mode: a local copy)."""
        return list(self._tokenizer()(text, add_special_tokens=False)["input_ids"])

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt length of ``messages`` (and ``tools``) under the model's chat template.

        In endpoint mode this needs the model's tokenizer locally (``model`` a local folder,
        a hub id in the cache, or ``"selfspec-demo"``); the server's counts are in
        ``usage_metadata``.
        """
        schemas = [_tool_dict(t) for t in tools] if tools else None
        if self.base_url is None:
            return len(self.get_engine().encode_prompt(to_engine_messages(messages), tools=schemas))
        tokenizer = self._tokenizer()
        text = tokenizer.apply_chat_template(
            to_engine_messages(messages), tools=schemas, add_generation_prompt=True, tokenize=False
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _tokenizer(self) -> Any:
        if self.base_url is None:
            return self.get_engine().tokenizer
        return _local_tokenizer(self.model, self.trust_remote_code)

    # ------------------------------------------------------------------ generation
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.base_url is not None:
            body = self._endpoint_body(messages, stop, kwargs)
            return _endpoint_chat_result(self.endpoint().create(body), body)
        plan = self._plan(messages, stop, kwargs)
        return _chat_result(plan, kwargs.get("model") or self.model, plan.generate())

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.base_url is not None:
            body = self._endpoint_body(messages, stop, kwargs)
            return _endpoint_chat_result(await self.endpoint().acreate(body), body)
        plans: list[RequestPlan] = []

        def stream() -> Any:  # planned in the worker: templates, tokenization, grammars take time
            plans.append(self._plan(messages, stop, kwargs))
            return plans[0].stream()

        output = await agenerate(stream)  # cancelling this call stops the engine within a round
        return _chat_result(plans[0], kwargs.get("model") or self.model, output)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        if self.base_url is not None:
            chunks = self._endpoint_achunks(messages, stop, kwargs)
        else:
            chunks = aiterate(lambda: self._chunks(messages, stop, kwargs))
        try:
            async for chunk in chunks:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[ChatGenerationChunk]:
        """The chunks of one streamed answer (the sync and async streams both use this)."""
        if self.base_url is not None:
            yield from self._endpoint_chunks(messages, stop, kwargs)
            return
        plan = self._plan(messages, stop, kwargs)
        stream = plan.stream()
        parser = ToolCallStreamParser() if plan.parse_tools else None
        try:
            for delta in stream:
                for event in parser.feed(delta) if parser else [ContentDelta(delta)]:
                    yield _chunk(event)
            for event in parser.finish() if parser else []:
                yield _chunk(event)
        finally:
            stream.close()
        assert stream.output is not None
        output = stream.output
        metadata = _metadata(plan, kwargs.get("model") or self.model, output)
        yield _last_chunk(_usage(output), metadata, plan.finish_reason(output))

    def _endpoint_chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[ChatGenerationChunk]:
        """Endpoint mode's chunks; closing early closes the HTTP stream (the server cancels)."""
        body = self._endpoint_body(messages, stop, kwargs, stream=True)
        events = self.endpoint().stream(body)
        try:
            for event in events:
                yield _endpoint_last_chunk(event, body) if isinstance(event, EndpointResult) else _chunk(event)
        finally:
            events.close()

    async def _endpoint_achunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Async :meth:`_endpoint_chunks` (the ``openai`` async client: no worker thread)."""
        body = self._endpoint_body(messages, stop, kwargs, stream=True)
        events = self.endpoint().astream(body)
        try:
            async for event in events:
                yield _endpoint_last_chunk(event, body) if isinstance(event, EndpointResult) else _chunk(event)
        finally:
            await events.aclose()

    def _request_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> RequestOptions:
        """A call's options in the planner's declaration: its keyword arguments over the fields.

        Local mode plans them (:meth:`_plan`), endpoint mode sends them (:meth:`_endpoint_body`).

        Raises:
            ValueError: an argument a call does not take.
        """
        _check_call_args(kwargs)
        call = {name: value for name, value in kwargs.items() if name in RequestOptions.names()}
        call["stop"] = list(stop if stop is not None else self.stop or []) or None
        call["parallel_tool_calls"] = kwargs.get("parallel_tool_calls") is not False
        return RequestOptions.of_fields(self, **call)

    def _endpoint_body(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], stream: bool = False
    ) -> dict[str, Any]:
        """Endpoint mode's request: the same options as :meth:`_plan`, in OpenAI's form."""
        options = self._request_options(stop, kwargs)
        return chat_body(to_engine_messages(messages), options, model=kwargs.get("model") or self.model, stream=stream)

    def _plan(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> RequestPlan:
        """One call planned by :func:`selfspec.serving.requests.plan_request` on this model's engine."""
        options = self._request_options(stop, kwargs)
        return plan_request(self.get_engine(kwargs.get("model") or self.model), to_engine_messages(messages), options)

    # ------------------------------------------------------------------ tools and structure
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer tools to the model (rendered by its chat template).

        Args:
            tools: LangChain tools, functions, Pydantic models, TypedDicts or tool/JSON
                schemas (anything ``convert_to_openai_tool`` reads).
            tool_choice: ``"auto"`` or ``None`` (the model decides), ``"none"`` (tools are
                not offered), ``"any"``/``"required"``/``True`` (a call to some tool is
                forced), a tool's name or ``{"type": "function", "function": {"name": ...}}``
                (that tool is forced). Forced calls are well formed by construction
                (constrained decoding over the tools' schemas).
            strict: accepted for compatibility: calls generated under the tools' grammar
                (forced ones, and with ``constrain_tool_calls`` those the model chooses) follow
                their schemas exactly, as OpenAI's strict mode promises.
            parallel_tool_calls: ``False``: at most one call per answer, enforced by the
                grammar (locally, or by ``selfspec serve``); ``None``/``True``: several allowed.
            **kwargs: other arguments bound to the model.

        Returns:
            The model with the tools bound.

        Raises:
            ValueError: an invalid tool schema, or a bad ``tool_choice`` (here, not at invoke).
        """
        formatted = [_tool_dict(t) for t in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"strict must be a bool or None, got {strict!r}")
        if parallel_tool_calls is not None:
            if not isinstance(parallel_tool_calls, bool):
                raise ValueError(f"parallel_tool_calls must be a bool or None, got {parallel_tool_calls!r}")
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """A runnable whose output follows ``schema``, by constrained decoding.

        Args:
            schema: a Pydantic class (the output is an instance), a TypedDict, or a JSON or
                OpenAI tool schema (the output is a dict).
            method: ``"function_calling"``: a forced call of a tool named after the schema;
                ``"json_schema"``: the answer is JSON valid for the schema; ``"json_mode"``:
                the same, constrained to the schema (also ask for the keys in the prompt).
            include_raw: return ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.
            strict: accepted for compatibility; output always follows the schema.
            **kwargs: not supported.

        Returns:
            A runnable producing the parsed output (or the dict with ``raw``).

        Raises:
            ValueError: an unknown ``method`` or unsupported arguments.

        An answer cut off by ``max_tokens`` raises ``OutputParserException`` naming
        ``max_tokens`` and the tokens used (with ``include_raw=True`` it is the
        ``parsing_error``).
        """
        if kwargs:
            raise ValueError(f"unsupported arguments: {', '.join(sorted(kwargs))}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: Runnable[Any, Any]
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format=trace)
            if is_pydantic:
                parser = PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
            else:
                parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            what = f"{name} tool call"
        elif method in ("json_schema", "json_mode"):
            response_format: dict[str, Any] = {"type": "json_object"}
            if method == "json_schema" or schema is not None:  # json_mode with a schema: constrained to it
                response_format = {
                    "type": method.replace("json_mode", "json_object"),
                    "schema": convert_to_json_schema(schema),
                }
            llm = self.bind(response_format=response_format, ls_structured_output_format=trace)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()  # type: ignore[arg-type]
            what = "JSON answer"
        else:
            raise ValueError(f"unknown method {method!r}: use 'function_calling', 'json_schema' or 'json_mode'")
        parser = _cut_off_check(parser, what, json_answer=method != "function_calling")
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        no_parse = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([no_parse], exception_key="parsing_error")


# ---------------------------------------------------------------------------- requests
def _check_call_args(kwargs: dict[str, Any]) -> None:
    check_arguments("ChatSpeculative call", kwargs, _CALL_ARGS)


def _is_complete(message: Any, json_answer: bool) -> bool:
    """Whether an answer's JSON (``json_answer``) or tool call is whole, read strictly.

    LangChain's JSON parsers read partial JSON (a string cut in the middle is closed for them),
    so they cannot tell a cut answer from a whole one.
    """
    if json_answer:
        try:
            json.loads(message.content if isinstance(message.content, str) else "")
        except ValueError:
            return False
        return True
    if getattr(message, "invalid_tool_calls", None):
        return False
    for chunk in getattr(message, "tool_call_chunks", None) or []:  # a joined stream
        try:
            json.loads(chunk.get("args") or "")
        except ValueError:
            return False
    return bool(getattr(message, "tool_calls", None))


def _cut_off_check(parser: Runnable[Any, Any], what: str, json_answer: bool = False) -> Runnable[Any, Any]:
    """``parser``, but an answer cut off by ``max_tokens`` raises a clear ``OutputParserException``.

    An answer that ended at ``max_tokens`` (``finish_reason="length"``), or that was stopped
    because its JSON degenerated into repetition (``finish_reason="repetition"``), and that
    ``parser`` cannot read in full is reported with the budget and the tokens used, instead of a parser
    returning ``None``, an empty stream or a puzzling parse error. Streams keep their partial
    objects; the error comes at the end. Whether an answer that ended at ``max_tokens`` is whole
    is read strictly (:func:`_is_complete`): a cut JSON string is not a whole answer.
    """

    def cut_off(whole: Any, error: Exception | None) -> OutputParserException | None:
        metadata = getattr(whole, "response_metadata", None) or {}
        reason = metadata.get("finish_reason")
        if reason not in INCOMPLETE_REASONS:
            return None
        if error is None and reason == "length" and _is_complete(whole, json_answer):
            return None  # complete although the budget ran out exactly at its end
        usage = getattr(whole, "usage_metadata", None) or {}
        content = getattr(whole, "content", None)
        return OutputParserException(
            cut_off_message(what, metadata.get("max_tokens"), usage.get("output_tokens"), reason),
            llm_output=content if isinstance(content, str) else None,
        )

    def whole(message: Any) -> Any:
        try:
            result = parser.invoke(message)
        except OutputParserException as error:
            cut = cut_off(message, error)
            if cut is None:
                raise
            raise cut from error
        cut = cut_off(message, None)
        if cut is not None:
            raise cut
        return result

    def transform(chunks: Iterator[Any]) -> Iterator[Any]:
        first = next(chunks, None)
        if first is None:
            return
        if not isinstance(first, BaseMessageChunk):  # invoke: one whole message
            yield whole(first)
            return
        seen: list[Any] = []

        def tee() -> Iterator[Any]:
            for chunk in itertools.chain([first], chunks):
                seen.append(chunk)
                yield chunk

        try:
            yield from parser.transform(tee())
        except OutputParserException as error:
            seen.extend(chunks)  # the rest of the answer
            cut = cut_off(_joined(seen), error)
            if cut is None:
                raise
            raise cut from error
        cut = cut_off(_joined(seen), None)
        if cut is not None:
            raise cut

    async def atransform(chunks: AsyncIterator[Any]) -> AsyncIterator[Any]:
        first = await anext(chunks, None)
        if first is None:
            return
        if not isinstance(first, BaseMessageChunk):  # ainvoke: one whole message
            yield whole(first)
            return
        seen: list[Any] = []

        async def tee() -> AsyncIterator[Any]:
            seen.append(first)
            yield first
            async for chunk in chunks:
                seen.append(chunk)
                yield chunk

        try:
            async for item in parser.atransform(tee()):
                yield item
        except OutputParserException as error:
            seen.extend([chunk async for chunk in chunks])
            cut = cut_off(_joined(seen), error)
            if cut is None:
                raise
            raise cut from error
        cut = cut_off(_joined(seen), None)
        if cut is not None:
            raise cut

    return RunnableGenerator(transform, atransform, name=f"{getattr(parser, 'name', None) or 'parser'}_cut_off_check")


def _joined(chunks: list[Any]) -> Any:
    whole = None
    for chunk in chunks:
        whole = chunk if whole is None else whole + chunk
    return whole


@functools.lru_cache(maxsize=8)
def _local_tokenizer(model: str, trust_remote_code: bool) -> Any:
    """The tokenizer of ``model`` read from disk (endpoint mode counts tokens with it)."""
    from selfspec.modeling.loading import load_tokenizer

    reason: Exception | None = None
    try:
        tokenizer = load_tokenizer(model, trust_remote_code=trust_remote_code)
    except OSError as error:
        tokenizer, reason = None, error
    if tokenizer is None:
        raise ConfigurationError(
            f"counting tokens in endpoint mode needs {model!r}'s tokenizer on this machine "
            f"({reason or 'none could be read'}); the server reports its counts in usage_metadata"
        ) from reason
    return tokenizer


def _tool_dict(tool: Any) -> dict[str, Any]:
    """A tool as ``{"type": "function", "function": {...}}``, validated."""
    return tool_schema(convert_to_openai_tool(tool))


# ---------------------------------------------------------------------------- messages
def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as chat-template messages (``role``, ``content``, ``tool_calls``).

    AI tool calls are rendered back in the OpenAI form chat templates read, and tool results
    become ``tool`` messages, so the model sees its own format. Only text is supported.

    Raises:
        ValueError: a message type or content block the model cannot read (images, audio...).
    """
    converted: list[dict[str, Any]] = []
    for message in messages:
        text = _text(message)
        if isinstance(message, SystemMessage):
            converted.append({"role": "system", "content": text})
        elif isinstance(message, HumanMessage):
            converted.append({"role": "user", "content": text})
        elif isinstance(message, AIMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": text}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "type": "function",
                        "id": call.get("id"),
                        "function": {"name": call["name"], "arguments": call["args"]},
                    }
                    for call in message.tool_calls
                ]
            converted.append(entry)
        elif isinstance(message, ToolMessage):
            converted.append(
                {"role": "tool", "content": text, "tool_call_id": message.tool_call_id, "name": message.name}
            )
        elif isinstance(message, ChatMessage):
            converted.append({"role": message.role, "content": text})
        else:
            raise ValueError(f"ChatSpeculative cannot read a {type(message).__name__}")
    return converted


def _text(message: BaseMessage) -> str:
    """The text of a message's content (a string or a list of content blocks)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind not in _SKIPPED_BLOCKS:
            raise ValueError(
                f"ChatSpeculative reads text only; a {type(message).__name__} has a {kind!r} content block"
            )
    return "".join(parts)


# ---------------------------------------------------------------------------- one place for results
def _chat_result(plan: RequestPlan, model: str, output: GenerationOutput) -> ChatResult:
    """The chat result of a finished (non-streamed) local answer."""
    parsed = plan.parse(output.text or "")
    message = _ai_message(
        parsed.content, parsed.tool_calls, parsed.invalid_tool_calls, _usage(output), _metadata(plan, model, output)
    )
    generation = ChatGeneration(message=message, generation_info={"finish_reason": plan.finish_reason(output)})
    return ChatResult(generations=[generation])


def _ai_message(
    content: str,
    calls: Sequence[ToolCall],
    invalid: Sequence[InvalidToolCall],
    usage: Any,
    metadata: dict[str, Any],
) -> AIMessage:
    """An AI message: text, tool calls (well formed or not), usage and response metadata."""
    return AIMessage(
        content=content,
        tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in calls],
        invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error) for c in invalid],
        usage_metadata=usage,
        response_metadata=metadata,
    )


def _endpoint_chat_result(result: EndpointResult, body: dict[str, Any]) -> ChatResult:
    """Endpoint mode's answer as a chat result."""
    usage, metadata = _endpoint_usage(result), _endpoint_metadata(result, body)
    message = _ai_message(result.text, result.tool_calls, result.invalid_tool_calls, usage, metadata)
    info = {"finish_reason": result.finish_reason}
    return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def _endpoint_last_chunk(result: EndpointResult, body: dict[str, Any]) -> ChatGenerationChunk:
    return _last_chunk(_endpoint_usage(result), _endpoint_metadata(result, body), result.finish_reason)


def _endpoint_usage(result: EndpointResult) -> Any:
    return result.usage.langchain() if result.usage is not None else None


def _endpoint_metadata(result: EndpointResult, body: dict[str, Any]) -> dict[str, Any]:
    """``model_name``, ``finish_reason``, ``max_tokens``; the speculation statistics the server sends."""
    return {
        "model_name": result.model or body["model"],
        "finish_reason": result.finish_reason,
        "max_tokens": body.get("max_tokens"),
        **result.stats,
    }


def _chunk(event: StreamEvent) -> ChatGenerationChunk:
    """A streamed chunk: content or a tool-call piece (the last chunk: :func:`_last_chunk`)."""
    if isinstance(event, ContentDelta):
        return ChatGenerationChunk(message=AIMessageChunk(content=event.text))
    piece = tool_call_chunk(name=event.name, args=event.arguments, id=event.id, index=event.index)
    return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[piece]))


def _last_chunk(usage: Any, metadata: dict[str, Any], finish_reason: str | None) -> ChatGenerationChunk:
    """The last chunk of a stream: usage and response metadata, once per stream."""
    message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish_reason})


def _usage(output: GenerationOutput) -> Any:
    return TokenUsage.of(output).langchain()


def _metadata(plan: RequestPlan, model: str, output: GenerationOutput) -> dict[str, Any]:
    from selfspec.modeling.realmodels import display_name  # local mode: the engine (torch) is loaded already

    return {
        "model_name": display_name(model),
        "finish_reason": plan.finish_reason(output),
        "max_tokens": plan.max_new_tokens,
        **output.stats.to_dict(),
    }
