"""The server's limits as one value (no web framework imported, so ``selfspec --help`` works without them)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server; every field is a ``selfspec serve`` flag.

    Attributes:
        max_body_bytes: the largest request body (``--max-body-size``); larger ones get 413.
        max_concurrent: generation requests prepared or decoded at once (``--max-concurrent``).
        max_queue: generation requests waiting for a slot (``--max-queue``); beyond: 429.
        header_timeout: seconds for a connection to complete a request's headers
            (``--header-timeout``); the connection is closed otherwise.
        body_timeout: seconds to receive a whole request body (``--body-timeout``); 408 otherwise.
        keep_alive_timeout: seconds an idle keep-alive connection stays open (``--keep-alive-timeout``).
        max_header_bytes: the largest request head (request line and headers).
        max_json_depth: the deepest nesting of arrays and objects in a body; deeper is a 400.
        retry_after: the ``Retry-After`` seconds sent with a 429.
        allowed_hosts: host names accepted in the ``Host`` header besides ``localhost``,
            ``127.0.0.1``, ``[::1]`` and the bound address (``--allowed-host``; ``*``: any).
        cors_origins: origins allowed to call the API from a browser (``--cors-origin``); none
            by default, so no CORS headers are sent.
    """

    max_body_bytes: int = 2 * 1024 * 1024
    max_concurrent: int = 32
    max_queue: int = 128
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_header_bytes: int = 16 * 1024
    max_json_depth: int = 64
    retry_after: int = 1
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent", "max_header_bytes", "max_json_depth", "retry_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
