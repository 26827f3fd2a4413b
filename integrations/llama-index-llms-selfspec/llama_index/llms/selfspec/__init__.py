"""LlamaIndex integration for selfspec: ``SpeculativeLLM``, lossless self-speculative decoding."""

from importlib.metadata import PackageNotFoundError, version

from llama_index.llms.selfspec.base import SpeculativeLLM

try:
    __version__ = version("llama-index-llms-selfspec")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["SpeculativeLLM", "__version__"]
