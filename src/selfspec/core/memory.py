"""Freed memory handed back to the system (glibc's ``malloc_trim``), for the threads that free a lot.

glibc keeps the memory a process frees for its later allocations, and in a long-running process
whose threads allocate and free large tensors (a server's workers, the online learner's training
steps) little of it goes back on its own: resident memory keeps the high-water mark of every
malloc arena. :func:`release_free_memory` returns the free pages of every arena at once. Elsewhere
(musl, macOS, Windows) it does nothing and says so (``False``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

__all__ = ["glibc", "release_free_memory"]


@cache
def glibc() -> ctypes.CDLL | None:
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


def release_free_memory() -> bool:
    """Return the free memory of every malloc arena to the system (``malloc_trim(0)``).

    Returns:
        Whether any memory was returned (always ``False`` where the C library is not glibc).
    """
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
