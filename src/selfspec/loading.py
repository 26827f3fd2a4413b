"""Loading models: name resolution, safe checkpoints, dtype/device, bitsandbytes quantization."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .adapter import check_architecture
from .errors import ConfigurationError, ModelNotFoundError, QuantizationError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

#: The name of the small model bundled with the package.
DEMO_MODEL = "selfspec-demo"
#: A smaller model bundled as its draft model (same tokenizer, trained without early-exit losses).
DEMO_DRAFT_MODEL = "selfspec-demo-draft"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


def demo_model_path(name: str = DEMO_MODEL) -> Path:
    """The folder of a bundled model (the demo model by default)."""
    return Path(__file__).parent / "models" / name


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> str:
    """Map ``"selfspec-demo"`` (and ``"selfspec-demo-draft"``) to the bundled folder; check local paths."""
    name = os.fspath(name_or_path)
    if not name or not isinstance(name, str):
        raise ModelNotFoundError("model name must be a non-empty string (a hub id or a folder)")
    if name in (DEMO_MODEL, DEMO_DRAFT_MODEL):
        path = demo_model_path(name)
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"the bundled demo model is missing from {path}; reinstall selfspec")
        return str(path)
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    # a hub id is "name" or "org/name"; anything else that does not exist is a missing folder
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local or path.exists():
        raise ModelNotFoundError(
            f"no model folder at {name!r}: the path does not exist or is not a folder. Pass an "
            f"existing folder with config.json and *.safetensors, a hub id, or {DEMO_MODEL!r}."
        )
    return name


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from exc


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config: Any) -> torch.dtype:
    """``"auto"``: float32 on CPU (half precision is slow there), the checkpoint's dtype on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = _DTYPES.get(saved)
        if saved in (torch.float16, torch.bfloat16):
            return saved
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigurationError(f"unknown dtype {dtype!r}: use 'auto', {', '.join(sorted(_DTYPES))}")


def load_config(path_or_id: str, *, trust_remote_code: bool) -> Any:
    """Load a model config, turning hub and remote-code failures into clear errors."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code)
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: only locally cached models can load)" if offline else ""
        raise ModelNotFoundError(
            f"could not load model {path_or_id!r}: it is not a local folder with config.json, "
            f"and the hub has no such model or cannot be reached{hint}. Check the name, or pass "
            f"a local folder, or {DEMO_MODEL!r}."
        ) from exc
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise UnsafeCheckpointError(
                f"model {path_or_id!r} needs its own Python code from the hub; selfspec refuses "
                "to run remote code unless you pass trust_remote_code=True"
            ) from exc
        raise
    return config


def check_weights(path: str, *, allow_pickle: bool) -> bool:
    """For a local folder, check it holds safetensors weights; return whether pickle is used."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    if any(folder.glob("*.safetensors")):
        return False
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        if allow_pickle:
            return True
        raise UnsafeCheckpointError(
            f"{path} holds only pickle weights (*.bin); they can run arbitrary code when loaded. "
            "Convert them to safetensors, or pass allow_pickle=True if you trust the files."
        )
    raise ModelNotFoundError(f"{path} has a config.json but no weights (*.safetensors)")


def _quantized_out_features(config: Any) -> list[tuple[str, int]]:
    """Output sizes of the linear layers bitsandbytes would quantize (all but the LM head)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    return [
        (name, module.out_features)
        for name, module in skeleton.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    ]


def quantization_config(quantization: str | None, config: Any, device: torch.device, compute_dtype: torch.dtype) -> Any:
    """A ``BitsAndBytesConfig`` for ``"4bit"`` (NF4) or ``"8bit"``, after checking it can run."""
    if quantization is None:
        return None
    if quantization not in ("4bit", "8bit"):
        raise ConfigurationError(f"quantization must be None, '4bit' or '8bit', got {quantization!r}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise QuantizationError(f"{quantization} quantization needs bitsandbytes: pip install 'bitsandbytes>=0.45'")
    if device.type not in ("cpu", "cuda"):
        raise QuantizationError(
            f"no bitsandbytes backend for device {device.type!r}; use 'cpu' or 'cuda', or no quantization"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes  # noqa: F401
    except Exception as exc:
        raise QuantizationError(f"bitsandbytes is installed but cannot load: {exc}") from exc
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if device.type == "cpu":
        bad = [(n, f) for n, f in _quantized_out_features(config) if f % 32]
        if bad:
            name, size = bad[0]
            raise QuantizationError(
                f"4-bit on CPU needs every quantized linear layer's output size to be a multiple "
                f"of 32, but {name} has {size} ({len(bad)} layers affected). Use quantization="
                "'8bit', no quantization, or a GPU."
            )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=False,
    )


def silence_bitsandbytes_warnings() -> None:
    """Bitsandbytes' 8-bit matmul logs a dtype-cast warning on every call on CPU."""
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike[str],
    *,
    quantization: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> tuple[Any, Any, str]:
    """Load a supported causal LM and its tokenizer.

    Returns:
        ``(model, tokenizer, resolved path or hub id)``; the tokenizer is ``None`` when the
        checkpoint has none.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    config = load_config(path, trust_remote_code=trust_remote_code)
    check_architecture(config)
    uses_pickle = check_weights(path, allow_pickle=allow_pickle)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, config)
    quant = quantization_config(quantization, config, torch_device, torch_dtype)
    if quantization == "8bit":
        silence_bitsandbytes_warnings()
    attn = "eager" if config.model_type == "gemma2" else "sdpa"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            device_map={"": str(torch_device)},
            quantization_config=quant,
            use_safetensors=not uses_pickle,
            trust_remote_code=trust_remote_code,
            attn_implementation=attn,
        )
    except OSError as exc:
        raise ModelNotFoundError(f"could not load the weights of {path!r}: {exc}") from exc
    model.eval()
    tokenizer = _load_tokenizer(path, trust_remote_code=trust_remote_code)
    if quant is not None:
        _smoke_test(model, quantization or "")
    return model, tokenizer, path


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str, *, trust_remote_code: bool) -> Any:
    """The checkpoint's tokenizer, or ``None`` (token-level use only) when it has none."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        logger.info("%s has no tokenizer files; token-level use only", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        logger.warning("could not load the tokenizer of %s (%s); token-level use only", path, exc)
        return None


def _smoke_test(model: Any, quantization: str) -> None:
    """Run one token through a quantized model so a missing kernel fails here, clearly."""
    try:
        with torch.inference_mode():
            ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
            model(input_ids=ids)
    except Exception as exc:
        raise QuantizationError(f"{quantization} model loaded, but bitsandbytes could not run it here: {exc}") from exc
