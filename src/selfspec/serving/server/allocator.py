"""The C allocator's settings for a long-running server (glibc ``malloc``), applied from Python.

glibc gives threads that allocate at the same time separate heaps ("arenas", up to eight per
core). Memory freed in one arena serves only that arena's later requests, and little of it goes
back to the system, so a server whose worker threads take turns on the model keeps the high-water
mark of every arena: resident memory steps up with bursts of concurrent requests.

``MALLOC_ARENA_MAX`` is read once, when the process starts; :func:`limit_arenas` sets the same
limit from inside a running process (``mallopt(M_ARENA_MAX)``, through :mod:`ctypes`), which holds
for every arena created afterwards, so ``selfspec serve`` calls it before its first worker
thread starts. A ``MALLOC_ARENA_MAX`` in the environment wins (``0`` keeps glibc's own default).
:func:`release_free_memory` (``malloc_trim(0)``) hands the free pages of every arena back to the
system. Elsewhere (musl, macOS, Windows) both do nothing and say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from functools import cache

__all__ = ["ARENA_MAX", "ARENA_MAX_ENV", "limit_arenas", "release_free_memory"]

logger = logging.getLogger("selfspec.serving.server")

#: Arenas ``selfspec serve`` allows (``benchmarks/results/serve_rss_cpu.md``; docs/limits.md, Memory).
ARENA_MAX = 2
#: The environment variable glibc reads at start-up; when set, the server leaves the allocator alone.
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
#: ``mallopt``'s parameter number for the arena limit (glibc's ``malloc.h``).
_M_ARENA_MAX = -8


@cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (else ``None``)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim") or not hasattr(libc, "gnu_get_libc_version"):
        return None
    return libc


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
    libc = _libc()
    if libc is None:
        logger.debug("not glibc: the malloc arena limit is not set")
        return None
    if libc.mallopt(_M_ARENA_MAX, arenas) != 1:
        logger.warning("mallopt(M_ARENA_MAX, %d) failed: the allocator keeps its default arenas", arenas)
        return None
    return arenas


def release_free_memory() -> bool:
    """Return the free memory of every malloc arena to the system (``malloc_trim(0)``).

    Returns:
        Whether any memory was returned (always ``False`` where the C library is not glibc).
    """
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
