"""LangChain integration of selfspec: lossless self-speculative decoding of Hugging Face causal LMs."""

from importlib.metadata import PackageNotFoundError, version

from langchain_selfspec.chat_models import ChatSpeculative

try:
    __version__ = version("langchain-selfspec")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["ChatSpeculative", "__version__"]
