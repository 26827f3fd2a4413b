"""The model side: run the target's layers for ``[rows, positions]`` over a KV cache.

:mod:`.runner` is the architecture adapter (:class:`ModelRunner`: embed, layers, norm, head,
masks, rotary), :mod:`.fastpath` the lean layer path it uses where it applies, and
:mod:`.cache` the caches. Loading checkpoints stays in :mod:`selfspec.modeling.loading`.
"""

from .cache import BatchedKVCache, KVCache, StaticKVCache
from .fastpath import fast_path_default
from .runner import SUPPORTED_ARCHITECTURES, ModelRunner, check_architecture

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "BatchedKVCache",
    "KVCache",
    "ModelRunner",
    "StaticKVCache",
    "check_architecture",
    "fast_path_default",
]
