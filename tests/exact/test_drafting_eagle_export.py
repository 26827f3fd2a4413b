"""``selfspec export-eagle`` / ``export_eagle``: EAGLE-3 heads written in vLLM's ``speculators`` layout.

An EAGLE-3 head in SafeAILab's layout is exported; the folder is read back through selfspec's own
``speculators`` reader and must draft exactly the same tokens, round by round; its ``config.json``
is checked against the fields the speculators package defines (transcribed below from its source:
``Eagle3SpeculatorConfig``, ``SpeculatorModelConfig``, ``SpeculatorsConfig``, ``VerifierConfig``,
``GreedyTokenProposalConfig``) and against what vLLM's ``SpeculatorsConfig`` reads; its tensor
names against the names the format uses. selfspec's own heads (EAGLE-1-style) are refused with a
clear reason: they have no exact form in that layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from test_drafting_eagle_eagle3 import (
    LAYERS,
    PROMPT,
    draft_vocab,
    random_eagle3,
    safeailab_config,
    speculators_config,
    write,
)
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.cli import main
from selfspec.drafting.eagle.drafter import EagleDrafter
from selfspec.drafting.eagle.eagle3 import Eagle3Head
from selfspec.drafting.eagle.export import export_eagle
from selfspec.drafting.eagle.head import EagleHead
from selfspec.drafting.eagle.published import load_published_head
from selfspec.errors import ConfigurationError

# --- the speculators format, transcribed from vllm-project/speculators (src/speculators/config.py,
# --- models/eagle3/config.py, proposals/greedy.py) and transformers' PretrainedConfig
#: Eagle3SpeculatorConfig's own fields and those of its SpeculatorModelConfig base.
EAGLE3_CONFIG_FIELDS = {
    "speculators_model_type", "speculators_version", "speculators_config", "architectures",
    "transformer_layer_config", "draft_vocab_size", "norm_before_residual", "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids", "norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad",
}  # fmt: skip
#: PretrainedConfig fields a saved config may carry beside them.
PRETRAINED_FIELDS = {"torch_dtype", "dtype", "transformers_version"}
SPECULATORS_CONFIG_FIELDS = {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
VERIFIER_FIELDS = {"name_or_path", "architectures"}
GREEDY_PROPOSAL_FIELDS = {"proposal_type", "speculative_tokens", "verifier_accept_k", "accept_tolerance"}
#: Eagle3DraftModel's weights as saved (verifier_* are never saved; embed_tokens only when the head has its own).
LAYER_WEIGHTS = {
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}  # fmt: skip
TENSOR_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"layers.0.{n}" for n in LAYER_WEIGHTS}


@pytest.fixture(scope="module")
def tiny() -> Any:
    return make_model("llama", agreeing=True)


@pytest.fixture(scope="module")
def safeailab_folder(tmp_path_factory, tiny) -> Path:
    weights = random_eagle3(tiny, LAYERS, draft_vocab(tiny, 64, seed=5), seed=6)
    folder = tmp_path_factory.mktemp("x") / "safeailab"
    return write(folder, weights, safeailab_config(tiny, LAYERS, 64), safeailab=True)


def drafts_of(engine: SpeculativeEngine, prompt: list[int], tokens: int) -> tuple[list[list[int]], list[int]]:
    """Every round's draft tokens and the output."""
    drafter = engine.drafter
    assert isinstance(drafter, EagleDrafter)
    seen: list[list[int]] = []
    propose = drafter.propose

    def spy(state: Any, max_tokens: int) -> Any:
        draft = propose(state, max_tokens)
        seen.append(list(draft.tokens))
        return draft

    drafter.propose = spy  # type: ignore[method-assign]
    try:
        out = engine.generate_ids(prompt, max_new_tokens=tokens)
    finally:
        del drafter.propose
    return seen, out.token_ids


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
def test_export_reads_back_with_identical_drafts(tmp_path, tiny, safeailab_folder, tree_nodes) -> None:
    out = export_eagle(tiny, safeailab_folder, tmp_path / "spec", verifier="tiny/llama", dtype=torch.float64)
    original, exported = load_published_head(safeailab_folder, tiny), load_published_head(out, tiny)
    assert isinstance(exported, Eagle3Head) and exported.spec.layout == "speculators"
    for name, value in original.state_dict().items():
        assert torch.equal(exported.state_dict()[name], value), name
    assert torch.equal(exported.draft_token_ids, original.draft_token_ids)
    for prompt in (PROMPT, [60, 61, 7], [1, 2, 3, 4]):
        runs = [
            drafts_of(SpeculativeEngine(tiny, drafter="eagle", eagle_head=head, num_draft_tokens=3,
                                        tree_nodes=tree_nodes), prompt, 24)
            for head in (safeailab_folder, out)
        ]  # fmt: skip
        assert runs[0] == runs[1]
        assert runs[0][1] == reference_greedy(tiny, prompt, 24)
        assert sum(len(d) for d in runs[0][0]) > 0


def test_exported_config_has_the_published_fields(tmp_path, tiny, safeailab_folder) -> None:
    out = export_eagle(tiny, safeailab_folder, tmp_path / "spec", verifier="org/tiny-llama", speculative_tokens=5)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert set(config) - PRETRAINED_FIELDS == EAGLE3_CONFIG_FIELDS
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert set(spec) == SPECULATORS_CONFIG_FIELDS and spec["algorithm"] == "eagle3"
    assert set(spec["verifier"]) == VERIFIER_FIELDS
    assert spec["verifier"] == {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    (method,) = spec["proposal_methods"]
    assert set(method) == GREEDY_PROPOSAL_FIELDS and spec["default_proposal_method"] == method["proposal_type"]
    # what vLLM's SpeculatorsConfig reads: the method, the draft length, the layer config, the eagle3 fields
    assert (config["speculators_model_type"], method["speculative_tokens"]) == ("eagle3", 5)
    assert config["draft_vocab_size"] == 64 and config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["norm_before_residual"] is False and config["target_hidden_size"] == 32
    assert not (config["norm_before_fc"] or config["fc_norm"] or config["norm_output"])
    layer = transformers.AutoConfig.for_model(**config["transformer_layer_config"])
    assert isinstance(layer, transformers.LlamaConfig)
    assert (layer.hidden_size, layer.num_hidden_layers, layer.vocab_size, layer.rms_norm_eps) == (32, 1, 96, 0.03)
    assert layer.rope_parameters["rope_theta"] == 3000.0
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        names = set(reader.keys())
        d2t, t2d = reader.get_tensor("d2t"), reader.get_tensor("t2d")
    assert names == TENSOR_NAMES
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 64
    assert torch.equal(torch.arange(64) + d2t, draft_vocab(tiny, 64, seed=5))


def test_a_speculators_folder_exports_to_itself(tmp_path, tiny) -> None:
    weights = random_eagle3(tiny, LAYERS, draft_vocab(tiny, 64), seed=7)
    folder = write(tmp_path / "in", weights, speculators_config(tiny, LAYERS, 64, True))
    out = export_eagle(tiny, folder, tmp_path / "out", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-llama"  # the head's own verifier
    assert config["norm_before_residual"] is True
    with safe_open(str(folder / "model.safetensors"), framework="pt") as written:
        before = {name: written.get_tensor(name) for name in written.keys()}
    with safe_open(str(out / "model.safetensors"), framework="pt") as written:
        after = {name: written.get_tensor(name) for name in written.keys()}
    assert set(before) == set(after)
    for name, value in before.items():
        assert torch.equal(value, after[name]), name


def test_own_heads_are_refused_with_the_reason(tmp_path, tiny) -> None:
    torch.manual_seed(0)
    own = EagleHead(tiny).save(tmp_path / "own")
    with pytest.raises(ConfigurationError, match="has no exact form in the speculators eagle3 layout"):
        export_eagle(tiny, own, tmp_path / "out", verifier="x")
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path, tiny, safeailab_folder, capsys) -> None:
    model_folder = tmp_path / "tiny-model"
    tiny.save_pretrained(model_folder)
    out = tmp_path / "exported"
    code = main(["export-eagle", "--model", str(model_folder), "--head", str(safeailab_folder), "--out", str(out),
                 "--verifier", "org/tiny-llama"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and f"vllm serve {out}" in printed and "--speculative-algorithm EAGLE3" in printed
    assert isinstance(load_published_head(out, tiny), Eagle3Head)
    torch.manual_seed(0)
    own = EagleHead(tiny).save(tmp_path / "own")
    for args, message in (
        (["--head", str(own)], "has no exact form"),
        (["--head", str(tmp_path / "missing")], "no such folder"),
        (["--head", str(safeailab_folder), "--speculative-tokens", "0"], "must be >= 1"),
    ):
        code = main(["export-eagle", "--model", str(model_folder), "--out", str(tmp_path / "x"), *args])
        assert code == 2 and message in capsys.readouterr().err, args


# ----------------------------------------------------------------------------- a head trained by train-eagle
@pytest.fixture(scope="module")
def trained_eagle3(tmp_path_factory) -> Path:
    """An EAGLE-3 head trained by train-eagle (``head_format="eagle3"``) for a few seconds, saved as it saves."""
    from selfspec.drafting.eagle.train import EagleTrainConfig, save_trained_head, train_eagle_head

    model = make_model("llama", agreeing=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts: list[tuple[str, Any]] = [
        ("ids", torch.randint(3, 96, (6,), generator=generator).tolist()) for _ in range(32)
    ]
    config = EagleTrainConfig(
        max_seconds=90, new_tokens=24, batch_size=16, draft_vocab_size=64, max_steps=100, eval_every=50, lr=3e-3,
        unroll_after=0.0, head_format="eagle3", feature_layers=(1, 3, 6),
    )  # fmt: skip
    result = train_eagle_head(model, None, config, target_name="org/tiny-llama", prompts=prompts, progress=False)
    assert result.figures["steps"] == 100 and result.figures["answer_tokens"] > 300, result.figures
    return save_trained_head(result, tmp_path_factory.mktemp("trained") / "eagle3-head")


def test_a_head_trained_by_train_eagle_exports_with_identical_drafts(tmp_path, tiny, trained_eagle3) -> None:
    config = json.loads((trained_eagle3 / "config.json").read_text(encoding="utf-8"))
    assert config["speculators_model_type"] == "eagle3" and set(config) - PRETRAINED_FIELDS == EAGLE3_CONFIG_FIELDS
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    out = export_eagle(tiny, trained_eagle3, tmp_path / "exported")
    for prompt in (PROMPT, [60, 61, 7]):
        runs = [
            drafts_of(SpeculativeEngine(tiny, drafter="eagle", eagle_head=head, num_draft_tokens=3), prompt, 30)
            for head in (trained_eagle3, out)
        ]
        assert runs[0] == runs[1]
        assert runs[0][1] == reference_greedy(tiny, prompt, 30)
        assert sum(len(draft) for draft in runs[0][0]) > 0
