"""Medusa heads: the published checkpoint layout, exact decoding, lossless sampling, training.

Exactness is checked against transformers' own greedy ``generate`` in float64 with random
heads (drafts mostly rejected) and heads that agree often (drafts accepted); the sampled
distribution with the chi-square machinery of ``test_core_acceptance``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_core_acceptance import (
    PROMPT,
    VOCAB,
    chi_square_pvalue,
    exact_distribution,
    make_distribution_model,
    sampled_counts,
)
from tiny_models import make_model, reference_greedy, scale_deep_layers

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser, main
from selfspec.cli.args import engine_kwargs
from selfspec.core.sampling import SamplingParams
from selfspec.drafting.medusa.drafter import MedusaDrafter, MedusaHeads, build_candidate_tree, load_medusa_heads
from selfspec.errors import ConfigurationError, CorruptCheckpointError, ModelNotFoundError, UnsafeCheckpointError

HIDDEN, TINY_VOCAB = 32, 96  # tiny_models' sizes


def published_state_dict(num_heads: int, hidden: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the keys FasterDecoding/Medusa writes (one ResBlock per head)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        state[f"{i}.0.linear.weight"] = torch.randn(hidden, hidden, generator=gen) * 0.1
        state[f"{i}.0.linear.bias"] = torch.randn(hidden, generator=gen) * 0.1
        state[f"{i}.1.weight"] = torch.randn(vocab, hidden, generator=gen)
    return state


def write_published(folder, state, num_heads: int, pickle: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}
    (folder / "config.json").write_text(json.dumps(config))
    if pickle:
        torch.save(state, folder / "medusa_lm_head.pt")
    else:
        save_file(state, str(folder / "medusa_lm_head.safetensors"))
    return folder


def by_hand(state: dict[str, torch.Tensor], head: int, x: torch.Tensor) -> torch.Tensor:
    """Medusa-1's head maths written out: W2 (x + SiLU(W1 x + b1))."""
    inner = x @ state[f"{head}.0.linear.weight"].T + state[f"{head}.0.linear.bias"]
    return (x + torch.nn.functional.silu(inner)) @ state[f"{head}.1.weight"].T


@pytest.mark.parametrize("pickle", [False, True], ids=["safetensors", "pt"])
def test_loads_the_published_layout(tmp_path, pickle: bool) -> None:
    state = published_state_dict(3, HIDDEN, TINY_VOCAB)
    folder = write_published(tmp_path / "heads", state, 3, pickle=pickle)
    heads = load_medusa_heads(folder, allow_pickle=pickle, hidden_size=HIDDEN, vocab_size=TINY_VOCAB)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (3, 1, HIDDEN, TINY_VOCAB)
    x = torch.randn(5, HIDDEN)
    out = heads(x)  # [3, 5, vocab]
    for i in range(3):
        torch.testing.assert_close(out[i], by_hand(state, i, x))
    # and our own writer produces the same keys, which load back to the same heads
    heads.save(tmp_path / "again", dtype=torch.float32)
    again = load_medusa_heads(tmp_path / "again")
    torch.testing.assert_close(again(x), out)


def test_pickle_heads_need_allow_pickle(tmp_path) -> None:
    folder = write_published(tmp_path / "heads", published_state_dict(2, HIDDEN, TINY_VOCAB), 2, pickle=True)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        load_medusa_heads(folder)
    # through from_pretrained: refused by default, loaded with allow_pickle=True
    model_dir = tmp_path / "model"
    make_model("llama", dtype=torch.float32).save_pretrained(model_dir)
    with pytest.raises(UnsafeCheckpointError):
        SpeculativeEngine.from_pretrained(model_dir, drafter="medusa", medusa_heads=folder, device="cpu")
    engine = SpeculativeEngine.from_pretrained(
        model_dir, drafter="medusa", medusa_heads=folder, allow_pickle=True, device="cpu"
    )
    assert isinstance(engine.drafter, MedusaDrafter) and engine.drafter.heads.num_heads == 2


ARCHS = ["llama", "qwen2", "gemma2", "phi3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch: str) -> None:
    """Random published-layout heads (rejected) and lm-head-initialised heads: both exact."""
    model = make_model(arch, agreeing=False)
    scale_deep_layers(model, start=2, factor=0.3)
    prompt = list(range(10, 30))
    reference = reference_greedy(model, prompt, 40)
    random_heads = MedusaHeads(3, HIDDEN, TINY_VOCAB)
    random_heads.heads.load_state_dict(published_state_dict(3, HIDDEN, TINY_VOCAB, seed=1))
    lm_heads = MedusaHeads(3, HIDDEN, TINY_VOCAB)
    lm_heads.init_from_lm_head(model.lm_head)
    for heads in (random_heads, lm_heads):
        for num_draft in (1, 3, 8):
            engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=num_draft)
            out = engine.generate_ids(prompt, max_new_tokens=40)
            assert out.token_ids == reference, (heads, num_draft)
            assert out.stats.num_drafted > 0


def test_drafts_are_both_rejected_and_accepted() -> None:
    """The acceptance path runs: random heads are rejected; heads that agree are accepted.

    This tiny Gemma 2 (scaled-down deep layers) repeats its tokens often, so heads that copy
    the LM head (head ``i`` guesses the same token as the model) are often right.
    """
    model = make_model("gemma2", agreeing=True)
    prompt = list(range(10, 30))
    reference = reference_greedy(model, prompt, 60)
    rates = {}
    for name in ("random", "lm_head"):
        heads = MedusaHeads(3, HIDDEN, TINY_VOCAB)
        if name == "random":
            heads.heads.load_state_dict(published_state_dict(3, HIDDEN, TINY_VOCAB, seed=2))
        else:
            heads.init_from_lm_head(model.lm_head)
        out = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=3).generate_ids(
            prompt, max_new_tokens=60
        )
        assert out.token_ids == reference
        rates[name] = out.stats.acceptance_rate
    assert rates["random"] < 0.1 and rates["lm_head"] > 0.5, rates


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_chain_draft_is_the_heads_top1_on_the_last_verified_state(arch: str) -> None:
    """Drafts are the heads' top-1 on the final state that chose ``last_token``, after any acceptance."""
    model = make_model(arch)
    heads = MedusaHeads(3, HIDDEN, TINY_VOCAB).double()
    if arch == "llama":  # random heads: rejected
        heads.heads.load_state_dict(published_state_dict(3, HIDDEN, TINY_VOCAB))
    else:  # this model repeats itself: copies of its LM head are accepted
        heads.init_from_lm_head(model.lm_head)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=3)
    seen = []
    drafter = engine.drafter
    original = drafter.propose

    def spy(state, max_tokens):
        draft = original(state, max_tokens)
        normed = model.model.norm(state.last_hidden)[0, 0]  # [hidden]
        top1 = heads(normed).argmax(-1)[: len(draft)].tolist()
        seen.append((draft.tokens, top1, normed, state.position, list(state.token_ids)))
        return draft

    drafter.propose = spy
    out = engine.generate_ids(list(range(10, 20)), max_new_tokens=12)
    assert len(seen) >= 2 and all(tokens == top1 for tokens, top1, *_ in seen)
    # last_hidden is the model's own final state at position - 1: the one that chose last_token
    for _, _, normed, position, token_ids in seen:
        with torch.no_grad():
            full = model.model(torch.tensor([token_ids[:position]])).last_hidden_state[0, -1]
        torch.testing.assert_close(normed, full)
        assert int(model.lm_head(full).argmax()) == token_ids[position]
    assert len(out.token_ids) == 12
    if arch == "gemma2":
        assert out.stats.num_accepted > 3  # states after accepted drafts were checked too


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_tree_mode_through_the_engine_is_exact(arch: str) -> None:
    """tree_nodes with drafter='medusa' verifies the heads' candidate tree in one forward:
    greedy equals generate, and the state the heads read after a tree round is the model's own."""
    model = make_model(arch)
    heads = MedusaHeads(3, HIDDEN, TINY_VOCAB).double()
    heads.init_from_lm_head(model.lm_head)  # copies of the head: often accepted on these models
    prompt = list(range(10, 24))
    reference = reference_greedy(model, prompt, 30)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=3, tree_nodes=8)
    assert engine.drafter.tree and engine.drafter.tree_nodes == 8
    seen = []
    original = engine.drafter.propose

    def spy(state, max_tokens):
        draft = original(state, max_tokens)
        seen.append((draft, state.last_hidden[0, 0].clone(), state.position, list(state.token_ids)))
        return draft

    engine.drafter.propose = spy
    out = engine.generate_ids(prompt, max_new_tokens=30)
    assert out.token_ids == reference
    assert out.stats.num_accepted > 0
    assert any(draft.parents is not None and len(set(draft.parents)) < len(draft.parents) for draft, *_ in seen)
    for _, hidden, position, token_ids in seen:  # the final state at position - 1, after any accepted path
        with torch.no_grad():
            full = model.model(torch.tensor([token_ids[:position]])).last_hidden_state[0, -1]
        tol = 1e-10 if engine.runner.attn_implementation == "sdpa" else 1e-5  # eager: float32 softmax
        torch.testing.assert_close(model.model.norm(hidden), full, rtol=tol, atol=tol)
    # a random-headed tree is rejected and still exact
    rejected = MedusaHeads(3, HIDDEN, TINY_VOCAB).double()
    rejected.heads.load_state_dict({k: v.double() for k, v in published_state_dict(3, HIDDEN, TINY_VOCAB).items()})
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=rejected, num_draft_tokens=3, tree_nodes=8)
    assert engine.generate_ids(prompt, max_new_tokens=30).token_ids == reference


@pytest.mark.slow
def test_tree_mode_sampling_follows_target() -> None:
    """Sampled candidate trees (i.i.d. siblings per head) pass the exact-distribution test."""
    model = make_distribution_model()
    heads = MedusaHeads(2, 16, VOCAB)
    heads.init_from_lm_head(model.lm_head)
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=2, tree_nodes=5)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    out = engine.generate_ids(PROMPT, max_new_tokens=3, temperature=1.0, seed=0)
    assert out.stats.num_drafted > 0


def test_candidate_tree_structure() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    # greedy: best-first paths over the heads' top-k
    tree = build_candidate_tree(logits, SamplingParams(), None, max_nodes=10, top_k=3)
    assert len(tree.tokens) == len(tree.parents) == 10 and tree.draft_probs is None
    top = logits.topk(3, dim=-1).indices.tolist()
    depth = []
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i  # topological order
        depth.append(0 if parent == -1 else depth[parent] + 1)
        assert tree.tokens[i] in top[depth[i]]  # each node is a top-k pick of its depth's head
    assert tree.tokens[0] == top[0][0] and tree.parents[0] == -1  # the most probable path starts it
    siblings = {}
    for i, parent in enumerate(tree.parents):
        siblings.setdefault(parent, []).append(tree.tokens[i])
    assert all(len(v) == len(set(v)) for v in siblings.values())  # no duplicate greedy siblings
    # sampling: every node's row is its head's processed distribution, and the token is in its support
    params = SamplingParams(0.8, top_k=5)
    tree = build_candidate_tree(logits, params, torch.Generator().manual_seed(1), max_nodes=12, top_k=4)
    assert tree.draft_probs is not None and tree.draft_probs.shape == (len(tree.tokens), 50)
    depth = []
    for i, parent in enumerate(tree.parents):
        assert -1 <= parent < i
        depth.append(0 if parent == -1 else depth[parent] + 1)
        torch.testing.assert_close(
            tree.draft_probs[i],
            torch.softmax(
                torch.where(
                    logits[depth[i]] >= logits[depth[i]].topk(5).values[-1], logits[depth[i]] / 0.8, -torch.inf
                ),
                -1,
            ),
        )
        assert tree.draft_probs[i, tree.tokens[i]] > 0
    assert depth.count(0) == 4 and max(depth) >= 1
    assert build_candidate_tree(logits, SamplingParams(), None, max_nodes=0).tokens == []


def test_tree_mode_drafter_proposes_a_tree() -> None:
    model = make_model("llama")
    heads = MedusaHeads(2, HIDDEN, TINY_VOCAB).double()
    drafter = MedusaDrafter(heads, tree=True, tree_nodes=6, top_k=2)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads)
    from selfspec.drafting import DecodeState

    hidden = engine.runner.run_layers(
        engine.runner.embed(torch.tensor([[5, 6, 7]])), 0, 6, torch.arange(3), engine.runner.new_cache(16)
    )
    state = DecodeState(engine.runner, engine.runner.new_cache(16), 3, 9, [5, 6, 7, 9], SamplingParams(), None)
    state.last_hidden = hidden[:, -1:]
    draft = drafter.propose(state, 4)
    assert draft.parents is not None and len(draft.tokens) == 6
    assert "tree=True" in repr(drafter)


@pytest.mark.slow
def test_sampling_follows_target() -> None:
    """Heads that are partly right: drafts accepted and rejected; the text's distribution is exact."""
    model = make_distribution_model()
    heads = MedusaHeads(2, 16, VOCAB)
    heads.init_from_lm_head(model.lm_head)
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=heads, num_draft_tokens=2)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    rates = [
        engine.generate_ids(PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats.acceptance_rate for s in range(40)
    ]
    assert 0.1 < sum(rates) / len(rates) < 0.9


def test_train_medusa_cli_end_to_end(tmp_path, capsys, monkeypatch) -> None:
    """train-medusa on a tiny model folder; drafter='medusa' then finds the heads by itself."""
    from selfspec.drafting.medusa.drafter import medusa_heads_folder

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model_dir = tmp_path / "model"
    model = make_model("llama", dtype=torch.float32)
    model.save_pretrained(model_dir)
    code = main(
        [
            "train-medusa", "--model", str(model_dir), "--heads", "2", "--steps", "3", "--batch-size", "4",
            "--micro-batch", "2", "--seed-tokens", "3", "--new-tokens", "8", "--threads", "1",
        ]
    )  # fmt: skip
    assert code == 0
    assert "saved to" in capsys.readouterr().out
    saved = medusa_heads_folder(str(model_dir))  # the user cache, not the model's folder
    assert saved.is_relative_to(tmp_path / "cache") and not (model_dir / "medusa").exists()
    config = json.loads((saved / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 1
    assert json.loads((saved / "medusa_training.json").read_text())["steps_done"] == 3
    engine = SpeculativeEngine.from_pretrained(model_dir, drafter="medusa", device="cpu", dtype="float32")
    assert engine.drafter.heads.num_heads == 2
    prompt = list(range(10, 25))
    assert engine.generate_ids(prompt, max_new_tokens=20).token_ids == reference_greedy(engine.model, prompt, 20)
    # bad input: a clear message and exit code 2, no traceback
    assert main(["train-medusa", "--model", str(model_dir), "--heads", "0", "--steps", "1"]) == 2
    assert "heads >= 1" in capsys.readouterr().err
    assert main(["train-medusa", "--model", str(tmp_path / "missing")]) == 2
    assert "no model folder" in capsys.readouterr().err


def test_cli_and_adapters_pass_medusa_heads() -> None:
    args = build_parser().parse_args(["generate", "-m", "m", "--drafter", "medusa", "--medusa-heads", "h/", "hi"])
    assert engine_kwargs(args)["drafter"] == "medusa" and engine_kwargs(args)["medusa_heads"] == "h/"
    from selfspec.serving.engines import engine_args

    class Fields:
        drafter = "medusa"
        medusa_heads = "h/"

    assert engine_args(Fields())["medusa_heads"] == "h/"


def test_bad_input_is_refused_clearly(tmp_path) -> None:
    model = make_model("llama")
    with pytest.raises(ModelNotFoundError, match="no Medusa heads folder"):
        SpeculativeEngine(model, drafter="medusa", medusa_heads=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        load_medusa_heads(tmp_path / "empty")
    wrong = write_published(tmp_path / "wide", published_state_dict(2, 48, TINY_VOCAB), 2)
    with pytest.raises(ConfigurationError, match=r"hidden states of size 48.*hidden size is 32"):
        SpeculativeEngine(model, drafter="medusa", medusa_heads=wrong)
    vocab = write_published(tmp_path / "vocab", published_state_dict(2, HIDDEN, 50), 2)
    with pytest.raises(ConfigurationError, match="predict 50 tokens"):
        SpeculativeEngine(model, drafter="medusa", medusa_heads=vocab)
    with pytest.raises(ConfigurationError, match="only used with drafter='medusa'"):
        SpeculativeEngine(model, medusa_heads=wrong, drafter="early_exit")
    with pytest.raises(ConfigurationError, match="train-medusa"):
        SpeculativeEngine(model, drafter="medusa")  # no heads beside a model built in memory
    with pytest.raises(ConfigurationError, match="does not fit"):
        SpeculativeEngine(model, drafter="medusa", medusa_heads=MedusaHeads(2, 48, TINY_VOCAB))
    # the model is still usable afterwards
    prompt = list(range(10, 20))
    good = write_published(tmp_path / "good", published_state_dict(2, HIDDEN, TINY_VOCAB), 2)
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=good)
    assert engine.generate_ids(prompt, max_new_tokens=10).token_ids == reference_greedy(model, prompt, 10)
    assert "MedusaDrafter(num_heads=2)" in repr(engine)


#: tau (tokens per verify step) of the shipped demo heads below which the test fails: measured
#: 2.09 on these 4 prompts (1.86-2.60 each), 2.15 on all 8 (medusa_training.json); plain decoding
#: and zero heads give 1.0
SHIPPED_TAU_BOUND = 1.8


def test_shipped_demo_heads_are_accepted_on_heldout_text(demo_engine) -> None:
    """drafter='medusa' without medusa_heads= loads the demo model's heads; they draft well."""
    paragraphs = json.loads((Path(__file__).parents[1] / "data" / "heldout_austen.json").read_text())["paragraphs"]
    model, tokenizer = demo_engine.model, demo_engine.tokenizer
    medusa = SpeculativeEngine(model, tokenizer, drafter="medusa", num_draft_tokens=3)
    plain = SpeculativeEngine(model, tokenizer, drafter="none")
    assert isinstance(medusa.drafter, MedusaDrafter)
    taus = []
    for paragraph in paragraphs[:4]:
        prompt = tokenizer(paragraph)["input_ids"][:48]
        out = medusa.generate_ids(prompt, max_new_tokens=40)
        assert out.token_ids == plain.generate_ids(prompt, max_new_tokens=40).token_ids
        taus.append(out.stats.mean_accepted_length)
    assert sum(taus) / len(taus) > SHIPPED_TAU_BOUND, taus


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("truncated safetensors", r"medusa_lm_head\.safetensors is not a readable safetensors file: it is truncated"),
        ("a safetensors header only", r"medusa_lm_head\.safetensors is not a readable safetensors file"),
        ("garbage safetensors", r"medusa_lm_head\.safetensors is not a readable safetensors file"),
        ("truncated pickle", r"medusa_lm_head\.pt is not a readable PyTorch file: it is truncated"),
        ("non-JSON config", r"config\.json is not valid JSON"),
        ("truncated config", r"config\.json is not valid JSON"),
        ("config not UTF-8", r"config\.json is not valid JSON"),
        ("config a JSON list", r"config\.json is not a JSON object \(got list\)"),
    ],
)
def test_corrupt_heads_name_the_file_and_what_to_do(tmp_path: Path, damage: str, match: str) -> None:
    """Issue 44: a corrupt Medusa file is a CorruptCheckpointError naming it, never a raw SafetensorError."""
    folder = write_published(
        tmp_path / "heads", published_state_dict(2, HIDDEN, TINY_VOCAB), 2, pickle="pickle" in damage
    )
    weights, config = folder / "medusa_lm_head.safetensors", folder / "config.json"
    if damage == "truncated safetensors":
        _truncate(weights)
    elif damage == "a safetensors header only":
        _truncate(weights, keep=0.0)
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00")
    elif damage == "garbage safetensors":
        weights.write_bytes(b"\x00\xff" * 300)
    elif damage == "truncated pickle":
        _truncate(folder / "medusa_lm_head.pt")
    elif damage == "non-JSON config":
        config.write_text("medusa_num_heads = 2\n")
    elif damage == "truncated config":
        _truncate(config)
    elif damage == "config not UTF-8":
        config.write_bytes(b'{"medusa_num_heads": "\xff\xfe"}')
    elif damage == "config a JSON list":
        config.write_text("[2, 1]")
    model = make_model("llama")
    with pytest.raises(CorruptCheckpointError, match=match) as caught:
        load_medusa_heads(folder, allow_pickle=True)
    message = str(caught.value)
    assert str(folder) in message and "selfspec train-medusa" in message and "\n" not in message
    if "pickle" not in damage:  # through the engine, as the CLI and adapters load (a pickle needs from_pretrained)
        with pytest.raises(CorruptCheckpointError, match=match):
            SpeculativeEngine(model, drafter="medusa", medusa_heads=folder)
    # the same folder, repaired, loads and decodes exactly
    write_published(folder, published_state_dict(2, HIDDEN, TINY_VOCAB), 2)
    prompt = list(range(10, 20))
    engine = SpeculativeEngine(model, drafter="medusa", medusa_heads=folder)
    assert engine.generate_ids(prompt, max_new_tokens=8).token_ids == reference_greedy(model, prompt, 8)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"medusa_num_heads": "two"}, r"medusa_num_heads='two' is invalid; it must be an int >= 1"),
        ({"medusa_num_heads": 0}, r"medusa_num_heads=0 is invalid"),
        ({"medusa_num_heads": 2.0}, r"medusa_num_heads=2\.0 is invalid"),
        ({"medusa_num_heads": True}, r"medusa_num_heads=True is invalid"),
        ({"medusa_num_heads": 2, "medusa_num_layers": -1}, r"medusa_num_layers=-1 is invalid; it must be an int >= 0"),
    ],
)
def test_bad_config_values_name_the_file_and_field(tmp_path: Path, config: dict[str, object], match: str) -> None:
    folder = write_published(tmp_path / "heads", published_state_dict(2, HIDDEN, TINY_VOCAB), 2)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigurationError, match=match) as caught:
        load_medusa_heads(folder)
    assert str(folder / "config.json") in str(caught.value)


def test_cli_reports_corrupt_heads_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "model"
    make_model("llama", dtype=torch.float32).save_pretrained(model_dir)
    folder = write_published(tmp_path / "heads", published_state_dict(2, HIDDEN, TINY_VOCAB), 2)
    _truncate(folder / "medusa_lm_head.safetensors")
    command = ["generate", "--model", str(model_dir), "--drafter", "medusa", "--medusa-heads", str(folder)]
    assert main([*command, "--no-calibrate", "--max-new-tokens", "4", "--threads", "1", "hello"]) == 2
    err = capsys.readouterr().err
    assert "medusa_lm_head.safetensors is not a readable safetensors file" in err
    assert "Traceback" not in err and "SafetensorError" not in err.split("(")[0]
