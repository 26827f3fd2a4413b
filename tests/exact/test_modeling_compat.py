"""The cache keyword follows the installed transformers' decoder layer signature.

transformers 5.17 (the GPU machine's) layers take ``past_key_values=``; 5.20+ take ``cache=``.
A stub with 5.17's signature (wrapping a real layer, ignoring unknown keywords as ``**kwargs``
does) shows that the module path and the EAGLE head pass the cache by the name the layer takes:
passed by the other name, the cache would be dropped and the text would change silently.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import make_model, reference_greedy
from torch import nn

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import EagleHead
from selfspec.errors import UnsupportedArchitectureError
from selfspec.modeling.compat import cache_keyword


class Layer517(nn.Module):
    """A decoder layer with transformers 5.17's signature: ``past_key_values=``, no ``cache=``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.inner = layer
        self.calls_with_cache = 0

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = False,
        cache_position: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,  # an unknown `cache=` lands here and is ignored, as in 5.17
    ) -> torch.Tensor:
        self.calls_with_cache += past_key_values is not None
        return self.inner(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
        )


class NoCacheLayer(nn.Module):
    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return hidden_states


PROMPT = [5, 9, 3, 17, 4, 8, 21, 30]


def test_module_path_passes_the_cache_by_the_5_17_name() -> None:
    model = make_model("llama")
    reference = reference_greedy(model, PROMPT, 16)
    model.model.layers = nn.ModuleList(Layer517(layer) for layer in model.model.layers)
    assert cache_keyword(model.model.layers[0]) == "past_key_values"
    for drafter in ("none", "early_exit"):
        engine = SpeculativeEngine(model, drafter=drafter, exit_layer=2, num_draft_tokens=3, fast_path=False)
        assert engine.runner.fast_layers is None
        assert engine.generate_ids(PROMPT, max_new_tokens=16).token_ids == reference
    assert all(layer.calls_with_cache > 0 for layer in model.model.layers)


def test_eagle_head_passes_its_cache_by_the_layer_s_name() -> None:
    model = make_model("llama")
    reference = reference_greedy(model, PROMPT, 16)
    torch.manual_seed(0)
    head = EagleHead(model)
    head.layer = Layer517(head.layer)
    engine = SpeculativeEngine(model, drafter="eagle", eagle_head=head, num_draft_tokens=3, calibration={})
    out = engine.generate_ids(PROMPT, max_new_tokens=16)
    assert out.token_ids == reference and out.stats.num_drafted > 0
    assert head.layer.calls_with_cache > 0  # the head's own KV cache reached its layer


def test_current_layers_take_cache_and_unknown_layouts_are_refused() -> None:
    model = make_model("llama")
    assert cache_keyword(model.model.layers[0]) == "cache"
    with pytest.raises(UnsupportedArchitectureError, match="cache keywords"):
        cache_keyword(NoCacheLayer())
