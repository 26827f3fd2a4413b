"""The server's limits as one value (no web framework imported, so ``selfspec --help`` works without them).

Each limit that is a ``selfspec serve`` flag declares it here once, the way every
:class:`~selfspec.decoding.options.EngineOptions` field declares its own: an
:class:`~selfspec.drafting.declaring.OptionSpec` in the field's metadata
(:func:`~selfspec.decoding.options.cli`); :mod:`selfspec.cli.serve` builds the flags from these
declarations.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...decoding.options import OptionSpec, bounded_int, cli, declared_flags, number

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20, "g": 10**9}
_UNITS.update({"gb": 10**9, "gib": 2**30})


def byte_size(value: str) -> int:
    """A size in bytes: ``2097152``, ``2MiB``, ``500kB``, ``1.5MB`` (at least 1 byte)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 2097152, 2MiB or 500kB, got {value!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"must be at least 1 byte, got {value!r}")
    return size


def seconds(value: str) -> float:
    """A finite number of seconds > 0."""
    amount = number(value, "seconds")
    if not 0 < amount < math.inf:
        raise ValueError(f"must be a finite number of seconds > 0, got {value!r}")
    return amount


def count(value: str) -> int:
    """An int >= 0."""
    return bounded_int(value, 0)


def positive_count(value: str) -> int:
    """An int >= 1."""
    return bounded_int(value, 1)


#: The verb whose flags the limits are.
SERVE_VERB = frozenset({"serve"})


def _flag(flag: str, help: str, parse: Callable[[str], Any] | None = None, **more: Any) -> dict[str, OptionSpec]:
    """The metadata of a limit that is a ``selfspec serve`` flag (:func:`~selfspec.decoding.options.cli`).

    ``help``'s ``{default}`` is replaced by the default; ``parse=None`` makes a repeatable name,
    collected into a tuple (its ``metavar`` names it in ``--help``).
    """
    return cli(help, flag, verbs=SERVE_VERB, parse=parse, **more)


def limit_flags() -> list[tuple[str, Any, OptionSpec]]:
    """``(field name, default, flag)`` of every :class:`ServerLimits` field that is a flag."""
    return declared_flags(ServerLimits)


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
        shutdown_grace: seconds the running generations get to finish after a SIGTERM
            (``--shutdown-grace``); queued requests get 503 ``shutting_down`` at once, and the
            generations still running at the end of the grace are cancelled.
    """

    max_body_bytes: int = field(
        default=2 * 1024 * 1024,
        metadata=_flag(
            "--max-body-size",
            "largest request body, e.g. 2MiB; larger ones get 413 (default: {default} bytes)",
            byte_size,
        ),
    )
    max_concurrent: int = field(
        default=32,
        metadata=_flag("--max-concurrent", "generation requests served at once (default: {default})", positive_count),
    )
    max_queue: int = field(
        default=128,
        metadata=_flag(
            "--max-queue", "requests waiting for a slot; more get 429 with Retry-After (default: {default})", count
        ),
    )
    header_timeout: float = field(
        default=10.0,
        metadata=_flag(
            "--header-timeout",
            "seconds to send a request's headers before the connection is closed (default: {default})",
            seconds,
        ),
    )
    body_timeout: float = field(
        default=30.0,
        metadata=_flag("--body-timeout", "seconds to send a request body; 408 otherwise (default: {default})", seconds),
    )
    keep_alive_timeout: float = field(
        default=5.0,
        metadata=_flag(
            "--keep-alive-timeout", "seconds an idle keep-alive connection stays open (default: {default})", seconds
        ),
    )
    max_header_bytes: int = 16 * 1024
    max_json_depth: int = 64
    retry_after: int = 1
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--allowed-host",
            "accept this Host header besides localhost, 127.0.0.1, [::1] and --host (repeatable; '*': any)",
            metavar="NAME",
        ),
    )
    cors_origins: tuple[str, ...] = field(
        default=(),
        metadata=_flag(
            "--cors-origin",
            "let browser pages from this origin call the API, e.g. http://localhost:3000 (repeatable; "
            "default: none, no CORS headers)",
            metavar="ORIGIN",
        ),
    )

    shutdown_grace: float = field(
        default=30.0,
        metadata=_flag(
            "--shutdown-grace",
            "seconds running requests get to finish after SIGTERM; then they are cancelled, and queued "
            "ones get 503 at once (default: {default})",
            seconds,
        ),
    )

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_concurrent", "max_header_bytes", "max_json_depth", "retry_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {self.max_queue!r}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
