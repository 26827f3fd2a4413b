"""Checking a model config against sane bounds and its weights, before any module is built.

transformers trusts ``config.json``: ``num_hidden_layers: 1000000`` builds a million layers before
anything compares the config with the weights (the process grows without end),
``num_attention_heads: 0`` divides by zero, and ``num_hidden_layers: 0`` loads and prints garbage.
:func:`check_config_values` checks the sizes' types and bounds (:data:`CONFIG_BOUNDS`), on the raw
``config.json`` before transformers reads it and on the resolved config after;
:func:`check_config_weights` compares the layer count, vocabulary and sizes with the tensor shapes
in the safetensors headers (:func:`read_safetensors_header` reads the header only, never tensor
data). Each failure is a :class:`~selfspec.errors.ModelConfigError` naming the file, the field, its
value and what would be valid.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, ModelConfigError


@dataclass(frozen=True)
class Bound:
    """The valid range of one integer config field (both ends included)."""

    low: int
    high: int
    optional: bool = False  # ``None`` is valid (the architecture's default applies)

    def describe(self) -> str:
        """``"an int in [1, 1024]"`` (``" or null"`` when optional)."""
        return f"an int in [{self.low}, {self.high}]" + (" or null" if self.optional else "")


#: The bounds of the size fields every supported architecture's config holds. Far above any real
#: model (Llama 3.1 405B: 126 layers, 128 heads, hidden size 16,384, 53,248 MLP units; Gemma 3: a
#: 262,144-token vocabulary; Llama 4 Scout: a 10M-token context), far below a config bomb.
CONFIG_BOUNDS: dict[str, Bound] = {
    "num_hidden_layers": Bound(1, 1024),
    "num_attention_heads": Bound(1, 1024),
    "num_key_value_heads": Bound(1, 1024, optional=True),
    "hidden_size": Bound(1, 65_536),
    "intermediate_size": Bound(1, 1_048_576),
    "head_dim": Bound(1, 4096, optional=True),
    "vocab_size": Bound(1, 4_194_304),
    "max_position_embeddings": Bound(1, 16_777_216),
    "sliding_window": Bound(1, 16_777_216, optional=True),
}

#: safetensors' own limit on a header (``safetensors`` refuses larger ones).
MAX_HEADER_BYTES = 100_000_000
#: Weight dtypes whose shapes are the logical sizes (packed 4/8-bit weights are not compared).
_PLAIN_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WeightShapes:
    """The tensors of a checkpoint's safetensors files, from their headers alone."""

    files: tuple[Path, ...]
    tensors: dict[str, TensorInfo]

    @property
    def shown(self) -> str:
        """The weight files' names, for a message (``"model.safetensors"``)."""
        names = [f.name for f in self.files]
        return names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} shards)"

    def layer_indices(self) -> list[int]:
        """The decoder layer indices that hold tensors (``model.layers.<i>.``), sorted."""
        return sorted({int(m.group(1)) for key in self.tensors if (m := _LAYER_KEY.search(key))})

    def find(self, suffix: str) -> TensorInfo | None:
        """The tensor whose name ends with ``suffix`` (the shortest such name), if any."""
        names = sorted((k for k in self.tensors if k == suffix or k.endswith("." + suffix)), key=len)
        return self.tensors[names[0]] if names else None


def config_file(path_or_id: str, gguf_file: str | None = None) -> str:
    """How a message names a config: the local ``config.json``, the GGUF file, or ``<hub id>/config.json``."""
    if gguf_file is not None:
        return str(Path(path_or_id) / gguf_file)
    return str(Path(path_or_id) / "config.json")


def check_config_values(values: Mapping[str, Any], file: str) -> None:
    """Check the size fields of a config (a raw ``config.json`` or a resolved config's values).

    Fields absent from ``values`` are not checked (the architecture's default applies; the
    resolved config is checked again after transformers fills them in).

    Raises:
        ModelConfigError: a field is not an int (``True``, ``16.0`` and ``"16"`` are not), is out of
            :data:`CONFIG_BOUNDS`, or the sizes disagree (``hidden_size`` not divisible by
            ``num_attention_heads`` when there is no ``head_dim``; ``num_attention_heads`` not a
            multiple of ``num_key_value_heads``).
    """
    for field, bound in CONFIG_BOUNDS.items():
        if field in values:
            _check_bound(field, values[field], bound, file)
    heads = values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads")
    hidden = values.get("hidden_size")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelConfigError(
            file, "num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads}) for grouped attention"
        )
    if values.get("head_dim") is None and heads is not None and hidden is not None and hidden % heads:
        raise ModelConfigError(
            file,
            "hidden_size",
            hidden,
            f"a multiple of num_attention_heads ({heads}) when the config gives no head_dim",
        )


def _check_bound(field: str, value: Any, bound: Bound, file: str) -> None:
    """Raise :class:`ModelConfigError` unless ``value`` is an int within ``bound`` (or an allowed ``None``)."""
    if value is None and bound.optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not bound.low <= value <= bound.high:
        raise ModelConfigError(file, field, value, bound.describe())


def resolved_values(config: Any) -> dict[str, Any]:
    """The size fields of a transformers config object (those it has), for :func:`check_config_values`."""
    return {field: getattr(config, field) for field in CONFIG_BOUNDS if hasattr(config, field)}


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of a safetensors file, read from its header (no tensor data is read).

    Raises:
        CorruptCheckpointError: the file is shorter than its header says, or the header is not the
            JSON table safetensors writes; the message names the file.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"its header length ({length}) does not fit a {size}-byte file")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        return {
            name: TensorInfo(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is not a readable safetensors file: it is truncated or corrupt ({exc}); download it again"
        ) from None


def read_weight_shapes(folder: Path) -> WeightShapes | None:
    """The tensors of the weights transformers would load from ``folder`` (``None`` when it has none).

    That is ``model.safetensors``, or the shards ``model.safetensors.index.json`` names.

    Raises:
        CorruptCheckpointError: a weight file or the shard index cannot be read.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = tuple(folder / name for name in sorted(set(weight_map.values())))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{index} is not a readable shard index ({exc}); download it again") from None
    elif (folder / "model.safetensors").is_file():
        files = (folder / "model.safetensors",)
    else:
        return None
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        if file.is_file():  # a missing shard is transformers' own clear error
            tensors.update(read_safetensors_header(file))
    return WeightShapes(files, tensors)


def check_config_weights(config: Any, weights: WeightShapes, file: str) -> None:
    """Compare a resolved config with its weights' shapes: layers, vocabulary, hidden size, heads.

    Packed (quantized) weights are only counted, not measured.

    Raises:
        ModelConfigError: the config disagrees with the weights; the message says what the weights hold.
    """
    layers = weights.layer_indices()
    if layers and config.num_hidden_layers != len(layers):
        held = f"{len(layers)}: {weights.shown} holds {len(layers)} layers"
        raise ModelConfigError(file, "num_hidden_layers", config.num_hidden_layers, held)
    embed = weights.find("embed_tokens.weight")
    if embed is None or embed.dtype not in _PLAIN_DTYPES or len(embed.shape) != 2:
        return
    vocab, hidden = embed.shape
    where = f"{weights.shown}'s embedding is [{vocab}, {hidden}]"
    if config.vocab_size != vocab:
        raise ModelConfigError(file, "vocab_size", config.vocab_size, f"{vocab}: {where}")
    if config.hidden_size != hidden:
        raise ModelConfigError(file, "hidden_size", config.hidden_size, f"{hidden}: {where}")
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    for proj, field in (("q_proj", "num_attention_heads"), ("k_proj", "num_key_value_heads")):
        tensor = weights.find(f"layers.{layers[0] if layers else 0}.self_attn.{proj}.weight")
        heads = getattr(config, field, None) or config.num_attention_heads
        if tensor is not None and tensor.dtype in _PLAIN_DTYPES and tensor.shape[0] != heads * head_dim:
            rows = tensor.shape[0]
            fits = f"{rows // head_dim}" if rows % head_dim == 0 else "a head count that fits"
            raise ModelConfigError(
                file, field, heads, f"{fits}: {weights.shown}'s {proj} has {rows} rows of {head_dim}-wide heads"
            )
