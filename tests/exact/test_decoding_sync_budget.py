"""The round reads the device once: plain decoding and prompt lookup (issue 26).

Each host read (``.item()``, ``bool(tensor)``, ``.tolist()``, and a blocking host-to-device copy
``torch.tensor(list, device=...)``) drains a GPU's queue, so host and device time add instead of
overlapping. Counted on CPU with a ``TorchDispatchMode`` (``aten.item``, ``aten.is_nonzero``,
``aten._local_scalar_dense``) and the two Python entry points patched. Greedy plain decoding and
prompt lookup make one read per round (the accepted count and the next token together), plus two
per call (the prefill's first token, the sampling seed). The aten ops per round are bounded too, a
proxy for kernel launches on a GPU (measured: 56 a layer and 34 a forward on the fp32 fast path).
The CPU-only exact-argmax head (:mod:`selfspec.modeling.argmax_head`) is turned off here: it never
runs on a GPU, and a CPU has no queue to drain.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from read_counter import Counter, counting
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine

PER_CALL = 2  # the prefill's first token; the seed of the call's generator
#: The ops budget (fp32 fast path, a tiny Llama): measured 56 aten ops a layer and 34 a forward, plus 10%.
OPS_PER_LAYER, OPS_PER_FORWARD = 62, 38


def count(
    engine: SpeculativeEngine, prompt: list[int], monkeypatch: pytest.MonkeyPatch, **keywords: Any
) -> tuple[Any, Counter]:
    """A 40-token call and its host reads and aten ops."""
    with counting(monkeypatch) as counter:
        out = engine.generate_ids(prompt, max_new_tokens=40, **keywords)
    return out, counter


@pytest.mark.parametrize("drafter", ["none", "prompt_lookup"])
def test_one_host_read_per_round(drafter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    engine = SpeculativeEngine(model, None, drafter=drafter, num_draft_tokens=4, calibration={})
    # what a GPU round reads: the exact-argmax head runs on CPUs only, where a read drains no queue
    engine.runner.argmax_screen = False
    prompt = list(range(10, 30)) * 2  # repeated text: lookup drafts land
    engine.generate_ids(prompt, max_new_tokens=8)  # warm up
    out, counter = count(engine, prompt, monkeypatch)
    assert out.token_ids == reference_greedy(model, prompt, 40)
    rounds = out.stats.target_forwards - 1  # the prefill is not a round
    assert drafter == "none" or out.stats.num_accepted > 0
    assert counter.reads <= rounds + PER_CALL, (counter.reads, rounds)
    layers = model.config.num_hidden_layers
    ops_per_forward = counter.ops / out.stats.target_forwards  # measured: 56 a layer + 34 (6 layers: 371; 12: 707)
    assert ops_per_forward <= OPS_PER_LAYER * layers + OPS_PER_FORWARD, ops_per_forward
