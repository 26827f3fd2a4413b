"""Published EAGLE-3 heads (SafeAILab's layout and vLLM's ``speculators`` layout) load and draft exactly.

The test writes head folders itself, shaped for a tiny random target, in both published layouts:

- SafeAILab / SpecForge: ``config.json`` (a Llama config + ``draft_vocab_size``) and weights
  ``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``;
- speculators: ``config.json`` with ``speculators_model_type: "eagle3"``, ``transformer_layer_config``,
  ``speculators_config``, ``draft_vocab_size``, ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_residual``, and weights ``layers.0.*`` instead of ``midlayer.*``.

A reference implementation of the published formula, written here independently of selfspec
(transcribed from the maths of speculators' ``Eagle3FirstLayerMixin`` / SafeAILab's
``LlamaDecoderLayeremb``), reads the target's tapped states with forward pre-hooks:

    g = fc(cat(h_a, h_b, h_c))                       h_i: the state entering target layer i
    n = hidden_norm(g);  r = n if norm_before_residual else g
    h = r + o(attn(q/k/v(cat(input_layernorm(embed(x_{t+1})), n))))   (the head's own rotary)
    out = h + mlp(post_attention_layernorm(h));  logits = lm_head(norm(out));  target id = i + d2t[i]

The loaded head must match it (so a swapped concatenation, a wrong residual, a wrong tap or a
wrong vocabulary map fails); greedy output equals transformers' ``generate`` (chains and trees);
sampling follows the target's distribution (chi-square); bad folders are refused before any
weight is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from test_core_acceptance import PROMPT as DIST_PROMPT
from test_core_acceptance import chi_square_pvalue, exact_distribution, make_distribution_model, sampled_counts
from tiny_models import make_model, reference_greedy

import selfspec.drafting.eagle.files as eagle_files
from selfspec import SpeculativeEngine
from selfspec.core.sampling import SamplingParams
from selfspec.drafting.eagle.eagle3 import Eagle3Head
from selfspec.drafting.eagle.head import HeadCache, find_eagle_head
from selfspec.drafting.eagle.published import load_published_head
from selfspec.errors import ConfigurationError, UnsafeCheckpointError

PROMPT = [5, 9, 3, 17, 4, 8]
LAYERS = [1, 3, 6]  # the tiny target has 6 layers: 6 is its last layer's output (before the final norm)
HEAD_EPS = 0.03
HEAD_ROPE_THETA = 3000.0


@pytest.fixture(scope="module")
def tiny() -> Any:
    return make_model("llama", agreeing=True)


# ----------------------------------------------------------------------------- the published formula
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE, rotate-half layout; ``x`` [..., T, head_dim], ``positions`` [T]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.cat([positions.float()[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def tapped_states(model: Any, ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """``[1, T, len(layers) * H]``: the states entering each named layer (``L``: the last output), by hooks."""
    seen: dict[int, torch.Tensor] = {}
    blocks = model.model.layers

    def before(index: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def after(_module: Any, _args: Any, out: Any) -> None:
        seen[len(blocks)] = out if torch.is_tensor(out) else out[0]

    hooks = [blocks[i].register_forward_pre_hook(before(i), with_kwargs=True) for i in set(layers) if i < len(blocks)]
    hooks.append(blocks[-1].register_forward_hook(after))
    try:
        with torch.no_grad():
            model.model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([seen[i] for i in layers], dim=-1)


def reference_eagle3(
    w: dict[str, torch.Tensor], embeds: torch.Tensor, fused: torch.Tensor, positions: torch.Tensor, nbr: bool
) -> torch.Tensor:
    """EAGLE-3's layer, causal over ``T`` entries: ``embeds``, ``fused`` [1, T, H] -> pre-norm outputs [1, T, H]."""
    p = "layers.0."
    heads, kv_heads = 4, 2
    batch, length, hidden = fused.shape
    head_dim = hidden // heads
    normed = rms_norm(fused, w[p + "hidden_norm.weight"], HEAD_EPS)
    residual = normed if nbr else fused
    x = torch.cat([rms_norm(embeds, w[p + "input_layernorm.weight"], HEAD_EPS), normed], dim=-1)  # [1, T, 2H]

    def split(y: torch.Tensor, count: int) -> torch.Tensor:
        return y.view(batch, length, count, head_dim).transpose(1, 2)

    q = rotate(split(x @ w[p + "self_attn.q_proj.weight"].T, heads), positions, HEAD_ROPE_THETA)
    k = rotate(split(x @ w[p + "self_attn.k_proj.weight"].T, kv_heads), positions, HEAD_ROPE_THETA)
    v = split(x @ w[p + "self_attn.v_proj.weight"].T, kv_heads)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(
        ~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf")
    )
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, hidden)
    h = residual + attended @ w[p + "self_attn.o_proj.weight"].T
    m = rms_norm(h, w[p + "post_attention_layernorm.weight"], HEAD_EPS)
    mlp = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)
    return h + mlp @ w[p + "mlp.down_proj.weight"].T


def reference_logits(w: dict[str, torch.Tensor], out: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target vocabulary (``-inf`` outside the draft vocabulary)."""
    draft = rms_norm(out, w["norm.weight"], HEAD_EPS) @ w["lm_head.weight"].T  # [.., Vd]
    full = torch.full((*draft.shape[:-1], vocab), float("-inf"), dtype=draft.dtype)
    full[..., torch.arange(w["d2t"].numel()) + w["d2t"]] = draft
    return full


# ----------------------------------------------------------------------------- head folders
def random_eagle3(model: Any, layers: list[int], draft_ids: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 weights (speculators names) for ``model``: one layer, draft vocabulary ``draft_ids``."""
    config = model.config
    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    g = torch.Generator().manual_seed(seed)
    p = "layers.0."
    shapes = {
        "fc.weight": (hidden, len(layers) * hidden),
        p + "self_attn.q_proj.weight": (hidden, 2 * hidden), p + "self_attn.k_proj.weight": (kv, 2 * hidden),
        p + "self_attn.v_proj.weight": (kv, 2 * hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
        p + "mlp.gate_proj.weight": (inner, hidden), p + "mlp.up_proj.weight": (inner, hidden),
        p + "mlp.down_proj.weight": (hidden, inner), "lm_head.weight": (len(draft_ids), hidden),
    }  # fmt: skip
    weights = {n: torch.randn(s, generator=g, dtype=torch.float64) * 0.2 for n, s in shapes.items()}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[f"{p}{name}.weight"] = 1 + 0.2 * torch.randn(hidden, generator=g, dtype=torch.float64)
    weights["norm.weight"] = 1 + 0.2 * torch.randn(hidden, generator=g, dtype=torch.float64)
    weights["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    weights["t2d"] = t2d
    return weights


def layer_config(model: Any, **changes: Any) -> dict[str, Any]:
    config = model.config
    return {
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "num_hidden_layers": 1, "vocab_size": config.vocab_size, "hidden_act": "silu", "rms_norm_eps": HEAD_EPS,
        "rope_theta": HEAD_ROPE_THETA, "max_position_embeddings": 512, **changes,
    }  # fmt: skip


def speculators_config(model: Any, layers: list[int], draft_vocab: int, nbr: bool, **changes: Any) -> dict[str, Any]:
    """A config.json as the speculators package writes it (Eagle3SpeculatorConfig.to_dict fields)."""
    return {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer_config(model), "draft_vocab_size": draft_vocab,
        "norm_before_residual": nbr, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layers,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        **changes,
    }  # fmt: skip


def safeailab_config(model: Any, layers: list[int], draft_vocab: int) -> dict[str, Any]:
    """A config.json as SafeAILab's EAGLE-3 / SpecForge heads ship it (a Llama config + fields)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_config(model), "draft_vocab_size": draft_vocab,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}, "torch_dtype": "float16",
    }  # fmt: skip


def write(folder: Path, weights: dict[str, torch.Tensor], config: dict[str, Any], safeailab: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {
        (name.replace("layers.0.", "midlayer.", 1) if safeailab else name): (
            value.float() if value.is_floating_point() else value
        ).contiguous()
        for name, value in weights.items()
    }
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def draft_vocab(model: Any, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values


# ----------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("layout", ["speculators", "safeailab"])
@pytest.mark.parametrize("nbr", [False, True], ids=["residual-raw", "norm_before_residual"])
def test_forward_matches_the_published_formula(tmp_path, tiny, layout, nbr) -> None:
    if layout == "safeailab" and nbr:
        pytest.skip("SafeAILab's layer keeps the raw residual (no norm_before_residual field)")
    ids_vocab = draft_vocab(tiny, 64)
    weights = random_eagle3(tiny, LAYERS, ids_vocab)
    config = (speculators_config(tiny, LAYERS, 64, nbr) if layout == "speculators"
              else safeailab_config(tiny, LAYERS, 64))  # fmt: skip
    folder = write(tmp_path / layout, weights, config, safeailab=layout == "safeailab")
    head = load_published_head(folder, tiny)
    assert isinstance(head, Eagle3Head) and head.capture_layers == tuple(LAYERS)
    ids = torch.tensor([[*PROMPT, 11, 30, 2, 7, 64, 19, 5]])
    taps = tapped_states(tiny, ids[:, :-1], LAYERS)  # [1, T, 3H]
    positions = torch.arange(ids.shape[1] - 1)
    embeds = tiny.model.embed_tokens(ids[:, 1:])
    with torch.no_grad():
        fused = taps @ weights["fc.weight"].T
        reference = reference_eagle3(weights, embeds, fused, positions, nbr)
        at_once = head(head.target_features(taps), ids[:, 1:], positions[None], HeadCache(32))
        cache = HeadCache(32)
        steps = [
            head(head.target_features(taps[:, t : t + 1]), ids[:, t + 1 : t + 2], positions[None, t : t + 1], cache)
            for t in range(len(positions))
        ]
        stepwise = torch.cat(steps, dim=1)
        # a chain step: the head's own output fed back (no fc) at the next position, after the true entries
        token = torch.tensor([[42]])
        chained = head(at_once[:, -1:], token, positions[None, -1:] + 1, cache)
        extended = reference_eagle3(
            weights,
            torch.cat([embeds, tiny.model.embed_tokens(token)], dim=1),
            torch.cat([fused, reference[:, -1:]], dim=1),
            torch.arange(len(positions) + 1),
            nbr,
        )
    torch.testing.assert_close(at_once, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stepwise, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chained, extended[:, -1:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.full_logits(at_once), reference_logits(weights, reference, 96).float())
    # the reference is not satisfied by the wrong variants (the test can fail)
    wrong_residual = reference_eagle3(weights, embeds, fused, positions, not nbr)
    assert (wrong_residual - reference).abs().max() > 1e-2
    swapped = torch.cat(taps.chunk(3, dim=-1)[::-1], dim=-1) @ weights["fc.weight"].T
    assert (reference_eagle3(weights, embeds, swapped, positions, nbr) - reference).abs().max() > 1e-2


# ----------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def trained_weights(tiny) -> dict[str, torch.Tensor]:
    return train_eagle3(tiny, LAYERS)


def train_eagle3(tiny: Any, layers: list[int], vocab: int = 80) -> dict[str, torch.Tensor]:
    """The reference head trained for a few seconds on the tiny model's greedy text (teacher-forced).

    Entry ``t`` (taps at ``t``, token ``t + 1``) learns the target's greedy token at ``t + 1``
    (cross-entropy on a draft vocabulary of ``vocab`` tokens; tokens outside it are not learned).
    """
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 96, (24, 6), generator=generator)
    with torch.no_grad():
        text = tiny.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=24,
                             pad_token_id=0, eos_token_id=None)  # fmt: skip
        taps = torch.cat([tapped_states(tiny, row[None], layers) for row in text])  # [B, T, 3H]
        greedy = tiny(text).logits.argmax(-1)  # [B, T]
    ids_vocab = draft_vocab(tiny, vocab, seed=2)
    draft_index = torch.full((96,), -100).index_copy_(0, ids_vocab, torch.arange(vocab))  # target id -> draft id
    start = random_eagle3(tiny, layers, ids_vocab)
    weights = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in start.items()}
    optimizer = torch.optim.Adam([v for v in weights.values() if v.requires_grad], lr=1e-2)
    positions = torch.arange(text.shape[1] - 1)
    embeds = tiny.model.embed_tokens(text[:, 1:]).detach()
    for step in range(120):
        rows = slice(step % 3 * 8, step % 3 * 8 + 8)
        fused = taps[rows, :-1] @ weights["fc.weight"].T
        out = reference_eagle3(weights, embeds[rows], fused, positions, False)
        draft = rms_norm(out, weights["norm.weight"], HEAD_EPS) @ weights["lm_head.weight"].T  # [b, T-1, Vd]
        labels = draft_index[greedy[rows, 1:]]  # the target's token at t + 1, as a draft id
        loss = torch.nn.functional.cross_entropy(draft.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in weights.items()}


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory, tiny, trained_weights) -> Path:
    config = speculators_config(tiny, LAYERS, 80, False)
    return write(tmp_path_factory.mktemp("e3") / "trained", trained_weights, config)


@pytest.fixture(scope="module")
def random_folder(tmp_path_factory, tiny) -> Path:
    weights = random_eagle3(tiny, LAYERS, draft_vocab(tiny, 64), seed=3)
    return write(tmp_path_factory.mktemp("e3") / "random", weights, safeailab_config(tiny, LAYERS, 64), safeailab=True)


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
def test_greedy_equals_generate(tiny, trained_folder, random_folder, tree_nodes) -> None:
    for folder in (trained_folder, random_folder):
        engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder, num_draft_tokens=3, tree_nodes=tree_nodes)
        accepted = 0
        for prompt in (PROMPT, [60, 61, 7]):
            out = engine.generate_ids(prompt, max_new_tokens=40)
            assert out.token_ids == reference_greedy(tiny, prompt, 40), folder.name
            accepted += out.stats.num_accepted
        if folder is trained_folder:
            assert accepted > 10, accepted  # the trained head's drafts are kept


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
def test_the_verifier_hands_over_the_tapped_states(tiny, trained_folder, tree_nodes) -> None:
    """Every state the head fuses is the state entering the named layers at that position (no recomputation)."""
    engine = SpeculativeEngine(
        tiny, drafter="eagle", eagle_head=trained_folder, num_draft_tokens=3, tree_nodes=tree_nodes
    )
    head = engine.drafter.head  # type: ignore[attr-defined]
    handed: list[torch.Tensor] = []
    fuse = head.target_features

    def spy(states: torch.Tensor) -> torch.Tensor:
        handed.append(states.detach().clone())
        return fuse(states)

    head.target_features = spy
    forwards = 0
    original_run = engine.runner.run_layers

    def counting_run(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal forwards
        forwards += 1
        return original_run(*args, **kwargs)

    engine.runner.run_layers = counting_run
    out = engine.generate_ids(PROMPT, max_new_tokens=30)
    states = torch.cat(handed, dim=1)  # [1, n, 3H]: every committed position once, in order
    full = torch.tensor([[*PROMPT, *out.token_ids]])
    expected = tapped_states(tiny, full, LAYERS)[:, : states.shape[1]]
    assert states.shape[1] >= len(PROMPT) + len(out.token_ids) - 5  # all but the last round's (k + 1 at most)
    torch.testing.assert_close(states, expected, rtol=1e-9, atol=1e-9)
    assert forwards == out.stats.target_forwards  # one target forward per round: nothing recomputed
    assert out.stats.num_accepted > 0


@pytest.mark.slow
@pytest.mark.parametrize("tree_nodes", [None, 4], ids=["chain", "tree"])
def test_sampling_follows_the_target_distribution(tmp_path, tree_nodes) -> None:
    """Chi-square over every 3-token continuation of an 8-token model; a random EAGLE-3 head, 6-token draft vocab."""
    model = make_distribution_model()
    layers = [1, 2, 4]
    ids_vocab = torch.tensor([0, 1, 3, 4, 6, 7])
    weights = random_eagle3(model, layers, ids_vocab, seed=4)
    config = speculators_config(model, layers, 6, True)
    folder = write(tmp_path / "dist", weights, config)
    engine = SpeculativeEngine(model, drafter="eagle", eagle_head=folder, num_draft_tokens=2, tree_nodes=tree_nodes)
    params = SamplingParams(1.0)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    stats = [engine.generate_ids(DIST_PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats for s in range(30)]
    assert sum(s.num_accepted for s in stats) > 0 and sum(s.num_drafted - s.num_accepted for s in stats) > 0


# ----------------------------------------------------------------------------- finding and refusing
def test_auto_finds_a_speculators_head_beside_the_model(tmp_path, tiny, trained_folder) -> None:
    import shutil

    model_folder = tmp_path / "tiny-model"
    tiny.save_pretrained(model_folder)
    shutil.copytree(trained_folder, model_folder / "eagle_head")
    assert find_eagle_head(str(model_folder), tiny) == model_folder / "eagle_head"
    engine = SpeculativeEngine.from_pretrained(str(model_folder), drafter="eagle", dtype=torch.float64)
    assert isinstance(engine.drafter.head, Eagle3Head)  # type: ignore[attr-defined]
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == reference_greedy(tiny, PROMPT, 12)


def bad_folders(tmp_path: Path, tiny: Any) -> dict[str, tuple[Path, type[Exception], str]]:
    ids_vocab = draft_vocab(tiny, 64)
    weights = random_eagle3(tiny, LAYERS, ids_vocab)
    good = speculators_config(tiny, LAYERS, 64, False)
    narrow_fc = {**weights, "fc.weight": weights["fc.weight"][:, :64]}
    no_norm = {k: v for k, v in weights.items() if k != "layers.0.hidden_norm.weight"}
    extra_layer = {**weights, "layers.1.mlp.down_proj.weight": weights["layers.0.mlp.down_proj.weight"]}
    bad_d2t = {**weights, "d2t": weights["d2t"] + 40}
    two_layers, vocab_128 = layer_config(tiny, num_hidden_layers=2), layer_config(tiny, vocab_size=128)
    (tmp_path / "pickle").mkdir()
    (tmp_path / "pickle" / "config.json").write_text(json.dumps(good), encoding="utf-8")
    torch.save({k: v for k, v in weights.items()}, tmp_path / "pickle" / "pytorch_model.bin")
    return {
        "fc shape": (write(tmp_path / "fc", narrow_fc, good), ConfigurationError, r"fc.weight \[32, 64\] reads 64"),
        "missing tensor": (write(tmp_path / "nonorm", no_norm, good), ConfigurationError,
                           r"missing \['layers.0.hidden_norm.weight'\]"),
        "extra tensor": (write(tmp_path / "extra", extra_layer, good), ConfigurationError,
                         r"unexpected \['layers.1.mlp.down_proj.weight'\]"),
        "lm_head shape": (write(tmp_path / "vocab", weights, {**good, "draft_vocab_size": 48}), ConfigurationError,
                          r"lm_head.weight \[64, 32\] \(expected \[48, 32\]\)"),
        "unknown type": (write(tmp_path / "medusa", weights, {**good, "speculators_model_type": "medusa"}),
                         ConfigurationError, "speculators 'medusa' model; selfspec reads speculators types eagle3"),
        "variant": (write(tmp_path / "fcnorm", weights, {**good, "norm_before_fc": True}), ConfigurationError,
                    "norm_before_fc: these EAGLE-3 variants are not supported"),
        "layer out of range": (write(tmp_path / "l9", weights, {**good, "eagle_aux_hidden_state_layer_ids": [1, 9]}),
                               ConfigurationError, r"feature layers \[1, 9\] outside the model's 0..6"),
        "two layers": (write(tmp_path / "two", weights, {**good, "transformer_layer_config": two_layers}),
                       ConfigurationError, "one-layer EAGLE-3 heads"),
        "another vocabulary": (write(tmp_path / "v128", weights, {**good, "transformer_layer_config": vocab_128}),
                               ConfigurationError, "vocabulary 128 vs the model's 96"),
        "pickle only": (tmp_path / "pickle", UnsafeCheckpointError, "safetensors only"),
        "d2t out of range": (write(tmp_path / "d2t", bad_d2t, good), ConfigurationError, "d2t maps draft tokens"),
    }  # fmt: skip


def test_bad_folders_are_refused_before_reading_weights(tmp_path, monkeypatch, tiny) -> None:
    real_read = eagle_files._read_weights
    reads: list[str] = []

    def counted_read(files: list[Path], wanted: set[str]) -> dict[str, torch.Tensor]:
        reads.append("read")
        return real_read(files, wanted)

    monkeypatch.setattr(eagle_files, "_read_weights", counted_read)
    for name, (folder, error, message) in bad_folders(tmp_path, tiny).items():
        reads.clear()
        with pytest.raises(error, match=message):
            SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder)
        if name != "d2t out of range":  # the vocabulary map's values are checked once read
            assert reads == [], name
    engine = SpeculativeEngine(tiny, drafter="early_exit")
    assert engine.generate_ids(PROMPT, max_new_tokens=6).token_ids == reference_greedy(tiny, PROMPT, 6)
