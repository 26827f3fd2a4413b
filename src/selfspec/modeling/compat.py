"""What differs between the transformers versions selfspec drives layer by layer.

transformers renamed the cache keyword of its decoder layers and models: ``past_key_values``
up to 5.19, ``cache`` from 5.20 (``past_key_values`` then stays a deprecated alias for a while).
Passed by the name an installed layer does not know, the cache falls into ``**kwargs`` and is
silently ignored: the text changes with no error (measured with the 5.17 wheel). So the keyword
is read from the installed layer's own signature, once per layer class.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..errors import UnsupportedArchitectureError

#: the cache keywords transformers' decoder layers have used, newest first.
CACHE_KEYWORDS = ("cache", "past_key_values")


@functools.cache
def _cache_keyword_of(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in parameters:
            return name
    raise UnsupportedArchitectureError(
        f"{getattr(forward, '__qualname__', forward)!r} takes none of the cache keywords "
        f"{', '.join(CACHE_KEYWORDS)}: this transformers version's decoder layers are not supported"
    )


def cache_keyword(module: Any) -> str:
    """The keyword ``module.forward`` (a decoder layer or model) takes its KV cache by.

    Raises:
        UnsupportedArchitectureError: the signature names neither ``cache`` nor ``past_key_values``.
    """
    return _cache_keyword_of(type(module).forward)


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for calling ``module`` with its KV cache, whatever the transformers version."""
    return {cache_keyword(module): cache}
