"""Host-to-device copies of token ids that never make the host wait.

``torch.tensor(ids, device="cuda")`` copies from pageable memory and blocks the host until the
copy is done, draining the GPU queue like a read would (a sync). :func:`device_ids` stages the
ids in pinned memory and copies them asynchronously on the current stream, so a round's draft
can be sent while the device is still busy; on a CPU it is the plain tensor. The round's one
host read is the acceptance (:func:`selfspec.core.acceptance.accept_greedy`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_ids(ids: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``ids`` as a ``long`` tensor on ``device``, copied without blocking the host."""
    if device.type == "cpu":
        return torch.tensor(ids, dtype=torch.long)
    staged = torch.tensor(ids, dtype=torch.long).pin_memory()
    return staged.to(device, non_blocking=True)
