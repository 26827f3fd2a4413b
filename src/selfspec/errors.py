"""Errors raised by selfspec.

Every error says what went wrong and how to fix it. All input errors are ``ValueError``
subclasses, and a model that cannot be found is an ``OSError``, so callers can catch the
standard types.
"""

from __future__ import annotations


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


class QuantizationError(SelfSpecError, ValueError):
    """The requested quantization cannot run here (no bitsandbytes backend, or layer sizes)."""


class ModelNotFoundError(SelfSpecError, OSError):
    """The model name is neither a local folder nor a reachable hub repository."""


class UnsafeCheckpointError(SelfSpecError, ValueError):
    """The checkpoint would need pickle (``.bin``) or remote code, which is refused by default."""


class GenerationMemoryError(SelfSpecError, MemoryError):
    """A generation ran out of memory (GPU or host); its cache is freed and the engine stays usable."""


class MissingDependencyError(SelfSpecError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""
