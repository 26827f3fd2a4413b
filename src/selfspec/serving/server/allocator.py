"""The C allocator's settings for a long-running server (glibc ``malloc``), applied from Python.

glibc gives threads that allocate at the same time separate heaps ("arenas", up to eight per
core). Memory freed in one arena serves only that arena's later requests, and little of it goes
back to the system, so a server whose worker threads take turns on the model keeps the high-water
mark of every arena: resident memory steps up with bursts of concurrent requests.

``MALLOC_ARENA_MAX`` is read once, when the process starts; :func:`limit_arenas` sets the same
limit from inside a running process (``mallopt(M_ARENA_MAX)``, through :mod:`ctypes`), which holds
for every arena created afterwards, so ``selfspec serve`` calls it before its first worker
thread starts. A ``MALLOC_ARENA_MAX`` in the environment wins (``0`` keeps glibc's own default).
:func:`~selfspec.core.memory.release_free_memory` (``malloc_trim(0)``) hands the free pages of every arena back to the
system; :class:`IdleTrim` calls it once each time the server goes idle (no generation request
admitted or running), so the pages a burst of requests freed go back between bursts instead of
waiting for the next burst to reuse them. ``SELFSPEC_IDLE_TRIM=0`` turns that off. Elsewhere
(musl, macOS, Windows) all of this does nothing and says so.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ...core import memory
from ...core.memory import release_free_memory

__all__ = [
    "ARENA_MAX",
    "ARENA_MAX_ENV",
    "IDLE_TRIM_DELAY",
    "IDLE_TRIM_ENV",
    "IdleTrim",
    "idle_trim_enabled",
    "limit_arenas",
    "release_free_memory",
]

logger = logging.getLogger("selfspec.serving.server")

#: Arenas ``selfspec serve`` allows (``benchmarks/results/serve_rss_cpu.md``; docs/limits.md, Memory).
ARENA_MAX = 2
#: The environment variable glibc reads at start-up; when set, the server leaves the allocator alone.
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
#: Seconds the server stays idle before it trims: the stragglers of a burst (a cancelled
#: generation finishing its round) are done by then, and a gap between two requests costs nothing.
IDLE_TRIM_DELAY = 0.5
#: ``0`` keeps the server from trimming when it goes idle (anything else, or unset: it trims).
IDLE_TRIM_ENV = "SELFSPEC_IDLE_TRIM"
#: ``mallopt``'s parameter number for the arena limit (glibc's ``malloc.h``).
_M_ARENA_MAX = -8


def limit_arenas(arenas: int = ARENA_MAX) -> int | None:
    """Allow at most ``arenas`` malloc arenas from now on, unless ``MALLOC_ARENA_MAX`` is set.

    Args:
        arenas: the limit (>= 1).

    Returns:
        The limit set, or ``None`` when nothing was changed (the environment sets it, or the C
        library is not glibc).

    Raises:
        ValueError: ``arenas`` < 1.
    """
    if isinstance(arenas, bool) or not isinstance(arenas, int) or arenas < 1:
        raise ValueError(f"the malloc arena limit is an int >= 1, got {arenas!r}")
    if os.environ.get(ARENA_MAX_ENV, "") != "":
        logger.debug("%s=%s is set: the allocator is left as it is", ARENA_MAX_ENV, os.environ[ARENA_MAX_ENV])
        return None
    libc = memory.glibc()
    if libc is None:
        logger.debug("not glibc: the malloc arena limit is not set")
        return None
    if libc.mallopt(_M_ARENA_MAX, arenas) != 1:
        logger.warning("mallopt(M_ARENA_MAX, %d) failed: the allocator keeps its default arenas", arenas)
        return None
    return arenas


def idle_trim_enabled() -> bool:
    """Whether the server trims when it goes idle (unless ``SELFSPEC_IDLE_TRIM=0``)."""
    return os.environ.get(IDLE_TRIM_ENV, "").strip() != "0"


class IdleTrim:
    """Calls :func:`~selfspec.core.memory.release_free_memory` once per idle period, on a thread of its own.

    The owner calls :meth:`busy` when work starts and :meth:`idle` when the last piece of work has
    ended; ``is_idle`` is asked again when the delay is over, so work that began meanwhile (or a
    straggler still running) puts the trim off until the next call of :meth:`idle`, or, for a
    straggler, until it has finished. Thread-safe.

    Args:
        is_idle: whether nothing runs now (asked when the delay is over).
        delay: seconds of idleness before the trim.
        release: what trims (default :func:`~selfspec.core.memory.release_free_memory`).
    """

    def __init__(
        self,
        is_idle: Callable[[], bool],
        delay: float = IDLE_TRIM_DELAY,
        release: Callable[[], bool] = release_free_memory,
    ) -> None:
        self.is_idle = is_idle
        self.delay = delay
        self.release = release
        self.trims = 0  # trims done so far
        self.seconds = 0.0  # time spent in them
        self._lock = threading.Lock()
        self._period = 0  # bumped by every busy(): a trim belongs to one idle period
        self._trimmed_period = -1  # the period of the last trim
        self._timer: threading.Timer | None = None

    def busy(self) -> None:
        """Work started: the idle period (if any) is over and a pending trim is dropped."""
        with self._lock:
            self._period += 1
            self._cancel()

    def idle(self) -> None:
        """The last piece of work ended: trim after :attr:`delay` seconds, unless work comes back first."""
        with self._lock:
            if self._trimmed_period == self._period:
                return  # this period was trimmed already
            self._cancel()
            self._arm(self._period)

    def close(self) -> None:
        """Drop a pending trim (the server is stopping)."""
        with self._lock:
            self._cancel()

    def _cancel(self) -> None:
        """Drop the pending timer, if any (the lock held)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, period: int) -> None:
        """Look at ``period`` again after :attr:`delay` seconds (the lock held)."""
        self._timer = threading.Timer(self.delay, self._expire, args=(period,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, period: int) -> None:
        with self._lock:
            self._timer = None
            if period != self._period or self._trimmed_period == period:
                return
            if not self.is_idle():  # a straggler still runs: look again after another delay
                self._arm(period)
                return
            self._trimmed_period = period
        started = time.perf_counter()
        released = self.release()
        elapsed = time.perf_counter() - started
        with self._lock:
            self.trims += 1
            self.seconds += elapsed
        logger.debug("idle: malloc_trim(0) took %.1f ms (memory returned: %s)", elapsed * 1000, released)
