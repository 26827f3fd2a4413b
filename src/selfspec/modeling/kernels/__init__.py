"""Row-invariant Triton kernels: one row gets the same bits alone and inside a verify block.

In half precision, cuBLAS and split-KV attention choose their tiling and their reduction split by
the problem's shape, so a verify row of ``k + 1`` does not get the bits its one-token decode gets,
and a speculative text can leave the plain text. These kernels fix every reduction order by
constants and by the row's own data, never by the number of rows (the approach of Thinking Machines'
batch-invariant ops, narrowed to batch 1: one kernel for one row and for ``k + 1`` rows):

- :func:`linear`: ``F.linear``'s contract; a fixed 16-row tile, K in a fixed order, no split-K.
- :func:`chain_attention`: decode and chain verify as one kernel; each query row over exactly its own
  keys, a fixed split size over the keys merged in a fixed order, grouped-query heads natively.
- :func:`use_row_invariant_kernels`: marks a model so that selfspec's runner sends its forwards
  (linear layers, LM head, attention) through the two kernels on any device (a CPU: the interpreter).
- :func:`resolve_row_exact`: what the engine option ``row_exact=`` means on a device and dtype
  (:class:`RowExactness`); on CUDA in half precision, the kernels.

Triton is imported on first use (``pip install 'selfspec[kernels]'``); importing this package never
needs it. On a CPU the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before
their first use (slow: tests at toy sizes), where the tiles are upcast to float32 before each
``tl.dot``. Status: tested under the interpreter only (docs/kernels.md), eager loop and static step; no GPU
has run them yet.
"""

from .attention import ATTENTION_TILES, AttentionTiles, chain_attention
from .linear import LINEAR_TILES, LinearTiles, linear
from .routing import (
    BATCHED,
    KERNELS,
    ROWS,
    RowExactness,
    kernels_refusal,
    resolve_row_exact,
    use_row_invariant_kernels,
    uses_row_invariant_kernels,
)

__all__ = [
    "ATTENTION_TILES",
    "BATCHED",
    "KERNELS",
    "LINEAR_TILES",
    "ROWS",
    "AttentionTiles",
    "LinearTiles",
    "RowExactness",
    "chain_attention",
    "kernels_refusal",
    "linear",
    "resolve_row_exact",
    "use_row_invariant_kernels",
    "uses_row_invariant_kernels",
]
