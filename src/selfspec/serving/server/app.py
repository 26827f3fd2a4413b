"""An OpenAI-compatible HTTP server around one :class:`~selfspec.decoding.engine.SpeculativeEngine`.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (server-sent events when
``stream`` is true), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus).
Every generation runs in a worker thread, so the event loop never waits on the model; the
engine serialises concurrent generations round by round, and each gets the text it would get
alone. A client that goes away cancels its generation.

The ``selfspec`` key of each response (and of the last streamed chunk) holds the engine's
:class:`~selfspec.decoding.outputs.GenerationStats` under the same field names; a non-streamed
response also carries them as ``x-selfspec-*`` headers (any OpenAI client can read those), and
every generation response carries the plan (``x-selfspec-drafter``, ``-method``, ``-plan``, ...).
The plan is logged once when the app starts and reported by ``/health`` (:func:`plan_report`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...core.bounds import PromptTooLongError
from ...decoding.engine import GenerationStream, SpeculativeEngine
from ...decoding.outputs import GenerationOutput, TokenLogprob
from ...errors import InvalidSchemaError, one_line
from ...modeling.realmodels import display_name
from ..engines import get_engine
from ..requests import (  # noqa: F401 - DEFAULT_MAX_TOKENS: the server's default budget, documented here
    DEFAULT_MAX_TOKENS,
    OversizeFieldError,
    RequestFieldError,
    RequestPlan,
    TokenUsage,
    plan_request,
)
from ..tools import ContentDelta, ToolCallChunk, ToolCallStreamParser
from .allocator import IdleTrim, idle_trim_enabled, limit_arenas
from .limits import (
    CLIENT_CLOSED,
    Admission,
    RequestGuard,
    ServerLimits,
    graceful_server,
    host_allow_list,
    internal_error,
    parse_json,
    shutting_down,
    uvicorn_config,
)
from .logprobs import TextOffsets, chat_content, completion_logprobs, token_pieces
from .metrics import CONTENT_TYPE, Metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_error_param,
    engine_messages,
    error_body,
)

logger = logging.getLogger("selfspec.serving.server")

#: Worker threads (template rendering, tokenization, generations); admission control
#: (:class:`~selfspec.serving.server.settings.ServerLimits`) decides how many requests get in.
MAX_WORKERS = 64
#: Seconds a shutdown waits for cancelled generations to stop before the process exits anyway.
WORKER_STOP_TIMEOUT = 2.0

_Body = TypeVar("_Body", bound=BaseModel)
_END = object()  # the worker's last queue item

try:  # chat templates are jinja2; a template that rejects the messages is a bad request
    from jinja2.exceptions import TemplateError as _TemplateError
except ImportError:  # pragma: no cover - jinja2 comes with transformers' chat templates
    _TemplateError = ValueError  # type: ignore[assignment,misc]


# ------------------------------------------------------------------------------- generation jobs
@dataclass
class _Delta:
    """One streamed text delta and the log-probabilities of the tokens generated since the last one."""

    text: str
    logprobs: list[TokenLogprob]


class _Job:
    """One generation, run by a worker thread that can be told to stop between deltas."""

    def __init__(self, stream: GenerationStream, plan: RequestPlan) -> None:
        self.stream = stream
        self.plan = plan
        self.parse_tools = plan.parse_tools
        self.cancelled = threading.Event()
        self.client_gone = False  # set when a non-streamed request's client disconnected
        self.constraint_field: str | None = None  # the request field whose grammar constrains it
        self.error: BaseException | None = None
        self.output: GenerationOutput | None = None
        self._queue: asyncio.Queue[object] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._logprobs_sent = 0

    def run(self, metrics: Metrics) -> GenerationOutput | None:
        """Decode to the end (or until cancelled), sending deltas to the queue when streaming."""
        started = time.perf_counter()
        metrics.generation_started()
        try:
            while not self.cancelled.is_set():  # checked before every delta, the first one included
                delta = next(self.stream, None)
                if delta is None:
                    break
                self._emit(_Delta(delta, self._new_logprobs()))
        except Exception as error:  # reported to the client; the engine stays usable
            logger.exception("generation failed")
            self.error = error
        finally:
            self.stream.close()  # cancels the generation when it stopped early
            self.output = self.stream.output
            if self.output is not None and self.error is None:
                metrics.generation_done(
                    self.output, time.perf_counter() - started, self.plan.finish_reason(self.output)
                )
            else:
                metrics.generation_failed()
            self._emit(_END)
        return self.output

    def _new_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens generated since the last call (none unless asked for)."""
        if self._queue is None or self.plan.logprobs is None:
            return []
        entries = self.stream.logprobs or []  # read on the worker thread, between two deltas
        new, self._logprobs_sent = entries[self._logprobs_sent :], len(entries)
        return list(new)

    def stream_to(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[object]:
        """Have :meth:`run` send its deltas to a queue read on ``loop``."""
        self._loop, self._queue = loop, asyncio.Queue()
        return self._queue

    def _emit(self, item: object) -> None:
        if self._loop is None or self._queue is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (server shutting down)
            self.cancelled.set()


def _finish_reason(plan: RequestPlan, output: GenerationOutput, tool_calls: bool) -> str:
    """The finish reason: OpenAI's ``length``, ``tool_calls`` or ``stop``, or the planner's ``repetition``.

    ``repetition`` (a JSON string that looped, stopped by the planner's guard) and ``cancelled``
    are never rendered as ``stop``.
    """
    reason = plan.finish_reason(output)
    if reason in ("length", "cancelled", "repetition"):
        return str(reason)
    return "tool_calls" if tool_calls else "stop"


# ------------------------------------------------------------------------------- response bodies
class _Render:
    """Builds every body of one answer, streamed or not, so that the two cannot drift.

    Args:
        kind: ``"chat"`` or ``"text"``.
        model: the model id to report.
        job: the generation.
        include_usage: end a stream with a usage chunk.
        tokenizer: the engine's tokenizer (token texts and bytes for ``logprobs``).
        legacy_functions: the request used ``functions``: a call is answered as ``function_call``
            (its first call only) with ``finish_reason="function_call"``, not as ``tool_calls``.
    """

    def __init__(
        self,
        kind: str,
        model: str,
        job: _Job,
        include_usage: bool,
        tokenizer: Any = None,
        *,
        legacy_functions: bool = False,
    ) -> None:
        self.kind = kind
        self.legacy_functions = legacy_functions
        self.model = model
        self.job = job
        self.include_usage = include_usage
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.parser = ToolCallStreamParser() if job.parse_tools else None
        self.saw_tool_call = False
        self.wants_logprobs = job.plan.logprobs is not None
        self.pieces = token_pieces(tokenizer) if self.wants_logprobs and tokenizer is not None else None
        self.offsets = TextOffsets(tokenizer) if self.wants_logprobs and kind == "text" else None
        self.pending: list[TokenLogprob] = []  # received from the job, not yet in a chunk
        self.received = 0  # log-probability entries received from the job
        self.streamed_chars = 0  # text sent so far (completions' text_offset stays inside it)

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.id,
            "object": f"{kind}.chunk" if chunk and self.kind == "chat" else kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def _logprobs(self, entries: list[TokenLogprob], text_length: int | None = None) -> dict[str, Any] | None:
        """The ``logprobs`` of a choice holding ``entries`` (``None`` unless the request asked for them)."""
        if not self.wants_logprobs or self.pieces is None:
            return None
        if self.kind == "chat":
            return {"content": chat_content(self.pieces, entries), "refusal": None}
        assert self.offsets is not None
        return completion_logprobs(self.pieces, entries, self.offsets, text_length)

    def _chunk(self, piece: dict[str, Any] | str, finish_reason: str | None = None) -> dict[str, Any]:
        """A chunk; it carries the log-probabilities of every token not yet sent in one."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = piece
        else:
            choice["text"] = piece
            self.streamed_chars += len(str(piece))
        entries, self.pending = self.pending, []
        logprobs = self._logprobs(entries, self.streamed_chars) if entries else None
        choice.update({"logprobs": logprobs, "finish_reason": finish_reason})
        return self._envelope([choice], chunk=True)

    # -- streaming
    def first(self) -> list[dict[str, Any]]:
        """The chunks sent before any text (chat: the assistant role)."""
        return [self._chunk({"role": "assistant", "content": ""})] if self.kind == "chat" else []

    def delta(self, item: _Delta) -> list[dict[str, Any]]:
        """The chunks of one text delta (tool-call markup becomes ``tool_calls`` deltas).

        The delta's log-probabilities ride in its first chunk (or in the next chunk sent, when
        the tool-call parser holds the text back).
        """
        self.pending.extend(item.logprobs)
        self.received += len(item.logprobs)
        if self.kind == "text":
            return [self._chunk(item.text)]
        events = self.parser.feed(item.text) if self.parser is not None else [ContentDelta(item.text)]
        return [chunk for event in events if (chunk := self._event_chunk(event)) is not None]

    def last(self, output: GenerationOutput) -> list[dict[str, Any]]:
        """The closing chunks: held-back text, the finish reason with stats (and the last tokens' logprobs), usage."""
        self.pending.extend((output.logprobs or [])[self.received :])  # tokens that added no text (end of sequence)
        self.received = len(output.logprobs or [])
        chunks = []
        if self.parser is not None:
            chunks = [chunk for event in self.parser.finish() if (chunk := self._event_chunk(event)) is not None]
        final = self._chunk({} if self.kind == "chat" else "", self._finish_reason(output, self.saw_tool_call))
        final["selfspec"] = output.stats.to_dict()
        chunks.append(final)
        if self.include_usage:
            usage = self._envelope([], chunk=True)
            usage["usage"] = TokenUsage.of(output).openai()
            chunks.append(usage)
        return chunks

    def _finish_reason(self, output: GenerationOutput, tool_calls: bool) -> str:
        reason = _finish_reason(self.job.plan, output, tool_calls)
        return "function_call" if reason == "tool_calls" and self.legacy_functions else reason

    def _event_chunk(self, event: ContentDelta | ToolCallChunk) -> dict[str, Any] | None:
        if isinstance(event, ContentDelta):
            return self._chunk({"content": event.text})
        self.saw_tool_call = True
        if self.legacy_functions:  # one call, in the deprecated shape; a second one is not sent
            if event.index != 0:
                return None
            legacy: dict[str, Any] = {"arguments": event.arguments}
            if event.id is not None:
                legacy = {"name": event.name or "", **legacy}
            return self._chunk({"function_call": legacy})
        call: dict[str, Any] = {"index": event.index}
        function: dict[str, Any] = {"arguments": event.arguments}
        if event.id is not None:
            call.update({"id": event.id, "type": "function"})
            function["name"] = event.name or ""
        call["function"] = function
        return self._chunk({"tool_calls": [call]})

    # -- whole answers
    def response(self, output: GenerationOutput) -> dict[str, Any]:
        """The non-streamed body."""
        text = output.text or ""
        choice: dict[str, Any] = {"index": 0}
        logprobs = self._logprobs(output.logprobs or [], len(text))
        if self.kind == "text":
            choice.update({"text": text, "logprobs": logprobs, "finish_reason": self._finish_reason(output, False)})
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls: list[dict[str, Any]] = []
            if self.job.parse_tools:
                parsed = self.job.plan.parse(text)
                calls = [
                    _tool_call(call.id, call.name, json.dumps(call.arguments, ensure_ascii=False))
                    for call in parsed.tool_calls
                ] + [_tool_call(bad.id, bad.name or "", bad.arguments) for bad in parsed.invalid_tool_calls]
                message["content"] = parsed.content or (None if calls else "")
            if calls and self.legacy_functions:  # the deprecated shape holds one call, without an id
                message["function_call"] = calls[0]["function"]
            elif calls:
                message["tool_calls"] = calls
            choice.update(
                {"message": message, "logprobs": logprobs, "finish_reason": self._finish_reason(output, bool(calls))}
            )
        body = self._envelope([choice], chunk=False)
        body["usage"] = TokenUsage.of(output).openai()
        body["selfspec"] = output.stats.to_dict()
        return body


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------- the server
class _Server:
    """The state behind one app: engine, model id, key, worker threads and metrics."""

    def __init__(
        self, engine: SpeculativeEngine, model_id: str, api_key: str | None, limits: ServerLimits | None = None
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.api_key = api_key
        self.limits = limits or ServerLimits()
        self.metrics = Metrics()
        self.created = int(time.time())
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._jobs: set[_Job] = set()  # handed to a worker thread and not finished there
        self._cancel_all = False  # the shutdown's grace is over: nothing runs any more
        # malloc_trim(0) once per idle period (docs/limits.md, Memory); SELFSPEC_IDLE_TRIM=0 turns it off
        self.idle_trim = IdleTrim(self._is_idle) if idle_trim_enabled() else None
        self.admission = Admission(
            self.limits.max_concurrent,
            self.limits.max_queue,
            self.limits.retry_after,
            on_enter=self.idle_trim.busy if self.idle_trim else None,
            on_idle=self.idle_trim.idle if self.idle_trim else None,
        )
        self.metrics.idle_trim = self.idle_trim
        self.stopped = True  # whether the last shutdown saw every generation stop

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The worker threads (created on first use, and again after a shutdown)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="selfspec-server")
            return self._executor

    def _is_idle(self) -> bool:
        """No generation request admitted, waiting, or still running on a worker thread."""
        return self.admission.inside == 0 and not self.admission.waiting and not self._jobs

    def begin_shutdown(self) -> None:
        """Start a bounded shutdown (on the event loop, when the server stops accepting connections).

        Queued generation requests, and any that arrive after this, get a 503 ``shutting_down``
        (:meth:`Admission.close`); the running ones have ``limits.shutdown_grace`` seconds to
        finish, then they are cancelled (:meth:`cancel_running`).
        """
        refused = self.admission.close()
        logger.info(
            "shutting down: %d running generation(s) get %gs to finish, %d queued request(s) refused",
            len(self._jobs),
            self.limits.shutdown_grace,
            refused,
        )
        asyncio.get_running_loop().call_later(self.limits.shutdown_grace, self.cancel_running)

    def cancel_running(self) -> None:
        """Cancel every generation (a stream ends with a ``shutting_down`` error event, a whole answer gets 503)."""
        self._cancel_all = True
        if self._jobs:
            logger.warning("shutdown grace over: cancelling %d running generation(s)", len(self._jobs))
        for job in self._jobs.copy():
            job.cancelled.set()

    def shutdown(self, timeout: float = WORKER_STOP_TIMEOUT) -> bool:
        """Cancel every generation and wait up to ``timeout`` seconds for them to stop.

        Returns:
            Whether every generation stopped (a worker stuck inside one forward may not).
        """
        self.cancel_running()
        if self.idle_trim is not None:
            self.idle_trim.close()
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._jobs

    def _run_job(self, job: _Job) -> GenerationOutput | None:
        """Run ``job`` on this worker thread (at once cancelled once the shutdown's grace is over)."""
        try:
            if self._cancel_all:
                job.cancelled.set()
            return job.run(self.metrics)
        finally:
            self._jobs.discard(job)

    async def in_thread(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, func, *args)

    # -- checks
    async def check_key(self, request: Request) -> None:
        """Refuse a request without the right ``Authorization: Bearer`` key (when one is set).

        The key is compared as UTF-8 bytes with the bytes the client sent, in constant time, so a
        non-ASCII key matches a client that sends it in UTF-8 (as ``openai`` and ``httpx`` do).
        """
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")  # decoded as latin-1: each byte one character
        scheme, _, token = header.partition(" ")
        sent = token.strip().encode("latin-1")  # the bytes the client sent
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.api_key.encode("utf-8")):
            message = "Incorrect API key provided." if header else "Missing API key: send 'Authorization: Bearer KEY'."
            raise APIError(401, message, code="invalid_api_key")

    def check_model(self, model: str) -> None:
        """Refuse a model id other than the served one (a real model's cached file counts as its short name)."""
        if model != self.model_id and display_name(model) != self.model_id:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_id!r}.",
                param="model",
                code="model_not_found",
            )

    # -- preparing generations (on a worker thread: templates, tokenization and grammars take time)
    def prepare_chat(self, body: ChatCompletionRequest) -> _Job:
        """Hand the request to the planner (:func:`selfspec.serving.requests.plan_request`); nothing is decoded yet."""
        messages = engine_messages(body.messages)
        with _bad_request("messages"):
            plan = plan_request(self.engine, messages, body.request_options())
        return self._start(plan, "messages")

    def prepare_completion(self, body: CompletionRequest) -> _Job:
        """Hand the prompt (text or token ids) to the planner; nothing is decoded yet."""
        prompt = body.single_prompt()
        with _bad_request("prompt"):
            plan = plan_request(self.engine, prompt, body.request_options())
        return self._start(plan, "prompt")

    @staticmethod
    def _start(plan: RequestPlan, prompt_field: str) -> _Job:
        """Start the plan's stream (the grammar is compiled here; the repetition guard wraps it)."""
        constraint_field = None
        if plan.constraint is not None:
            constraint_field = "response_format" if plan.constraint.kind == "json_schema" else "tools"
        with _bad_request(constraint_field or prompt_field):
            try:
                stream = plan.stream()
            except ImportError as error:  # llguidance is the optional 'grammar' extra
                raise APIError(
                    400,
                    f"constrained output needs llguidance: pip install 'selfspec[grammar]' ({error})",
                    code="unsupported",
                ) from error
        job = _Job(stream, plan)
        job.constraint_field = constraint_field
        return job

    # -- answering
    async def answer(self, request: Request, kind: str, body: ChatCompletionRequest | CompletionRequest) -> Response:
        """Run one generation request, streamed or whole."""
        self.check_model(body.model)
        body.check_supported()
        self.check_token_prompt(body)  # sizes and text lengths: the planner's one check (check_request_bounds)
        request_id = str(request.scope.get("selfspec.request_id", ""))
        prepare = self.prepare_chat if isinstance(body, ChatCompletionRequest) else self.prepare_completion
        job: _Job = await self.in_thread(prepare, body)
        legacy = isinstance(body, ChatCompletionRequest) and body.legacy_functions
        render = _Render(kind, self.model_id, job, body.include_usage, self.engine.tokenizer, legacy_functions=legacy)
        plan_headers = _plan_headers(plan_report(self.engine))
        if body.stream:  # the statistics come in the last chunk ("selfspec"): only the plan is known now
            queue = job.stream_to(asyncio.get_running_loop())
            return StreamingResponse(
                self._events(job, queue, render, request_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **plan_headers},
            )
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, job))
        self._jobs.add(job)
        try:
            output = await self.in_thread(self._run_job, job)
        finally:
            job.cancelled.set()  # a no-op when finished; else this request was cancelled (a forced shutdown)
            watcher.cancel()
        if job.client_gone:  # nobody to answer: counted as 499, the cancelled text never rendered
            return Response(status_code=CLIENT_CLOSED)
        if job.error is not None or output is None:
            raise _generation_error(job.error, request_id, job.constraint_field)
        if job.plan.finish_reason(output) == "cancelled":  # the server is shutting down (not the repetition guard)
            raise shutting_down()
        return JSONResponse(render.response(output), headers={**plan_headers, **_stats_headers(output)})

    def check_token_prompt(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        """Refuse a token-id prompt longer than the context window (before a worker thread is taken).

        Text prompts, messages, tools and schemas are bounded by the planner, once, before anything is
        rendered or tokenized (:func:`selfspec.serving.requests.check_request_bounds`).
        """
        if not isinstance(body, CompletionRequest):
            return
        prompt = body.single_prompt()  # several prompts, or an empty one: a 400 before a worker is taken
        if body.truncate_prompt or isinstance(prompt, str) or self.engine.context_window is None:
            return
        if len(prompt) > self.engine.context_window:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; the context window holds {self.engine.context_window}",
                param="prompt",
                code="context_length_exceeded",
            )

    async def _events(
        self, job: _Job, queue: asyncio.Queue[object], render: _Render, request_id: str
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer; leaving early cancels the generation."""
        self._jobs.add(job)
        future = asyncio.get_running_loop().run_in_executor(self.executor, self._run_job, job)
        try:
            for chunk in render.first():
                yield _sse(chunk)
            while (item := await queue.get()) is not _END:
                assert isinstance(item, _Delta)
                for chunk in render.delta(item):
                    yield _sse(chunk)
            await future
            if job.error is not None or job.output is None:
                yield _sse(_generation_error(job.error, request_id, job.constraint_field).body())
            elif job.plan.finish_reason(job.output) == "cancelled":  # cut off by the shutdown's grace
                yield _sse(shutting_down().body())
            else:
                for chunk in render.last(job.output):
                    yield _sse(chunk)
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a no-op when finished; else the client has gone


def _generation_error(error: BaseException | None, request_id: str, param: str | None = None) -> APIError:
    """A failed generation's answer.

    Out of memory is a 503 with the engine's advice; a schema or tools that the grammar cannot
    follow a 400 ``invalid_schema`` (``param``: the field that holds them); anything else a
    generic 500 (the traceback is in the log, never in the body).
    """
    if isinstance(error, MemoryError):
        return APIError(503, str(error), type="server_error", code="out_of_memory")
    if isinstance(error, InvalidSchemaError):  # the client's grammar failed mid-generation: its fault, one line
        return APIError(400, str(error), param=param, code="invalid_schema")
    return internal_error(request_id)


@contextmanager
def _bad_request(prompt_field: str) -> Iterator[None]:
    """Turn the engine's ``ValueError`` (and chat-template errors) into 400 responses."""
    try:
        yield
    except APIError:
        raise
    except RequestFieldError as error:
        raise APIError(400, str(error), param=error.field) from error
    except OversizeFieldError as error:
        raise APIError(400, str(error), param=error.field, code="invalid_schema") from error
    except PromptTooLongError as error:
        raise APIError(400, str(error), param=prompt_field, code="context_length_exceeded") from error
    except InvalidSchemaError as error:
        raise APIError(400, str(error), param=prompt_field, code="invalid_schema") from error
    except (ValueError, _TemplateError) as error:
        message = str(error) if "\n" not in str(error) else one_line(str(error))  # never a multi-line dump
        raise APIError(400, message, param=engine_error_param(error, prompt_field)) from error


async def _cancel_on_disconnect(request: Request, job: _Job) -> None:
    """Cancel ``job`` when the client of a non-streamed request disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.client_gone = True
            job.cancelled.set()
            return


async def _read_body(request: Request, model: type[_Body]) -> _Body:
    """Parse a JSON body into ``model``; malformed or over-deep JSON, bad text or fields are a 400."""
    raw = await request.body()
    server: _Server = request.app.state.selfspec
    data = parse_json(raw, server.limits.max_json_depth)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        # pydantic names the member of a union that failed ("prompt.str"): keep the field's path
        parts = [str(part) for part in first["loc"] if not _UNION_TAG.match(str(part))]
        param = ".".join(parts) or None
        message = first["msg"]
        if parts[:1] == ["prompt"]:  # the union's first member's message ("a valid string") would mislead
            param, message = "prompt", PROMPT_FORMS
        raise APIError(400, f"invalid request: {param}: {message}", param=param) from error


#: What a completions ``prompt`` may be (the message of a 400 for any other value).
PROMPT_FORMS = (
    "must be a string, a list of token ids (integers), or a one-element list of either "
    '("text", [1, 2, 3], ["text"], [[1, 2, 3]])'
)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


# ------------------------------------------------------------------------------- the app
def create_app(
    engine_or_model: str | SpeculativeEngine,
    *,
    model_id: str | None = None,
    api_key: str | None = None,
    batching: bool = False,
    limits: ServerLimits | None = None,
    bound_host: str | None = None,
) -> FastAPI:
    """Create the OpenAI-compatible ASGI app.

    Args:
        engine_or_model: an engine, or a model name loaded with :func:`selfspec.get_engine`
            (a hub id, a local folder, a ``.gguf`` file, ``"selfspec-demo"``, or a real model's
            short name such as ``"smollm2-135m-instruct"``).
        model_id: the model id clients send and ``/v1/models`` lists; default: the model
            name given, else the engine's ``model_name`` (a real model's short name, never its
            file in the cache).
        api_key: when set, every route (``/v1/*``, ``/health``, ``/metrics``, ``/docs``,
            ``/redoc``, ``/openapi.json``) needs ``Authorization: Bearer <api_key>``.
        batching: load a named model with ``batching=True`` (concurrent requests decode
            together); an engine passed in keeps its own setting.
        limits: body size, timeouts, concurrency, accepted hosts and CORS origins
            (:class:`~selfspec.serving.server.settings.ServerLimits`; default: its safe defaults).
        bound_host: the address the server binds, accepted in the ``Host`` header besides
            ``localhost``, ``127.0.0.1``, ``[::1]`` and ``limits.allowed_hosts``.

    Returns:
        A FastAPI app; run it with any ASGI server (see :func:`serve`). Under uvicorn, pass
        :func:`~selfspec.serving.server.limits.uvicorn_settings` (``limits``) to ``uvicorn.run`` for the
        header deadline and keep-alive limits that the app itself cannot apply.

    Example:
        >>> from selfspec.serving.server import create_app
        >>> app = create_app("selfspec-demo")  # doctest: +SKIP
    """
    if isinstance(engine_or_model, str):
        engine = get_engine(engine_or_model, batching=batching)
        model_id = model_id or display_name(engine_or_model)
    else:
        engine = engine_or_model
        model_id = model_id or engine.model_name or "selfspec"
    limits = limits or ServerLimits()
    server = _Server(engine, model_id, api_key, limits)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving %s: %s", _public_name(server.model_id), plan_report(engine)["summary"])
        try:
            yield
        finally:
            server.stopped = await asyncio.get_running_loop().run_in_executor(None, server.shutdown)

    # the docs and the schema are served below, behind the key like every other route
    app = FastAPI(
        title="selfspec",
        summary="OpenAI-compatible self-speculative decoding",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.selfspec = server
    _add_error_handlers(app)
    keyed = [Depends(server.check_key)]
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.answer(request, "chat", await _read_body(request, ChatCompletionRequest))

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await server.answer(request, "text", await _read_body(request, CompletionRequest))

    def model_card() -> dict[str, Any]:
        return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "selfspec"}

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        server.check_model(model)
        return model_card()

    app.include_router(v1)

    @app.get("/health", dependencies=keyed)
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": _public_name(server.model_id), "plan": plan_report(server.engine)}

    @app.get("/metrics", dependencies=keyed)
    async def metrics() -> Response:
        return PlainTextResponse(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", dependencies=keyed, include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=keyed, include_in_schema=False)
    async def docs() -> Response:
        from fastapi.openapi.docs import get_swagger_ui_html

        return get_swagger_ui_html(openapi_url="/openapi.json", title="selfspec")

    @app.get("/redoc", dependencies=keyed, include_in_schema=False)
    async def redoc() -> Response:
        from fastapi.openapi.docs import get_redoc_html

        return get_redoc_html(openapi_url="/openapi.json", title="selfspec")

    endpoints = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})

    def count(path: str, status: int) -> None:
        server.metrics.request_finished(path if path in endpoints else "other", status)

    if limits.cors_origins:  # inside the guard: the Host check and the counting apply to preflights too
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(limits.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(
        RequestGuard,
        limits=limits,
        allowed_hosts=host_allow_list(bound_host, limits.allowed_hosts),
        generation_paths=frozenset({"/v1/chat/completions", "/v1/completions"}),
        count=count,
        admission=server.admission,
    )
    return app


def _public_name(model_id: str) -> str:
    """A model id fit for ``/health``: a local path is cut to its last part (never an absolute path)."""
    if os.path.isabs(model_id) or model_id.startswith(("~", "./", "../")):
        return Path(model_id).name
    return model_id


# ------------------------------------------------------------------------------- the plan, statistics headers
def plan_report(engine: SpeculativeEngine) -> dict[str, Any]:
    """What the engine runs, for ``/health``, the startup log line and the ``x-selfspec-*`` headers.

    Returns:
        ``drafter`` (the engine's drafter: ``"auto"`` or a registered name), ``method`` (what
        runs: the plan's method under ``"auto"``), ``settings`` (the method's settings),
        ``predicted_speedup`` (calibration's prediction over plain decoding, or ``None``),
        ``calibrated`` (whether the settings were measured on this machine) and ``summary``
        (one line). No file path appears in it: a path-like setting is cut to its last part.
    """
    config = engine.config
    plan = engine.plan
    if plan is not None:
        settings = dict(plan.settings)
        report: dict[str, Any] = {
            "drafter": "auto",
            "method": plan.method,
            "settings": settings,
            "predicted_speedup": plan.predicted_speedup,
            "calibrated": plan.calibrated,
            "summary": plan.summary(),
        }
    else:
        name = config.drafter_name
        settings = {"num_draft_tokens": config.num_draft_tokens, "adaptive": config.adaptive}
        if config.tree_nodes:
            settings["tree_nodes"] = config.tree_nodes
        if name in ("early_exit", "hybrid", "layer_skip"):
            settings["exit_layer"] = config.exit_layer
        speedup = config.calibration.get("predicted_speedup") if isinstance(config.calibration, dict) else None
        report = {
            "drafter": name,
            "method": name,
            "settings": settings,
            "predicted_speedup": speedup if isinstance(speedup, (int, float)) else None,
            "calibrated": bool(config.calibration),
            "summary": f"{name}, " + ", ".join(f"{key}={value}" for key, value in settings.items()),
        }
    report["settings"] = {key: _public_value(value) for key, value in settings.items()}
    return report


def _public_value(value: Any) -> Any:
    """A setting fit for ``/health``: a path is cut to its last part."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and (os.sep in value or value.startswith("~"))):
        return Path(value).name
    return value


def _header(value: Any) -> str:
    """A header value: one line of ASCII."""
    text = value if isinstance(value, str) else json.dumps(value)
    return " ".join(text.encode("ascii", "replace").decode("ascii").split())


def _plan_headers(report: dict[str, Any]) -> dict[str, str]:
    """``x-selfspec-drafter``, ``-method``, ``-plan``, ``-calibrated`` and ``-predicted-speedup``."""
    headers = {
        "x-selfspec-drafter": _header(report["drafter"]),
        "x-selfspec-method": _header(report["method"]),
        "x-selfspec-plan": _header(report["summary"]),
        "x-selfspec-calibrated": _header(report["calibrated"]),
    }
    if report["predicted_speedup"] is not None:
        headers["x-selfspec-predicted-speedup"] = _header(report["predicted_speedup"])
    return headers


def _stats_headers(output: GenerationOutput) -> dict[str, str]:
    """Every :class:`~selfspec.decoding.outputs.GenerationStats` field as ``x-selfspec-<field-with-dashes>``.

    E.g. ``x-selfspec-num-drafted``, ``x-selfspec-num-accepted``, ``x-selfspec-mean-accepted-length``,
    ``x-selfspec-tokens-per-second``; the histogram as comma-separated counts.
    """
    headers = {}
    for name, value in output.stats.to_dict().items():
        text = ",".join(str(v) for v in value) if isinstance(value, list) else _header(value)
        headers[f"x-selfspec-{name.replace('_', '-')}"] = text
    return headers


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error with an OpenAI-style body."""

    async def api_error(_request: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
        return JSONResponse(error.body(), status_code=error.status, headers={**headers, **error.headers})

    async def http_error(_request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        code = "not_found" if error.status_code == 404 else None
        return JSONResponse(
            error_body(str(error.detail), code=code), status_code=error.status_code, headers=error.headers
        )

    async def validation_error(_request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return JSONResponse(error_body(f"invalid request: {error.errors()}"), status_code=400)

    async def server_error(request: Request, error: Exception) -> Response:
        # reached only if an exception escapes the RequestGuard: a generic body, never the error's text
        request_id = str(request.scope.get("selfspec.request_id", "unknown"))
        logger.error("request %s failed", request_id, exc_info=error)
        return JSONResponse(internal_error(request_id).body(), status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, server_error)


def serve(
    model: str | SpeculativeEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    model_id: str | None = None,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    **engine_args: Any,
) -> None:
    """Load a model and serve it until SIGTERM or Ctrl-C (binds to loopback by default).

    The first signal starts a bounded shutdown: no new connections, queued requests get 503
    ``shutting_down``, running ones get ``limits.shutdown_grace`` seconds to finish before they
    are cancelled; then this function returns. A second signal ends the process at once (status
    0), as does a generation that does not stop within a few seconds of its cancellation (the
    interpreter would otherwise wait for its thread). See ``docs/limits.md`` (Shutdown).

    Args:
        model: a model name (hub id, local folder, ``.gguf`` file, ``"selfspec-demo"``, a real
            model's short name such as ``"smollm2-135m-instruct"``) or an engine.
        host: the interface to bind; ``"0.0.0.0"`` exposes the server to the network.
        port: the TCP port.
        api_key: require ``Authorization: Bearer <api_key>`` on every route.
        model_id: the id clients use (default: ``model`` when it is a name).
        log_level: uvicorn's log level.
        limits: the server's limits (:class:`~selfspec.serving.server.settings.ServerLimits`).
        **engine_args: arguments of :meth:`SpeculativeEngine.from_pretrained`.
    """
    import sys

    limit_arenas()  # before any worker thread allocates (docs/limits.md, Memory); MALLOC_ARENA_MAX wins
    limits = limits or ServerLimits()
    if isinstance(model, str):
        engine = get_engine(model, **engine_args)
        model_id = model_id or display_name(model)
    elif engine_args:
        raise TypeError(f"engine arguments {sorted(engine_args)} need a model name, not an engine")
    else:
        engine = model
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it can use the model", host)
    if host in ("0.0.0.0", "::") and not limits.allowed_hosts:
        logger.warning(
            "serving on %s, but only requests for localhost are accepted: pass --allowed-host NAME "
            "for each name clients use to reach this server",
            host,
        )
    app = create_app(engine, model_id=model_id, api_key=api_key, limits=limits, bound_host=host)
    server: _Server = app.state.selfspec
    config = uvicorn_config(app, host, port, limits, log_level, log_config=_log_config(log_level))
    uvicorn_server = graceful_server(config, server.begin_shutdown)
    uvicorn_server.run()
    if not uvicorn_server.started:  # as uvicorn.run: the app's start-up failed
        sys.exit(3)
    if not server.stopped:
        logger.warning("a generation did not stop %gs after its cancellation: exiting anyway", WORKER_STOP_TIMEOUT)
        logging.shutdown()
        os._exit(0)


def _log_config(log_level: str) -> dict[str, Any]:
    """Uvicorn's logging setup, with selfspec's own loggers on its console handler at ``log_level``.

    So the server's start-up line (the plan) and its warnings read like uvicorn's own lines.
    """
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("loggers", {})["selfspec"] = {
        "handlers": ["default"],
        "level": log_level.upper(),
        "propagate": False,
    }
    return config


@contextmanager
def serve_in_background(
    engine: SpeculativeEngine,
    *,
    model_id: str | None = None,
    api_key: str | None = None,
    timeout: float = 30.0,
    limits: ServerLimits | None = None,
) -> Iterator[str]:
    """Serve ``engine`` on a free loopback port from a background thread, for tests and benchmarks.

    Yields the server's root URL (``http://127.0.0.1:PORT``; the OpenAI API is under ``/v1``)
    once it accepts connections, and stops the server when the block ends.

    Raises:
        RuntimeError: the server did not start within ``timeout`` seconds.
    """
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    limits = limits or ServerLimits()
    app = create_app(engine, model_id=model_id, api_key=api_key, limits=limits, bound_host="127.0.0.1")
    server = graceful_server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"),
                             app.state.selfspec.begin_shutdown)  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on port {port} did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
