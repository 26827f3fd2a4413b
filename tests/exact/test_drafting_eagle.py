"""drafter="eagle": an EAGLE-style feature head, self-distilled; lossless whatever the head's quality.

Greedy output equals transformers' ``generate`` (float64; chains, trees, ``batching=True``; a
random head, a briefly trained head, and the head shipped for SmolLM2-135M-Instruct); the
head's KV cache always matches a fresh pass over the accepted text; training runs (the API on a
tiny model, the CLI on the demo model, resumed); bad input gets clear errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_core_acceptance import PROMPT as DIST_PROMPT
from test_core_acceptance import chi_square_pvalue, exact_distribution, make_distribution_model, sampled_counts
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.cli import main
from selfspec.core.sampling import SamplingParams
from selfspec.core.speed import CostModel, worth_drafting
from selfspec.drafting import DecodeState
from selfspec.drafting.eagle.drafter import EagleDrafter, eagle_costs
from selfspec.drafting.eagle.head import (
    HEAD_CONFIG,
    HEAD_WEIGHTS,
    SHIPPED_HEADS,
    EagleHead,
    HeadCache,
    find_eagle_head,
    load_eagle_head,
)
from selfspec.drafting.eagle.train import EagleTrainConfig, train_eagle_head
from selfspec.errors import ConfigurationError, ModelNotFoundError, UnsupportedArchitectureError

PROMPT = [5, 9, 3, 17, 4, 8]


@pytest.fixture(scope="module")
def tiny() -> Any:
    """A float64 tiny Llama whose early exits agree with it (so its features are predictable)."""
    return make_model("llama", agreeing=True)


@pytest.fixture(scope="module")
def random_head(tiny) -> EagleHead:
    torch.manual_seed(0)
    return EagleHead(tiny)


@pytest.fixture(scope="module")
def trained_head(tiny) -> EagleHead:
    """A head trained for a few seconds on the tiny model's own text (it accepts some drafts)."""
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts: list[tuple[str, Any]] = [
        ("ids", torch.randint(3, 96, (6,), generator=generator).tolist()) for _ in range(32)
    ]
    config = EagleTrainConfig(
        max_seconds=60, new_tokens=24, batch_size=16, draft_vocab_size=64, max_steps=100, eval_every=50, lr=3e-3,
        unroll_after=0.0,  # unrolled from the start: the step count, not the wall time, decides what it learns
    )  # fmt: skip
    result = train_eagle_head(model, None, config, prompts=prompts, progress=False)
    assert result.figures["steps"] == 100 and result.figures["answer_tokens"] > 300
    head = EagleHead(tiny, result.head.head_config, draft_token_ids=result.head.draft_token_ids)
    head.load_state_dict(result.head.state_dict())
    return head.eval().requires_grad_(False)


def eagle_engine(model: Any, head: EagleHead, **kwargs: Any) -> SpeculativeEngine:
    return SpeculativeEngine(model, drafter="eagle", eagle_head=head, **kwargs)


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
@pytest.mark.parametrize("head_kind", ["random", "trained"])
def test_greedy_equals_generate(tiny, random_head, trained_head, tree_nodes, head_kind) -> None:
    head = random_head if head_kind == "random" else trained_head
    reference = reference_greedy(tiny, PROMPT, 40)
    engine = eagle_engine(tiny, head, num_draft_tokens=3, tree_nodes=tree_nodes)
    out = engine.generate_ids(PROMPT, max_new_tokens=40)
    assert out.token_ids == reference
    if head_kind == "trained":  # the head drafts tokens the target keeps
        assert out.stats.num_accepted > 5, out.stats


def test_greedy_equals_generate_batched(tiny, trained_head) -> None:
    import threading

    prompts = [PROMPT, [7, 7, 1], [11, 2, 30, 31, 4], [60, 61]]
    references = [reference_greedy(tiny, p, 24) for p in prompts]
    engine = eagle_engine(tiny, trained_head, num_draft_tokens=3, batching=True)
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        results[i] = engine.generate_ids(prompts[i], max_new_tokens=24).token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(len(prompts))] == references


class RecordingDrafter(EagleDrafter):
    """Records the head's predicted root feature at every round, with the text it was computed for."""

    def __init__(self, head: EagleHead, **kwargs: Any) -> None:
        super().__init__(head, **kwargs)
        self.roots: list[tuple[list[int], torch.Tensor]] = []

    def _root_feature(self, state: DecodeState) -> Any:
        memory, root = super()._root_feature(state)
        self.roots.append((list(state.token_ids), root.detach().clone()))
        return memory, root


@pytest.mark.parametrize("tree_nodes", [None, 6], ids=["chain", "tree"])
def test_head_cache_matches_a_fresh_pass(tiny, trained_head, tree_nodes) -> None:
    """After any number of rounds (drafts rejected, trees compacted) the head holds exactly the true entries."""
    drafter = RecordingDrafter(trained_head, tree_nodes=tree_nodes)
    engine = SpeculativeEngine(tiny, drafter=drafter, num_draft_tokens=3)
    out = engine.generate_ids(PROMPT, max_new_tokens=30)
    assert out.stats.num_accepted > 3 and len(drafter.roots) > 5
    for token_ids, root in drafter.roots:
        ids = torch.tensor([token_ids])
        with torch.no_grad():
            features = tiny.model(ids[:, :-1]).last_hidden_state  # the target's own features, after the norm
            positions = torch.arange(len(token_ids) - 1)[None]
            fresh = trained_head(features, ids[:, 1:], positions, HeadCache(len(token_ids)))[:, -1:]
        torch.testing.assert_close(root, fresh, rtol=1e-9, atol=1e-9)


def test_tree_equals_the_chain_and_accepts_drafts(tiny, trained_head) -> None:
    """Trees draft more nodes a round than chains and accept some; the text is the same.

    (EAGLE-2's reranking keeps the most probable nodes, not necessarily the chain's path, so a
    tree may accept less than the chain on a given text: that is measured in the benchmark.)
    """
    chain = eagle_engine(tiny, trained_head, num_draft_tokens=4).generate_ids(PROMPT, max_new_tokens=40)
    tree = eagle_engine(tiny, trained_head, num_draft_tokens=4, tree_nodes=10).generate_ids(PROMPT, max_new_tokens=40)
    assert tree.token_ids == chain.token_ids
    per_round = [s.num_drafted / max(s.target_forwards - 1, 1) for s in (chain.stats, tree.stats)]
    assert per_round[1] > per_round[0] and tree.stats.mean_accepted_length > 1.5


# ----------------------------------------------------------------------------- sampling
@pytest.mark.slow
@pytest.mark.parametrize(
    "tree_nodes, batching, params",
    [
        (None, False, SamplingParams(1.0)),
        (6, False, SamplingParams(1.0)),
        (None, True, SamplingParams(0.7, top_k=4, top_p=0.9)),
    ],
    ids=["chain", "tree", "chain-batching-t0.7-topk4-topp0.9"],
)
def test_sampling_follows_the_target_distribution(tree_nodes, batching, params) -> None:
    """Chi-square over every 3-token continuation of an 8-token model, with a randomly initialised head."""
    model = make_distribution_model()
    torch.manual_seed(1)
    head = EagleHead(model)
    engine = eagle_engine(model, head, num_draft_tokens=2, tree_nodes=tree_nodes, batching=batching)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    rates = [engine.generate_ids(DIST_PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats for s in range(30)]
    assert sum(r.num_accepted for r in rates) > 0 and sum(r.num_drafted - r.num_accepted for r in rates) > 0


# ----------------------------------------------------------------------------- cost gate
def test_worth_drafting_compares_the_marginal_rate_with_the_round_rate() -> None:
    costs = CostModel(0.1, {1: 1.2, 2: 1.5})  # round costs 1, 1.3, 1.7
    assert worth_drafting(0.31, 1.0, 0, costs.round_cost)  # 0.31 / 0.3 beats 1 token per plain step
    assert not worth_drafting(0.29, 1.0, 0, costs.round_cost)
    # second token: the round so far expects 1.9 tokens for 1.3, so it must beat 1.9 / 1.3 per unit
    assert worth_drafting(0.6, 1.9, 1, costs.round_cost) and not worth_drafting(0.5, 1.9, 1, costs.round_cost)


def test_cost_gate_keeps_greedy_exact_and_drafts_only_what_pays(tiny, trained_head, monkeypatch) -> None:
    """Gated chains give the same text; a gate nothing can pass turns every round into a plain step.

    The tiny head's argmax is often right but its distribution is nearly flat (top probability
    ~0.02 over 64 draft tokens after 100 steps), so its logits are sharpened (x30) to give it the
    calibrated confidence a real head has (SmolLM2's: accepted about as often as its top probability).
    """
    full_logits = trained_head.full_logits
    monkeypatch.setattr(trained_head, "full_logits", lambda features: full_logits(features) * 30)
    reference = reference_greedy(tiny, PROMPT, 40)
    runs = {}
    for name, costs in {
        "none": None,
        "calibrated": CostModel(0.05, {1: 1.15, 2: 1.3, 3: 1.45, 4: 1.6}),
        "prohibitive": CostModel(2.0, {1: 3.0}),
    }.items():
        drafter = EagleDrafter(trained_head, costs=costs)
        runs[name] = SpeculativeEngine(tiny, drafter=drafter, num_draft_tokens=4).generate_ids(
            PROMPT, max_new_tokens=40
        )
        assert runs[name].token_ids == reference, name
    assert runs["prohibitive"].stats.num_drafted == 0
    calibrated, ungated = runs["calibrated"].stats, runs["none"].stats
    assert 0 < calibrated.num_drafted < ungated.num_drafted * 0.75  # the gate drops drafts ...
    assert calibrated.num_accepted >= ungated.num_accepted * 0.8  # ... mostly ones that would be rejected


def test_eagle_costs_come_from_the_calibration() -> None:
    calibration = {"eagle": {"draft_cost": 0.08}, "verify_cost": {"1": 1.18, "2": 1.56}}
    costs = eagle_costs(calibration)
    assert costs is not None and costs.round_cost(2) == pytest.approx(0.16 + 1.56)
    assert eagle_costs({"verify_cost": {"1": 1.2}}) is None and eagle_costs(None) is None


@pytest.mark.slow
def test_sampling_with_the_cost_gate_follows_the_target_distribution() -> None:
    """The gate reads the draft distribution, never the token drawn from it: still exact (chi-square)."""
    model = make_distribution_model()
    torch.manual_seed(1)
    drafter = EagleDrafter(EagleHead(model), costs=CostModel(0.1, {1: 1.2, 2: 1.4}))  # gate: top prob >= 0.3
    engine = SpeculativeEngine(model, drafter=drafter, num_draft_tokens=2)
    counts = sampled_counts(engine, SamplingParams(1.0))
    assert chi_square_pvalue(counts, exact_distribution(model, SamplingParams(1.0))) > 1e-3
    stats = [engine.generate_ids(DIST_PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats for s in range(30)]
    rounds = sum(r.target_forwards - 1 for r in stats)
    assert 0 < sum(r.num_drafted for r in stats) < 2 * rounds  # some rounds gated, some drafted
    assert sum(r.num_accepted for r in stats) > 0


# ----------------------------------------------------------------------------- bad input
def test_no_head_is_a_clear_error_and_the_model_still_works(tiny) -> None:
    with pytest.raises(ConfigurationError, match="train-eagle"):
        SpeculativeEngine(tiny, drafter="eagle")
    assert SpeculativeEngine(
        tiny, drafter="early_exit"
    ).generate_ids(PROMPT, max_new_tokens=5).token_ids == reference_greedy(tiny, PROMPT, 5)


def test_eagle_head_needs_drafter_eagle(tiny, random_head) -> None:
    with pytest.raises(ConfigurationError, match="eagle_head"):
        SpeculativeEngine(tiny, drafter="early_exit", eagle_head=random_head)


@pytest.mark.parametrize(
    "change, what",
    [
        ({"hidden_size": 48, "head_dim": 8}, "hidden size"),
        ({"num_hidden_layers": 4}, "layer count"),
        ({"vocab_size": 128}, "vocabulary"),
    ],
)
def test_head_for_another_model(tmp_path, tiny, random_head, change, what) -> None:
    random_head.save(tmp_path / "head")
    other = make_model("llama", **change)
    with pytest.raises(ConfigurationError, match=what):
        SpeculativeEngine(other, drafter="eagle", eagle_head=tmp_path / "head")
    with pytest.raises(ConfigurationError, match="train-eagle"):
        SpeculativeEngine(other, drafter="eagle", eagle_head=random_head)
    engine = SpeculativeEngine(other, drafter="early_exit")  # the model is untouched
    assert engine.generate_ids(PROMPT, max_new_tokens=4).token_ids == reference_greedy(other, PROMPT, 4)


def test_missing_and_corrupt_head_folders(tmp_path, tiny, random_head) -> None:
    with pytest.raises(ModelNotFoundError, match="train-eagle"):
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=HEAD_CONFIG):
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=tmp_path / "empty")
    folder = random_head.save(tmp_path / "head")
    (folder / HEAD_WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigurationError, match="safetensors"):
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder)
    folder = random_head.save(tmp_path / "head2")
    (folder / HEAD_CONFIG).write_text("{ broken", encoding="utf-8")
    with pytest.raises(ConfigurationError, match="not a valid EAGLE head config"):
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=folder)
    with pytest.raises(ConfigurationError, match="eagle_head must be"):
        SpeculativeEngine(tiny, drafter="eagle", eagle_head=3)
    # a good folder loads and drafts exactly
    good = random_head.save(tmp_path / "good")
    engine = SpeculativeEngine(tiny, drafter="eagle", eagle_head=good, num_draft_tokens=2)
    assert engine.generate_ids(PROMPT, max_new_tokens=8).token_ids == reference_greedy(tiny, PROMPT, 8)


def test_save_and_load_round_trip(tmp_path, tiny, trained_head) -> None:
    folder = trained_head.save(tmp_path / "head", dtype=torch.float64)
    loaded = load_eagle_head(folder, tiny)
    assert torch.equal(loaded.draft_token_ids, trained_head.draft_token_ids)
    for name, value in trained_head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    config = json.loads((folder / HEAD_CONFIG).read_text(encoding="utf-8"))
    assert config["hidden_size"] == 32 and config["feature_layers"] == [6] and config["draft_vocab_size"] == 64
    assert "embed_tokens" not in " ".join(loaded.state_dict())  # the target's modules are shared, not saved


def test_auto_finds_the_head_saved_beside_the_model(tmp_path, tiny, random_head) -> None:
    tiny.save_pretrained(tmp_path / "model")
    assert find_eagle_head(str(tmp_path / "model"), tiny) is None
    random_head.save(tmp_path / "model" / "eagle_head")
    assert find_eagle_head(str(tmp_path / "model"), tiny) == tmp_path / "model" / "eagle_head"
    tiny.config._name_or_path = str(tmp_path / "model")
    try:
        engine = SpeculativeEngine(tiny, drafter="eagle", num_draft_tokens=2)  # eagle_head "auto" by default
        assert engine.generate_ids(PROMPT, max_new_tokens=6).token_ids == reference_greedy(tiny, PROMPT, 6)
    finally:
        tiny.config._name_or_path = ""


def test_train_eagle_cli_errors(capsys, tmp_path) -> None:
    assert main(["train-eagle", "--model", "selfspec-demo", "--minutes", "0"]) == 2
    assert "--minutes must be > 0" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["train-eagle", "--model", str(tmp_path)]) == 2
    assert "not supported" in capsys.readouterr().err
    assert main(["train-eagle", "--model", "selfspec-demo", "--data", str(tmp_path / "missing.txt")]) == 2
    assert "--data" in capsys.readouterr().err


def test_unsupported_layout_is_refused() -> None:
    class NotALlama(torch.nn.Module):
        config = None

    with pytest.raises(ConfigurationError, match="Llama layout"):
        EagleHead(NotALlama())
    assert issubclass(UnsupportedArchitectureError, ValueError)


# ----------------------------------------------------------------------------- training
@pytest.mark.slow
def test_train_eagle_cli_runs_and_resumes(capsys, tmp_path, monkeypatch) -> None:
    """A few steps on the demo model through the CLI; a second run continues from the checkpoint (its EAGLE-3
    taps kept with the data); the head is EAGLE-3 in the speculators layout by default, and exports as it is."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Tell me about Mr. Darcy.\nWho is Elizabeth?\n", encoding="utf-8")
    args = ["train-eagle", "--model", "selfspec-demo", "--minutes", "2", "--max-samples", "6", "--new-tokens", "16",
            "--batch-size", "6", "--draft-vocab", "256", "--unroll", "2", "--data", str(prompts),
            "--out", str(tmp_path / "head")]  # fmt: skip
    assert main([*args, "--max-steps", "3"]) == 0
    assert "saved to" in capsys.readouterr().out
    record = json.loads((tmp_path / "head" / "eagle_training.json").read_text(encoding="utf-8"))
    assert record["figures"]["steps"] == 3 and record["figures"]["samples"] == 6
    assert main([*args, "--max-steps", "5"]) == 0  # resumes: the same data, two more steps
    record = json.loads((tmp_path / "head" / "eagle_training.json").read_text(encoding="utf-8"))
    assert record["figures"]["steps"] == 5
    config = json.loads((tmp_path / "head" / "config.json").read_text(encoding="utf-8"))
    assert config["speculators_model_type"] == "eagle3"  # the layout vLLM and SGLang run
    assert config["speculators_config"]["verifier"]["name_or_path"] == "selfspec-demo"
    engine = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="eagle", eagle_head=tmp_path / "head")
    assert type(engine.drafter.head).__name__ == "Eagle3Head"
    plain = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="none")
    prompt = "It is a truth universally acknowledged"
    assert engine.generate(prompt, max_new_tokens=12).text == plain.generate(prompt, max_new_tokens=12).text
    assert main(["export-eagle", "--model", "selfspec-demo", "--head", str(tmp_path / "head"),
                 "--out", str(tmp_path / "exported")]) == 0  # fmt: skip
    exported = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="eagle", eagle_head=tmp_path / "exported")
    assert exported.generate(prompt, max_new_tokens=12).text == plain.generate(prompt, max_new_tokens=12).text


# ----------------------------------------------------------------------------- the shipped head
def shipped_smollm2_head() -> Path:
    folder = SHIPPED_HEADS / "smollm2-135m-instruct"
    assert (folder / HEAD_WEIGHTS).is_file(), "the head shipped for SmolLM2-135M-Instruct is missing"
    return folder


def test_shipped_head_is_small_and_found_by_auto(smollm2_path) -> None:
    folder = shipped_smollm2_head()
    assert (folder / HEAD_WEIGHTS).stat().st_size < 12_000_000  # fp16, one layer at hidden 576
    assert find_eagle_head(str(smollm2_path)) == folder
    assert find_eagle_head("HuggingFaceTB/SmolLM2-135M-Instruct") == folder
    assert find_eagle_head("HuggingFaceTB/SmolLM2-360M-Instruct") is None
    config = json.loads((folder / HEAD_CONFIG).read_text(encoding="utf-8"))
    assert config["training"]["answer_tokens"] > 1000 and config["training"]["train_seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tree_nodes", [None, 8], ids=["chain", "tree"])
def test_smollm2_greedy_equals_generate_with_the_shipped_head(smollm2_f64, tree_nodes) -> None:
    model, tokenizer = smollm2_f64
    head = load_eagle_head(shipped_smollm2_head(), model)
    engine = SpeculativeEngine(  # fixed settings: a calibration saved on this machine must not gate the head
        model, tokenizer, drafter="eagle", eagle_head=head, num_draft_tokens=4, tree_nodes=tree_nodes, calibration={}
    )
    messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    ids = engine.encode_prompt(messages)
    reference = reference_greedy(model, ids, 32)
    out = engine.generate_ids(ids, max_new_tokens=32)
    assert out.token_ids == reference
    assert out.stats.num_drafted > 0, out.stats  # the head drafted (its quality is measured in the benchmark)
