"""selfspec: lossless self-speculative decoding for Hugging Face causal LMs.

A model drafts tokens with its own early layers and verifies them with all of them in one
forward pass; the text is exactly what the model alone would write, sooner.
"""

from importlib.metadata import PackageNotFoundError, version

from .constraints import TokenConstraint
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
from .engine import SpeculativeEngine
from .errors import (
    ConfigurationError,
    GenerationMemoryError,
    InvalidPromptError,
    ModelNotFoundError,
    QuantizationError,
    SamplingError,
    SelfSpecError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from .generation import GenerationRequest, GenerationStream
from .loading import DEMO_MODEL, demo_model_path
from .modeling import SUPPORTED_ARCHITECTURES, ModelAdapter, ModelRunner
from .outputs import GenerationOutput, GenerationStats
from .registry import clear_engines, get_engine

try:
    __version__ = version("selfspec")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "DEMO_MODEL",
    "SUPPORTED_ARCHITECTURES",
    "ConfigurationError",
    "DecodeState",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "EarlyExitDrafter",
    "GenerationMemoryError",
    "GenerationOutput",
    "GenerationRequest",
    "GenerationStats",
    "GenerationStream",
    "HybridDrafter",
    "InvalidPromptError",
    "MedusaDrafter",
    "MedusaHeads",
    "ModelAdapter",
    "ModelNotFoundError",
    "ModelRunner",
    "NoDrafter",
    "PromptLookupDrafter",
    "QuantizationError",
    "SamplingError",
    "SelfSpecError",
    "SpeculativeEngine",
    "TokenConstraint",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "__version__",
    "clear_engines",
    "demo_model_path",
    "get_engine",
    "list_drafters",
    "register_drafter",
]
