"""Errors raised by selfspec.

Every error says what went wrong and how to fix it. All input errors are ``ValueError``
subclasses, and a model that cannot be found is an ``OSError``, so callers can catch the
standard types.
"""

from __future__ import annotations

import re

#: The longest error text passed on to a client (native libraries' own can hold multi-line dumps).
MAX_ERROR_CHARS = 300
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+-]+){2,}")
_NOISE = ("panicked at", "stack backtrace", "note:", "<state>", "at /", "thread '")


def one_line(message: str) -> str:
    """An error text as one clean line: no parser dump, backtrace or file path, at most 300 characters.

    Native libraries (llguidance's Rust panics, its parser-state dumps) write many lines, with
    the build machine's paths; a client gets the first line that says what went wrong.
    """
    lines = [line.strip() for line in str(message).splitlines()]
    kept = [line for line in lines if line and not line.startswith(_NOISE) and not line[:1].isdigit()]
    first = kept[0] if kept else "the library failed"
    first = _PATH.sub("<path>", first)
    return first if len(first) <= MAX_ERROR_CHARS else first[: MAX_ERROR_CHARS - 3] + "..."


class SelfSpecError(Exception):
    """Base class of every selfspec-specific error."""


class ConfigurationError(SelfSpecError, ValueError):
    """An engine argument (exit layer, draft length, drafter, dtype, ...) is invalid."""


class UnsupportedArchitectureError(SelfSpecError, ValueError):
    """The model's architecture has no model adapter."""


class InvalidPromptError(SelfSpecError, ValueError):
    """The prompt is empty, malformed, or does not fit in the context window."""


class SamplingError(SelfSpecError, ValueError):
    """A sampling argument (temperature, top-k, top-p, max_new_tokens, stop) is invalid."""


class InvalidSchemaError(SelfSpecError, ValueError):
    """A JSON schema or tools (structured output, tool parameters) are invalid, too large, or admit no value.

    Raised before decoding where it can be seen up front, else when the grammar cannot follow.
    """


class QuantizationError(SelfSpecError, ValueError):
    """The requested quantization cannot run here (no bitsandbytes backend, or layer sizes)."""


class ModelNotFoundError(SelfSpecError, OSError):
    """The model name is neither a local folder nor a reachable hub repository."""


class ModelConfigError(SelfSpecError, ValueError):
    """A model's config holds a value it cannot run with (out of bounds, the wrong type, or not its weights').

    Raised before any module is built. ``file`` is the config (or GGUF) file, ``field`` and
    ``value`` the offending entry, ``valid`` what would be valid.
    """

    def __init__(self, file: str, field: str, value: object, valid: str) -> None:
        """Name the file, the field, its value and what would be valid, in one line."""
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"{file}: {field}={shown} is invalid; it must be {valid}")
        self.file, self.field, self.value, self.valid = file, field, value, valid


class CorruptCheckpointError(SelfSpecError, OSError):
    """A checkpoint file exists but cannot be read (truncated, corrupt); the message names the file."""


class ArtifactWriteError(SelfSpecError, OSError):
    """An artifact could not be saved (a read-only folder, a full disk); the message names the file.

    Nothing is written in place, so the previous file (if any) is still there, whole; ``errno`` is
    the cause's (``errno.EROFS``, ``errno.ENOSPC``, ...) and ``filename`` the file that was saved.
    """

    def __str__(self) -> str:
        """``[Errno 28] could not save <file>: ...``: the message names the file once."""
        return f"[Errno {self.errno}] {self.strerror}" if self.errno is not None else super().__str__()


class UnsafeCachePathError(SelfSpecError, OSError):
    """A path inside the user cache leads out of it through a symbolic link; nothing is written there."""


class UnsafeCheckpointError(SelfSpecError, ValueError):
    """The checkpoint would need pickle (``.bin``) or remote code, which is refused by default."""


class GenerationMemoryError(SelfSpecError, MemoryError):
    """A generation ran out of memory (GPU or host); its cache is freed and the engine stays usable."""


class MissingDependencyError(SelfSpecError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""
