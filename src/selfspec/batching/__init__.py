"""Batched speculation: concurrent generations share rounds (:mod:`.scheduler`)."""

from ..modeling.cache import BatchedKVCache
from .scheduler import DEFAULT_MAX_BATCH_SIZE, BatchScheduler, rope_depends_on_batch

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "BatchScheduler", "BatchedKVCache", "rope_depends_on_batch"]
