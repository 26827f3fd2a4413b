"""What ``selfspec serve`` refuses, and how fast: limits on hosts, bodies, time and concurrency.

Every request passes through :class:`RequestGuard` (an ASGI middleware) before the routes see
it. In order, it:

1. gives the request an id (``X-Request-ID`` on every answer; 500 bodies quote it),
2. refuses a request with both ``Content-Length`` and ``Transfer-Encoding`` (400, and the
   connection is closed: RFC 9112's answer to request smuggling),
3. checks the ``Host`` header against an allow-list (403; defeats DNS rebinding),
4. requires ``Content-Type: application/json`` on ``POST`` (415; a browser page cannot send a
   JSON body across origins without a CORS preflight, which is refused unless ``--cors-origin``),
5. refuses a declared ``Content-Length`` over the body limit before reading a byte (413), and
   counts the bytes of a chunked body as they arrive (413 at the limit, nothing more is kept),
6. gives the whole body a deadline (408),
7. admits at most ``max_concurrent`` generation requests at once and queues ``max_queue``
   more; beyond that the answer is 429 with ``Retry-After``; once the server is shutting
   down, queued and new generation requests get 503 ``shutting_down`` (:class:`Admission`),
8. answers an exception that escaped the app with a generic 500 that names the request id
   (the traceback goes to the log once, never to the client), and counts a client that went
   away before its answer under the status label ``499`` instead of as a 500.

Uvicorn's own settings bound the rest (:func:`uvicorn_config`): a header-read timeout (a
connection whose request headers are not complete in ``header_timeout`` seconds is closed), the
keep-alive timeout, and the largest request head.

The JSON of a body is checked by :func:`check_json` (depth, lone surrogates, non-finite
numbers); a prompt's length in characters, tools and schemas are bounded by the request planner
(:func:`selfspec.serving.requests.check_request_bounds`), before any tokenizer runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .protocol import APIError
from .settings import ServerLimits

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["Admission", "RequestGuard", "ServerLimits", "check_json", "parse_json"]

logger = logging.getLogger("selfspec.serving.server")

#: Host names every server accepts (with any port).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: The status label under which requests whose client went away are counted (nginx's 499).
CLIENT_CLOSED = 499
#: Refused bodies declared larger than this many times the limit get their connection closed
#: instead of discarded as they arrive.
DRAIN_FACTOR = 8
_SURROGATE = re.compile("[\ud800-\udfff]")


def normalize_host(host: str) -> str:
    """A ``Host`` header or bind address without its port, lower case, IPv6 in brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.index("]") + 1] if "]" in host else host
    if host.count(":") > 1:  # a bare IPv6 address
        return f"[{host}]"
    return host.split(":", 1)[0]


def host_allow_list(bound_host: str | None, extra: Iterable[str]) -> frozenset[str] | None:
    """The accepted host names (``None``: any host, when ``*`` is among ``extra``)."""
    names = set(LOCAL_HOSTS)
    extra = list(extra)
    if "*" in extra:
        return None
    if bound_host and bound_host not in ("0.0.0.0", "::", ""):
        names.add(normalize_host(bound_host))
    names.update(normalize_host(name) for name in extra)
    return frozenset(names)


# ------------------------------------------------------------------------------- JSON bodies
#: Where a value sits in the body, built as the walk goes (``(parent, key or index)``) and spelled
#: out only for an error, so that walking a body of 20,000 keys builds no 20,000 path strings.
_Path = tuple[Any, str | int] | None


def check_json(data: Any, max_depth: int) -> None:
    r"""Refuse a parsed JSON body that nests deeper than ``max_depth`` or holds bad values.

    Walks the body iteratively (no recursion to exhaust) and refuses, naming the field:
    strings with lone surrogates (JSON's ``"\ud800"`` escapes; no tokenizer can encode
    them) and numbers that are not finite (``1e400`` parses as infinity).

    Raises:
        APIError: a 400 for the first problem found.
    """
    _check_scalar(data, None)
    if not isinstance(data, (dict, list)):
        return
    # only containers are pushed (scalars are checked where they sit), so a list of 20,000
    # strings allocates nothing: allocating per item wakes the garbage collector over the
    # whole heap of a loaded model
    stack: list[tuple[Any, _Path, int]] = [(data, None, 1)]
    while stack:
        container, where, depth = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"the JSON body nests deeper than {max_depth} levels")
        if isinstance(container, dict):
            for key, item in container.items():
                if not key.isascii() and _SURROGATE.search(key):
                    path = _path_text(where)
                    raise APIError(400, f"{path or 'the body'}: a key holds a lone surrogate", param=_param(path))
                if isinstance(item, (dict, list)):
                    if item or depth + 1 > max_depth:
                        stack.append((item, (where, key), depth + 1))
                elif not isinstance(item, (str, float)) or not _scalar_ok(item):
                    _check_scalar(item, (where, key))
        else:
            for i, item in enumerate(container):
                if isinstance(item, (dict, list)):
                    if item or depth + 1 > max_depth:
                        stack.append((item, (where, i), depth + 1))
                elif not isinstance(item, (str, float)) or not _scalar_ok(item):
                    _check_scalar(item, (where, i))


def _scalar_ok(value: str | float) -> bool:
    """The fast path of :func:`_check_scalar`: an ASCII string or a finite number."""
    return value.isascii() if isinstance(value, str) else math.isfinite(value)


def _check_scalar(value: Any, where: _Path) -> None:
    """Refuse a string with a lone surrogate or a number that is not finite (a 400 naming the field)."""
    if isinstance(value, str):
        match = None if value.isascii() else _SURROGATE.search(value)  # isascii: a fast C scan
        if match is not None:
            path = _path_text(where)
            raise APIError(
                400,
                f"{path or 'the body'}: the string holds a lone surrogate {match.group()!r} at character "
                f"{match.start()}, which is not valid Unicode text",
                param=_param(path),
            )
    elif isinstance(value, float) and not math.isfinite(value):
        path = _path_text(where)
        raise APIError(400, f"{path or 'the body'}: {value} is not a finite number", param=_param(path))


def _path_text(where: _Path) -> str:
    parts: list[str | int] = []
    while where is not None:
        where, part = where
        parts.append(part)
    text = ""
    for part in reversed(parts):
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isascii() and part.isidentifier() and len(part) <= 64:
            text += f".{part}" if text else part
        else:  # a key a client chose: quoted and escaped, so the message stays one short line
            text += f"[{json.dumps(part[:64])}]"
    return text


def _param(path: str) -> str | None:
    return path or None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Parse a request body: strict JSON (no ``NaN``/``Infinity``), bounded depth, valid text.

    Raises:
        APIError: a 400 naming what is wrong.
    """
    import json

    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, f"the JSON body nests deeper than {max_depth} levels") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, >4300-digit ints
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    check_json(data, max_depth)
    return data


# ------------------------------------------------------------------------------- admission
class Admission:
    """At most ``max_concurrent`` requests inside, ``max_queue`` waiting; more get a 429.

    Runs on the event loop (no locks needed): :meth:`enter` either returns once a slot is
    free or raises at once when the queue is full. Slots go to waiters first come, first
    served. After :meth:`close` (the server is shutting down) every waiting request and every
    new one gets a 503 ``shutting_down``; the requests inside keep their slots.

    ``on_enter`` is called each time a request gets a slot, ``on_idle`` each time the last one
    inside leaves with nobody waiting (the server trims the allocator then:
    :class:`~selfspec.serving.server.allocator.IdleTrim`).
    """

    def __init__(
        self,
        max_concurrent: int,
        max_queue: int,
        retry_after: int,
        *,
        on_enter: Callable[[], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.retry_after = retry_after
        self.on_enter = on_enter
        self.on_idle = on_idle
        self.inside = 0
        self.closed = False
        # each waiter's future is resolved with True (a slot is handed to it) or False (closed)
        self._waiters: deque[asyncio.Future[bool]] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiters)

    async def enter(self) -> None:
        """Wait for a slot (raises :class:`APIError` 429 when the queue is full, 503 once closed)."""
        if self.closed:
            raise shutting_down()
        if self.inside < self.max_concurrent and not self._waiters:
            self.inside += 1
            if self.on_enter is not None:
                self.on_enter()
            return
        if self.waiting >= self.max_queue:
            raise APIError(
                429,
                f"the server is busy ({self.inside} requests running, {self.waiting} queued); retry shortly",
                type="rate_limit_error",
                code="server_busy",
                headers={"Retry-After": str(self.retry_after)},
            )
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            admitted = await waiter
        except BaseException:  # cancelled while waiting: a slot handed over meanwhile goes on
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled() and waiter.result():
                self.leave()
            raise
        if not admitted:
            raise shutting_down()

    def leave(self) -> None:
        """Free the slot taken by :meth:`enter` (it goes to the first waiter, if any)."""
        self.inside -= 1
        while self._waiters and self.inside < self.max_concurrent:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.inside += 1
                waiter.set_result(True)
        if self.inside == 0 and not self._waiters and self.on_idle is not None:
            self.on_idle()

    def close(self) -> int:
        """Refuse every waiting request and every later one with a 503; returns how many were waiting."""
        self.closed = True
        refused = 0
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(False)
                refused += 1
        return refused


def shutting_down() -> APIError:
    """The 503 for a request the server will not start because it is shutting down."""
    return APIError(503, "the server is shutting down; retry the request", type="server_error", code="shutting_down")


# ------------------------------------------------------------------------------- the guard
@dataclass
class _Exchange:
    """What the guard knows about one request/response exchange."""

    request_id: str
    status: int | None = None
    complete: bool = False
    client_gone: bool = False
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class RequestGuard:
    """The ASGI middleware that applies :class:`ServerLimits` (see the module docstring).

    Args:
        app: the application to guard.
        limits: the limits.
        allowed_hosts: accepted ``Host`` names (``None``: any).
        generation_paths: the paths that generate (admission control applies to them).
        count: called with ``(path, status)`` once per request (``499``: the client left).
        admission: the admission control of generation requests (default: a new one from
            ``limits``; the server passes its own, which it closes when shutting down).
    """

    def __init__(
        self,
        app: ASGIApp,
        limits: ServerLimits,
        allowed_hosts: frozenset[str] | None,
        generation_paths: frozenset[str],
        count: Callable[[str, int], None],
        admission: Admission | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.allowed_hosts = allowed_hosts
        self.generation_paths = generation_paths
        self.count = count
        self.admission = admission or Admission(limits.max_concurrent, limits.max_queue, limits.retry_after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Guard one ASGI connection scope (HTTP only; lifespan passes through)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(request_id=uuid.uuid4().hex)
        scope["selfspec.request_id"] = exchange.request_id

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = int(message["status"])
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", exchange.request_id.encode()))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                exchange.complete = True
            await send(message)

        async def guarded_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not exchange.complete:
                exchange.client_gone = True
            return message

        try:
            await self._handle(scope, guarded_receive, guarded_send, exchange)
        except APIError as error:
            if exchange.status is None:
                await _send_error(guarded_send, error)
        except Exception as error:  # the last line of defence: a generic 500
            if exchange.status is None:
                logger.error("request %s failed", exchange.request_id, exc_info=error)
                await _send_error(guarded_send, internal_error(exchange.request_id))
            # else: the app answered with its 500 (and logged it) before re-raising
        finally:
            status = exchange.status
            if exchange.client_gone and not exchange.complete:
                logger.debug("request %s: the client went away", exchange.request_id)
                status = CLIENT_CLOSED
            self.count(scope.get("path", ""), 500 if status is None else status)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, exchange: _Exchange) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if "content-length" in headers and "transfer-encoding" in headers:
            raise ambiguous_framing()
        if self.allowed_hosts is not None:
            host = normalize_host(headers.get("host", ""))
            if host not in self.allowed_hosts:
                raise APIError(
                    403,
                    f"the Host header {headers.get('host', '')!r} is not allowed; start the server with "
                    f"--allowed-host {host or 'NAME'} to accept it",
                    type="permission_error",
                    code="host_not_allowed",
                )
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise APIError(
                415,
                f"POST bodies must be sent with 'Content-Type: application/json', got {content_type or 'none'!r}",
                code="unsupported_media_type",
            )
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            raise self._too_large(int(declared))
        body = await self._read_body(receive, exchange)
        if body is None:
            return  # the client went away during the upload: nobody to answer
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if scope.get("path") not in self.generation_paths:
            await self.app(scope, replay, send)
            return
        await self.admission.enter()
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.leave()

    async def _read_body(self, receive: Receive, exchange: _Exchange) -> bytes | None:
        """The whole body, or ``None`` if the client left; raises 413 or 408."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"the request body did not arrive within {self.limits.body_timeout:g} seconds",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                exchange.client_gone = True
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self, declared: int | None) -> APIError:
        """The 413 for a body over the limit.

        The rest of the body is never stored: uvicorn discards it as it arrives (so the client,
        still sending, reads the 413 rather than a reset) for at most ``header_timeout`` seconds;
        a body declared over ``DRAIN_FACTOR`` times the limit gets its connection closed at once.
        """
        size = f"{declared} bytes" if declared is not None else "larger"
        close = declared is not None and declared > DRAIN_FACTOR * self.limits.max_body_bytes
        return APIError(
            413,
            f"the request body is {size}; this server accepts at most {self.limits.max_body_bytes} bytes "
            "(selfspec serve --max-body-size)",
            code="request_too_large",
            headers={"Connection": "close"} if close else None,
        )


def ambiguous_framing() -> APIError:
    """The 400 for a request framed twice (``Content-Length`` and ``Transfer-Encoding``).

    RFC 9112 (section 6.3) lets a server refuse such a request and requires it to close the
    connection after it either way: a proxy in front that reads the other header would see a
    different request boundary (request smuggling). h11 alone lets ``Transfer-Encoding`` win.
    """
    return APIError(
        400,
        "the request has both Content-Length and Transfer-Encoding headers; send one of them",
        code="ambiguous_framing",
        headers={"Connection": "close"},
    )


def internal_error(request_id: str) -> APIError:
    """The generic 500: no exception text, the request id to find the traceback in the log."""
    return APIError(
        500,
        f"the server failed to answer this request (request id {request_id}); the server log has the details",
        type="server_error",
        code="internal_error",
    )


async def _send_error(send: Callable[[Message], Awaitable[None]], error: APIError) -> None:
    import json

    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# ------------------------------------------------------------------------------- uvicorn
#: Seconds uvicorn waits for connections beyond the shutdown grace (the app cancels its
#: generations at the grace; their answers end within a round) before it cancels their tasks.
SHUTDOWN_MARGIN = 2.0


def uvicorn_settings(limits: ServerLimits) -> dict[str, Any]:
    """Keyword arguments of ``uvicorn.run`` and ``uvicorn.Config`` for ``limits``.

    The limits' keep-alive timeout and head size, on h11 with a deadline for request heads, and
    the shutdown's wait for open connections (the grace plus :data:`SHUTDOWN_MARGIN`).
    """
    return {
        "http": header_timeout_protocol(limits.header_timeout),
        "timeout_keep_alive": max(1, math.ceil(limits.keep_alive_timeout)),
        "h11_max_incomplete_event_size": limits.max_header_bytes,
        "timeout_graceful_shutdown": math.ceil(limits.shutdown_grace + SHUTDOWN_MARGIN),
    }


def uvicorn_config(
    app: ASGIApp, host: str, port: int, limits: ServerLimits, log_level: str = "info", **more: Any
) -> Any:
    """A ``uvicorn.Config`` with :func:`uvicorn_settings` (``more``: other ``uvicorn.Config`` arguments)."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, **uvicorn_settings(limits), **more)


def graceful_server(config: Any, on_shutdown: Callable[[], None]) -> Any:
    """A ``uvicorn.Server`` whose first SIGTERM (or Ctrl-C) starts a bounded shutdown and whose second exits.

    On the first signal uvicorn stops accepting connections, and ``on_shutdown`` is called on the
    event loop (the app refuses queued requests and starts the grace); uvicorn then waits for the
    open connections (``timeout_graceful_shutdown``) and runs the app's lifespan shutdown. Unlike
    plain uvicorn, the signal is not raised again afterwards, so the process exits with status 0.
    A second signal ends the process at once (status 0): running generations are dropped, and
    nothing is saved while serving, so nothing is lost but their answers.
    """
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server with selfspec's shutdown (see :func:`graceful_server`)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:
                logger.warning("second signal: exiting now, running generations are dropped")
                for handler in logging.getLogger().handlers + logging.getLogger("selfspec").handlers:
                    handler.flush()
                os._exit(0)
            self.should_exit = True  # no signal raised again at exit: status 0

        async def shutdown(self, sockets: list[Any] | None = None) -> None:
            on_shutdown()
            await super().shutdown(sockets)

    return GracefulServer(config)


_protocols: dict[float, type] = {}


def header_timeout_protocol(header_timeout: float) -> type:
    """Uvicorn's h11 protocol, closing connections whose request head is late.

    Uvicorn bounds idle keep-alive connections, but a client that sends part of a request
    line or headers (and then nothing) keeps its connection open indefinitely. This subclass
    arms a timer when a connection opens and after each response, and disarms it when a
    request's headers are complete.
    """
    if header_timeout in _protocols:
        return _protocols[header_timeout]
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        """H11Protocol with a deadline for each request's head."""

        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's headers are complete
                self._disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():  # waiting for the next request
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                logger.debug("closing a connection whose request head took over %ss", header_timeout)
                self.transport.close()

    _protocols[header_timeout] = HeaderTimeoutH11Protocol
    return HeaderTimeoutH11Protocol
