"""selfspec: lossless self-speculative decoding for Hugging Face causal LMs.

A model drafts tokens with its own early layers and verifies them with all of them in one
forward pass; the text is exactly what the model alone would write, sooner.

The public names are imported on first use (PEP 562): ``import selfspec`` does not import
torch or transformers, so that the LangChain and LlamaIndex adapters import fast; the first
``selfspec.SpeculativeEngine`` (or any other name) imports its module.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core.constraints import TokenConstraint
    from .decoding.engine import SpeculativeEngine
    from .decoding.generation import GenerationRequest, GenerationStream
    from .decoding.options import EngineOptions, GenerateOptions
    from .decoding.outputs import GenerationOutput, GenerationStats
    from .drafting import (
        DecodeState,
        Draft,
        Drafter,
        DraftModelDrafter,
        EarlyExitDrafter,
        HybridDrafter,
        MedusaDrafter,
        MedusaHeads,
        NoDrafter,
        PromptLookupDrafter,
        list_drafters,
        register_drafter,
    )
    from .errors import (
        ArtifactWriteError,
        ConfigurationError,
        CorruptCheckpointError,
        GenerationMemoryError,
        InvalidPromptError,
        InvalidSchemaError,
        ModelConfigError,
        ModelNotFoundError,
        QuantizationError,
        SamplingError,
        SelfSpecError,
        UnsafeCachePathError,
        UnsafeCheckpointError,
        UnsupportedArchitectureError,
    )
    from .modeling import SUPPORTED_ARCHITECTURES, ModelRunner
    from .modeling.loading import DEMO_MODEL, demo_model_path
    from .serving.engines import clear_engines, get_engine

try:
    __version__ = version("selfspec")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

#: Where each public name lives (imported by :func:`__getattr__` on first use).
_LAZY: dict[str, str] = {
    "TokenConstraint": ".core.constraints",
    "DecodeState": ".drafting",
    "Draft": ".drafting",
    "Drafter": ".drafting",
    "DraftModelDrafter": ".drafting",
    "EarlyExitDrafter": ".drafting",
    "HybridDrafter": ".drafting",
    "MedusaDrafter": ".drafting",
    "MedusaHeads": ".drafting",
    "NoDrafter": ".drafting",
    "PromptLookupDrafter": ".drafting",
    "list_drafters": ".drafting",
    "register_drafter": ".drafting",
    "SpeculativeEngine": ".decoding.engine",
    "ArtifactWriteError": ".errors",
    "ConfigurationError": ".errors",
    "CorruptCheckpointError": ".errors",
    "GenerationMemoryError": ".errors",
    "InvalidPromptError": ".errors",
    "InvalidSchemaError": ".errors",
    "ModelConfigError": ".errors",
    "ModelNotFoundError": ".errors",
    "QuantizationError": ".errors",
    "SamplingError": ".errors",
    "SelfSpecError": ".errors",
    "UnsafeCachePathError": ".errors",
    "UnsafeCheckpointError": ".errors",
    "UnsupportedArchitectureError": ".errors",
    "GenerationRequest": ".decoding.generation",
    "EngineOptions": ".decoding.options",
    "GenerateOptions": ".decoding.options",
    "GenerationStream": ".decoding.generation",
    "DEMO_MODEL": ".modeling.loading",
    "demo_model_path": ".modeling.loading",
    "SUPPORTED_ARCHITECTURES": ".modeling",
    "ModelRunner": ".modeling",
    "GenerationOutput": ".decoding.outputs",
    "GenerationStats": ".decoding.outputs",
    "clear_engines": ".serving.engines",
    "get_engine": ".serving.engines",
}

__all__ = [
    "DEMO_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "ArtifactWriteError",
    "ConfigurationError",
    "CorruptCheckpointError",
    "DecodeState",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "EngineOptions",
    "GenerateOptions",
    "GenerationMemoryError",
    "GenerationOutput",
    "GenerationRequest",
    "GenerationStats",
    "GenerationStream",
    "HybridDrafter",
    "InvalidPromptError",
    "InvalidSchemaError",
    "MedusaDrafter",
    "MedusaHeads",
    "ModelConfigError",
    "ModelNotFoundError",
    "ModelRunner",
    "NoDrafter",
    "PromptLookupDrafter",
    "QuantizationError",
    "SamplingError",
    "SelfSpecError",
    "SpeculativeEngine",
    "TokenConstraint",
    "UnsafeCachePathError",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "__version__",
    "clear_engines",
    "demo_model_path",
    "get_engine",
    "list_drafters",
    "register_drafter",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:  # a submodule (``selfspec.decoding.engine``), as when this file imported them all
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
