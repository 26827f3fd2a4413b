"""q/k/v and gate/up read as one weight each (issue 40 item 5), on this CPU.

A runner fuses them on CUDA by default; ``ModelRunner(model, fuse=True)`` (or ``runner.fuse()``)
does it anywhere, so the CPU checks what the GPU relies on: the modules' weights become views of
the fused weight (nothing is held twice, transformers' forward reads the same values), the lean
path's logits stay bit-identical to the modules', the static round's greedy text stays
``generate``'s, and a shape whose fused GEMM would give a column other bits stays apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import lean_and_module_logits, make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.modeling.fastpath import FUSION_PROBE_WIDTHS, fusion_keeps_bits
from selfspec.modeling.runner import ModelRunner

IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])


def parameter_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_fused_weights_are_views_and_the_logits_keep_their_bits(arch: str) -> None:
    model = make_model(arch, dtype=torch.float32)
    before = parameter_bytes(model)
    unfused = lean_and_module_logits(ModelRunner(model), IDS)[0]
    runner = ModelRunner(model, fuse=True)
    assert runner.fused_projections == 2 * len(model.model.layers), runner
    assert "fused_projections=12" in repr(runner)
    for layer, w in zip(model.model.layers, runner.fast_layers, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        (qkv, _), (gate_up, _) = w.qkv[0], w.gate_up[0]
        assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        for module in (attn.q_proj, attn.k_proj, attn.v_proj):  # views of the fused weight
            assert module.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == gate_up.untyped_storage().data_ptr()
    assert parameter_bytes(model) == before  # nothing held twice
    (lean_prefill, lean_step), (module_prefill, module_step) = lean_and_module_logits(runner, IDS)
    assert torch.equal(lean_prefill, module_prefill) and torch.equal(lean_step, module_step)
    assert torch.equal(lean_prefill, unfused[0]) and torch.equal(lean_step, unfused[1])
    again = ModelRunner(model, fuse=True)  # a second runner reads the same fused tensors, copies nothing
    assert again.fast_layers[0].qkv[0][0].data_ptr() == runner.fast_layers[0].qkv[0][0].data_ptr()
    assert parameter_bytes(model) == before


def test_a_model_with_fused_layers_already_is_left_as_it_is() -> None:
    model = make_model("phi3", dtype=torch.float32)  # qkv_proj and gate_up_proj are one weight each
    runner = ModelRunner(model, fuse=True)
    assert runner.fused_projections == 0


def test_the_cpu_does_not_fuse_unless_asked() -> None:
    model = make_model("llama", dtype=torch.float32)
    runner = ModelRunner(model)
    assert runner.fused_projections == 0 and all(len(w.qkv) == 3 for w in runner.fast_layers)


@pytest.mark.parametrize("drafter", ["early_exit", "prompt_lookup"])
def test_fused_static_round_greedy_equals_generate(drafter: str) -> None:
    model = make_model("llama", dtype=torch.float32)
    prompt = list(range(10, 30)) * 2
    expected = reference_greedy(model, prompt, 30)
    engine = SpeculativeEngine(
        model, None, drafter=drafter, compile="eager", num_draft_tokens=4, exit_layer=2, calibration={}
    )
    assert engine.runner.fuse() == 12
    out = engine.generate_ids(prompt, max_new_tokens=30)
    assert out.token_ids == expected
    assert out.stats.num_accepted > 0
    assert engine.static_round is not None and engine.static_round.step.compiled


def direct_verdict(dtype: torch.dtype, shapes: list[tuple[int, int]]) -> bool:
    """The fused call against the separate ones, computed here on the probe's cancelling data."""
    generator = torch.Generator().manual_seed(1)
    in_features = shapes[0][1]
    half = in_features // 2
    weights = []
    for out_features, _ in shapes:
        u = torch.randn(out_features, half, generator=generator)
        weight = torch.zeros(out_features, in_features, dtype=dtype)
        weight[:, :half], weight[:, half : 2 * half] = u, -u
        weights.append(weight)
    a = torch.randn(max(FUSION_PROBE_WIDTHS), half, generator=generator)
    rows = torch.zeros(len(a), in_features, dtype=dtype)
    rows[:, :half], rows[:, half : 2 * half] = a, a
    fused = torch.cat(weights)
    return all(
        torch.equal(F.linear(rows[:width], fused), torch.cat([F.linear(rows[:width], w) for w in weights], dim=-1))
        for width in FUSION_PROBE_WIDTHS
    )


SHAPES = [
    (torch.float32, [(64, 64), (16, 64), (16, 64)]),
    (torch.float32, [(1, 2048), (4095, 2048)]),
    (torch.bfloat16, [(64, 64), (8, 64)]),
    (torch.bfloat16, [(576, 576), (192, 576), (192, 576)]),
    (torch.float64, [(576, 576), (192, 576), (192, 576)]),
]


@pytest.mark.parametrize(("dtype", "shapes"), SHAPES, ids=lambda v: str(v))
def test_the_fusion_probe_agrees_with_the_fused_call(dtype, shapes) -> None:
    """Where the library gives a column other bits in a wider call, the probe says so (and the reverse)."""
    weights = [torch.zeros(*shape, dtype=dtype) for shape in shapes]
    assert fusion_keeps_bits(weights, [None] * len(weights)) == direct_verdict(dtype, shapes)


def test_a_shape_whose_fused_call_changes_bits_stays_apart() -> None:
    refused = [(dtype, shapes) for dtype, shapes in SHAPES if not direct_verdict(dtype, shapes)]
    if not refused:
        pytest.skip("every probed shape kept its bits in a fused call on this BLAS")
    dtype, shapes = refused[0]
    assert not fusion_keeps_bits([torch.zeros(*s, dtype=dtype) for s in shapes], [None] * len(shapes))
    # a model of such a shape: float64 at SmolLM2's attention width (576 = 9 heads of 64, 3 KV heads)
    model = make_model(
        "llama",
        dtype=torch.float64,
        hidden_size=576,
        intermediate_size=64,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=2,
    )
    keeps_qkv = fusion_keeps_bits(
        [torch.zeros(576, 576, dtype=torch.float64), *[torch.zeros(192, 576, dtype=torch.float64)] * 2], [None] * 3
    )
    runner = ModelRunner(model, fuse=True)
    assert all((len(w.qkv) == 1) == keeps_qkv for w in runner.fast_layers)
    if not keeps_qkv:
        q = model.model.layers[0].self_attn.q_proj.weight
        assert q.untyped_storage().nbytes() == q.numel() * q.element_size()  # left alone, not a view
