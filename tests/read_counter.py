"""Counting host reads on CPU (issue 26): each would drain a GPU's queue.

A read is ``aten.item`` / ``aten.is_nonzero`` / ``aten._local_scalar_dense`` (seen by a
``TorchDispatchMode``), ``Tensor.tolist`` or a blocking host-to-device copy
``torch.tensor(..., device=...)`` (the two Python entry points patched). Every ``torch.tensor``
made from Python data is also counted as a *copy* (:attr:`Counter.copies`): on a CPU the device is
the host, so :func:`~selfspec.modeling.transfer.device_ids`, a pinned non-blocking copy on a GPU,
is one too (issue 40: a round's inputs should reach its graph through buffers made once). The mode
also counts every aten op, a proxy for kernel launches. A dispatch mode cannot wrap a compiled call: count a
static round with its steps run eagerly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default}


class Counter(TorchDispatchMode):
    """Counts host reads, copies of Python data to the device (:func:`counting`) and aten ops while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.copies = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        self.reads += func in READS
        return func(*args, **(kwargs or {}))


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Count the host reads and aten ops of the block (``Tensor.tolist`` and ``torch.tensor(device=)`` too)."""
    counter = Counter()
    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def counted_tolist(self: torch.Tensor) -> Any:
        counter.reads += 1
        return tolist(self)

    def counted_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        counter.reads += "device" in kwargs  # a blocking copy to the device
        counter.copies += 1  # Python data to a tensor: a copy to the device on a GPU (device_ids too)
        return tensor(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        patch.setattr(torch, "tensor", counted_tensor)
        with counter:
            yield counter
