"""Published EAGLE-1/EAGLE-2 heads load with ``eagle_head=<folder>`` and draft exactly.

The test writes a head folder in the published layout itself (``config.json`` +
``model.safetensors`` with SafeAILab/EAGLE's weight names), with weights trained here for a few
seconds by a reference implementation of the published formula, written independently of
selfspec's loader:

    x = fc([embed(x_{t+1}), f_t])    f_{t+1} = layer_without_input_norm(x)    logits = lm_head(f_{t+1})

The loaded head must reproduce the reference (so a swapped concatenation, a missing or extra
norm, the wrong norm eps or the wrong rotary base fail), and greedy output must equal
transformers' ``generate`` in float64, with chains and with trees. Bad folders (pickle only,
another model's shapes, no ``fc``, an EAGLE-3 head with a float ``d2t``) get clear errors, and the engine works after.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle.head import HeadCache
from selfspec.drafting.eagle.published import PublishedEagleHead, load_published_head
from selfspec.errors import ConfigurationError, ModelNotFoundError, UnsafeCheckpointError

PROMPT = [5, 9, 3, 17, 4, 8]
#: The head's own layer settings: an eps and a rotary base that differ from the tiny target's
#: (1e-6, 10000), so that a loader using the target's instead fails the reference test.
HEAD_EPS = 0.05
HEAD_ROPE_THETA = 2000.0


@pytest.fixture(scope="module")
def tiny() -> Any:
    """The float64 tiny Llama of test_drafting_eagle (hidden 32, 4 heads / 2 KV heads, vocab 96)."""
    return make_model("llama", agreeing=True)


# ----------------------------------------------------------------------------- the published formula
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as in EAGLE's LlamaRotaryEmbedding (rotate_half layout), ``x``: [..., T, head_dim]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.cat([positions.float()[:, None] * inv_freq[None]] * 2, dim=-1)  # [T, head_dim]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_head(
    w: dict[str, torch.Tensor], embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """EAGLE-1's head, causal: ``embeds`` / ``features`` [B, T, H], ``positions`` [T] -> predicted [B, T, H]."""
    heads, kv_heads = 4, 2
    x = torch.cat([embeds, features], dim=-1) @ w["fc.weight"].T + w["fc.bias"]  # [B, T, H]; embedding first
    batch, length, hidden = x.shape
    head_dim = hidden // heads

    def split(y: torch.Tensor, count: int) -> torch.Tensor:  # [B, T, count * head_dim] -> [B, count, T, head_dim]
        return y.view(batch, length, count, head_dim).transpose(1, 2)

    q = rotate(split(x @ w["layers.0.self_attn.q_proj.weight"].T, heads), positions, HEAD_ROPE_THETA)
    k = rotate(split(x @ w["layers.0.self_attn.k_proj.weight"].T, kv_heads), positions, HEAD_ROPE_THETA)
    v = split(x @ w["layers.0.self_attn.v_proj.weight"].T, kv_heads)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, hidden)
    h = x + attended @ w["layers.0.self_attn.o_proj.weight"].T  # no input norm before the attention
    m = rms_norm(h, w["layers.0.post_attention_layernorm.weight"], HEAD_EPS)
    gated = torch.nn.functional.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (
        m @ w["layers.0.mlp.up_proj.weight"].T
    )
    return h + gated @ w["layers.0.mlp.down_proj.weight"].T  # no final norm: the LM head reads it as it is


def published_config(hidden: int = 32, **changes: Any) -> dict[str, Any]:
    """A config.json as SafeAILab/EAGLE's EAGLE-1 heads ship it (a one-layer Llama config + ``bias``)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "max_position_embeddings": 256, "rms_norm_eps": HEAD_EPS,
        "rope_theta": HEAD_ROPE_THETA, "rope_scaling": None, "vocab_size": 96, "torch_dtype": "float16", "bias": True,
    }  # fmt: skip
    config.update(changes)
    return config


def random_weights(model: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Published EAGLE-1 weight names, shaped for ``model``, with small random values.

    The target's embedding is included, as EAGLE saves it.
    """
    config = model.config
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
        "layers.0.self_attn.q_proj.weight": (hidden, hidden), "layers.0.self_attn.k_proj.weight": (kv, hidden),
        "layers.0.self_attn.v_proj.weight": (kv, hidden), "layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "layers.0.mlp.gate_proj.weight": (inner, hidden), "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
    }  # fmt: skip
    weights = {
        name: torch.randn(shape, generator=generator, dtype=torch.float64) * 0.15 for name, shape in shapes.items()
    }
    weights["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=generator)
    weights["embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    return weights


def write_folder(folder: Path, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float32).contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def trained_weights(tiny) -> dict[str, torch.Tensor]:
    """A reference head trained for a few seconds on the tiny model's own greedy text (EAGLE-1's loss)."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 96, (24, 6), generator=generator)
    with torch.no_grad():
        text = tiny.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=24,
                             pad_token_id=0, eos_token_id=None)  # fmt: skip
        features = tiny.model(text).last_hidden_state  # [B, T, H] after the final norm
        target_probs = torch.softmax(tiny.lm_head(features), -1)
    weights = {k: v.clone().requires_grad_(k != "embed_tokens.weight") for k, v in random_weights(tiny).items()}
    optimizer = torch.optim.Adam([v for v in weights.values() if v.requires_grad], lr=1e-2)
    positions = torch.arange(text.shape[1] - 1)
    embeds = tiny.model.embed_tokens(text[:, 1:]).detach()
    for step in range(60):
        rows = slice(step % 3 * 8, step % 3 * 8 + 8)
        predicted = reference_head(weights, embeds[rows], features[rows, :-1], positions)  # f_{t+1} for t < T-1
        regression = torch.nn.functional.smooth_l1_loss(predicted, features[rows, 1:])
        log_probs = torch.log_softmax(tiny.lm_head(predicted), -1)
        loss = regression - 0.1 * (target_probs[rows, 1:] * log_probs).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach() for k, v in weights.items()}


@pytest.fixture(scope="module")
def trained_folder(tmp_path_factory, trained_weights) -> Path:
    return write_folder(tmp_path_factory.mktemp("published") / "eagle-head", trained_weights, published_config())


# ----------------------------------------------------------------------------- loading and the formula
def test_loads_as_a_head_and_matches_the_published_formula(tiny, trained_weights, trained_folder) -> None:
    head = load_published_head(trained_folder, tiny)
    assert isinstance(head, PublishedEagleHead) and head.fc.bias is not None
    assert head.num_parameters() == sum(v.numel() for k, v in trained_weights.items() if k != "embed_tokens.weight")
    ids = torch.tensor([[*PROMPT, 11, 30, 2, 7, 64, 19, 5]])
    with torch.no_grad():
        features = tiny.model(ids[:, :-1]).last_hidden_state  # [1, T, H] after the final norm
        positions = torch.arange(ids.shape[1] - 1)
        reference = reference_head(trained_weights, tiny.model.embed_tokens(ids[:, 1:]), features, positions)[0]
        # through the selfspec head: all at once, then one entry at a time (the drafter's catch-up and chain)
        at_once = head(features, ids[:, 1:], positions[None], HeadCache(32))[0]
        cache = HeadCache(32)
        stepwise = torch.cat([head(features[:, t : t + 1], ids[:, t + 1 : t + 2], positions[None, t : t + 1], cache)
                              for t in range(len(positions))], dim=1)[0]  # fmt: skip
        logits = head.full_logits(at_once)
    torch.testing.assert_close(at_once, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stepwise, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, (reference @ tiny.lm_head.weight.T).float(), rtol=1e-5, atol=1e-5)
    # the formula is not satisfied by the wrong variants (the test can fail)
    swapped = {**trained_weights, "fc.weight": torch.cat(trained_weights["fc.weight"].chunk(2, dim=1)[::-1], dim=1)}
    wrong = reference_head(swapped, tiny.model.embed_tokens(ids[:, 1:]), features, positions)[0]
    assert (wrong - reference).abs().max() > 1e-2
    normed = rms_norm(reference, tiny.model.norm.weight, tiny.config.rms_norm_eps)
    assert (normed - reference).abs().max() > 1e-2


def test_a_loaded_published_head_saves_and_reloads(tmp_path, tiny, trained_folder) -> None:
    head = load_published_head(trained_folder, tiny)
    folder = head.save(tmp_path / "again", dtype=torch.float64)
    again = load_published_head(folder, tiny)
    for name, value in head.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert config["rms_norm_eps"] == HEAD_EPS and config["rope_theta"] == HEAD_ROPE_THETA and config["bias"] is True


def test_sharded_safetensors_load(tmp_path, tiny, trained_weights) -> None:
    """A head split into shards with a ``model.safetensors.index.json`` loads like a single file."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = sorted(trained_weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({k: trained_weights[k].float().contiguous() for k in shard_names}, str(folder / shard))
    index = {"weight_map": {k: shard for shard, shard_names in shards.items() for k in shard_names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(published_config()), encoding="utf-8")
    head = load_published_head(folder, tiny)
    torch.testing.assert_close(head.fc.weight, trained_weights["fc.weight"].float().double())
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder, num_draft_tokens=3)
    assert engine.generate_ids(PROMPT, max_new_tokens=10).token_ids == reference_greedy(tiny, PROMPT, 10)


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
def test_greedy_equals_generate(tiny, trained_folder, tree_nodes) -> None:
    engine = SpeculativeEngine(
        tiny, drafter="eagle", eagle_head=trained_folder, num_draft_tokens=3, tree_nodes=tree_nodes
    )
    for prompt in (PROMPT, [60, 61, 7]):
        out = engine.generate_ids(prompt, max_new_tokens=40)
        assert out.token_ids == reference_greedy(tiny, prompt, 40)
        assert out.stats.num_accepted > 5, out.stats  # the published head's drafts are kept


def test_no_fc_bias_and_qkv_bias(tmp_path, tiny) -> None:
    """``bias: false`` heads (EAGLE's LLaMA3 heads) and q/k/v biases (``qkv_bias``) load and draft exactly."""
    weights = random_weights(tiny, seed=3)
    del weights["fc.bias"]
    generator = torch.Generator().manual_seed(4)
    for name, size in (("q", 32), ("k", 16), ("v", 16)):
        weights[f"layers.0.self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size, generator=generator)
    folder = write_folder(tmp_path / "head", weights, published_config(bias=False, qkv_bias=True))
    head = load_published_head(folder, tiny)
    assert head.fc.bias is None and torch.equal(head.layer.self_attn.o_proj.bias, torch.zeros(32, dtype=torch.float64))
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder, num_draft_tokens=2)
    assert engine.generate_ids(PROMPT, max_new_tokens=12).token_ids == reference_greedy(tiny, PROMPT, 12)


# ----------------------------------------------------------------------------- bad input
def test_pickle_only_folder_is_refused_with_the_conversion(tmp_path, monkeypatch, tiny) -> None:
    folder = tmp_path / "bin-head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(published_config()), encoding="utf-8")
    torch.save({k: v.float() for k, v in random_weights(tiny).items()}, folder / "pytorch_model.bin")
    with pytest.raises(UnsafeCheckpointError, match="safetensors") as error:
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder)
    # the message's own conversion command works (run here, in the folder, as the user would)
    command = re.search(r'python -c "(.+)"', str(error.value))
    assert command is not None and "weights_only=True" in command.group(1)
    monkeypatch.chdir(folder)
    exec(command.group(1), {})  # the exact advice the error gives, on a file this test wrote
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder, num_draft_tokens=2)
    assert engine.generate_ids(PROMPT, max_new_tokens=8).token_ids == reference_greedy(tiny, PROMPT, 8)


def eagle3_folder(folder: Path, hidden: int = 32) -> Path:
    """An EAGLE-3 head as SpecForge / EAGLE's traineagle3 saves it (no embedding: it is frozen and not saved)."""
    generator = torch.Generator().manual_seed(5)
    shapes = {
        "fc.weight": (hidden, 3 * hidden), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (hidden, 2 * hidden), "midlayer.self_attn.k_proj.weight": (16, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (16, 2 * hidden), "midlayer.self_attn.o_proj.weight": (hidden, hidden),
        "midlayer.mlp.gate_proj.weight": (64, hidden), "midlayer.mlp.up_proj.weight": (64, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, 64), "norm.weight": (hidden,), "lm_head.weight": (48, hidden),
    }  # fmt: skip
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    weights["d2t"] = torch.arange(48) * 0
    weights["t2d"] = torch.arange(96) < 48
    config = published_config(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=48)
    return write_folder(folder, weights, config)


def broken_folders(tmp_path: Path, tiny: Any) -> dict[str, tuple[Path, type[Exception], str]]:
    wider = make_model("llama", hidden_size=48, head_dim=12)
    weights = random_weights(tiny)
    no_fc = {k: v for k, v in weights.items() if not k.startswith("fc.")}
    two_layers = {
        **weights,
        **{k.replace("layers.0.", "layers.1."): v.clone() for k, v in weights.items() if "layers.0." in k},
    }
    final_norm = {**weights, "norm.weight": torch.ones(32)}
    no_mlp = {k: v for k, v in weights.items() if "down_proj" not in k}
    tiny.save_pretrained(tmp_path / "a-model")  # a model folder passed as eagle_head= by mistake
    (tmp_path / "only-config").mkdir()
    (tmp_path / "only-config" / "config.json").write_text(json.dumps(published_config()), encoding="utf-8")
    return {
        "hidden size": (write_folder(tmp_path / "h48", random_weights(wider), published_config(48)),
                        ConfigurationError, "hidden size 48 vs the model's 32"),
        "vocabulary": (write_folder(tmp_path / "v128", weights, published_config(vocab_size=128)),
                       ConfigurationError, "vocab size 128 vs the model's 96"),
        "no fc": (write_folder(tmp_path / "nofc", no_fc, published_config()), ConfigurationError, "no fc.weight"),
        # EAGLE-3 heads load (tests/exact/test_drafting_eagle_eagle3.py); this one's d2t was written as floats
        "EAGLE-3, float d2t": (eagle3_folder(tmp_path / "eagle3"), ConfigurationError, "d2t must be a 1-D integer"),
        "two layers": (write_folder(tmp_path / "two", two_layers, published_config()), ConfigurationError,
                       "one-layer EAGLE heads"),
        "final norm": (write_folder(tmp_path / "norm", final_norm, published_config()), ConfigurationError,
                       r"unexpected \['norm.weight'\]"),
        "missing weight": (write_folder(tmp_path / "nomlp", no_mlp, published_config()), ConfigurationError,
                           r"missing \['layers.0.mlp.down_proj.weight'\]"),
        "bias mismatch": (write_folder(tmp_path / "bias", weights, published_config(bias=False)), ConfigurationError,
                          "fc.bias is present"),
        "no weights": (tmp_path / "only-config", ModelNotFoundError, "model.safetensors"),
        "a model folder": (tmp_path / "a-model", ConfigurationError, "no fc.weight: it is not an EAGLE"),
    }  # fmt: skip


def test_bad_folders_get_clear_errors_and_the_engine_works_after(tmp_path, tiny, trained_folder) -> None:
    for name, (folder, error, message) in broken_folders(tmp_path, tiny).items():
        with pytest.raises(error, match=message):
            SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder)
        with pytest.raises(error, match=message):
            load_published_head(folder, tiny)
        assert os.path.isdir(folder), name
    assert SpeculativeEngine(
        tiny, drafter="early_exit"
    ).generate_ids(PROMPT, max_new_tokens=6).token_ids == reference_greedy(tiny, PROMPT, 6)
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=trained_folder, num_draft_tokens=2)
    assert engine.generate_ids(PROMPT, max_new_tokens=8).token_ids == reference_greedy(tiny, PROMPT, 8)


def test_speculators_eagle1_layout_loads_like_safeailab(tmp_path, tiny, trained_weights, trained_folder) -> None:
    """The same head in speculators' ``eagle`` layout (``fusion_fc``, ``transformer.*``) drafts the same tokens."""
    renamed = {
        name.replace("fc.", "fusion_fc.", 1).replace("layers.0.", "transformer.", 1): value
        for name, value in trained_weights.items()
        if name != "embed_tokens.weight"  # speculators never saves the embedding
    }
    layer = {k: v for k, v in published_config().items() if k not in ("bias", "architectures", "torch_dtype")}
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"], "speculators_model_type": "eagle",
        "speculators_version": "0.1.0", "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer, "layernorms": False, "fusion_bias": True,
        "speculators_config": {"algorithm": "eagle", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
    }  # fmt: skip
    folder = write_folder(tmp_path / "speculators-eagle", renamed, config)
    head, reference = load_published_head(folder, tiny), load_published_head(trained_folder, tiny)
    assert isinstance(head, PublishedEagleHead)
    for name, value in reference.state_dict().items():
        assert torch.equal(head.state_dict()[name], value), name
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder, num_draft_tokens=3)
    out = engine.generate_ids(PROMPT, max_new_tokens=20)
    assert out.token_ids == reference_greedy(tiny, PROMPT, 20) and out.stats.num_accepted > 3
    with pytest.raises(ConfigurationError, match="layernorms=true"):
        load_published_head(write_folder(tmp_path / "norms", renamed, {**config, "layernorms": True}), tiny)
