"""Exit adapters: trained drafting help for stock models that never changes the target's text.

Exactness is checked against transformers' greedy ``generate`` in float64, and sampling against
the exact distribution (the chi-square machinery of ``test_core_acceptance``). The adapters used
for exactness are deliberately far from the identity, so a drafter or verifier that let the
adapter touch the target's path would change the text.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import make_model, reference_greedy
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.cli import build_parser, main
from selfspec.cli.args import engine_kwargs
from selfspec.core.sampling import SamplingParams
from selfspec.drafting import DecodeState, EarlyExitDrafter
from selfspec.drafting.exit_adapter.adapter import ExitAdapter, ExitAdapterConfig, exit_adapter_path, load_exit_adapter
from selfspec.drafting.exit_adapter.train import AdapterTrainConfig, train_exit_adapter
from selfspec.errors import ConfigurationError

PROMPTS = ([5, 9, 14, 3, 27, 41, 8], list(range(10, 30)))


def random_adapter(model, exit_layer: int, scale: float = 1.0, seed: int = 0) -> ExitAdapter:
    """An adapter with random weights (``down`` non-zero): it changes the drafts."""
    torch.manual_seed(seed)
    config = ExitAdapterConfig(
        exit_layer=exit_layer,
        hidden_size=model.config.hidden_size,
        rank=8,
        num_layers=model.config.num_hidden_layers,
        vocab_size=model.config.vocab_size,
        model_type=model.config.model_type,
    )
    adapter = ExitAdapter(config)
    with torch.no_grad():
        adapter.down.weight.normal_(0.0, scale)
    return adapter.to(model.dtype)


def drafts(model, exit_adapter: ExitAdapter | None, prompt: list[int], exit_layer: int = 2) -> list[int]:
    """The first round's greedy draft of the early exit, with or without an adapter."""
    engine = SpeculativeEngine(model, exit_layer=exit_layer, num_draft_tokens=6, drafter="early_exit")
    adapter = engine.runner
    cache = adapter.new_cache(64)
    ids = torch.tensor([prompt[:-1]])
    adapter.run_layers(adapter.embed(ids), 0, adapter.num_layers, torch.arange(len(prompt) - 1), cache)
    state = DecodeState(adapter, cache, len(prompt) - 1, prompt[-1], list(prompt), SamplingParams(0.0), None)
    return EarlyExitDrafter(exit_layer, exit_adapter=exit_adapter).propose(state, 6).tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_greedy_with_an_exit_adapter_equals_generate(arch: str) -> None:
    model = make_model(arch)
    for scale in (0.3, 30.0):  # a mild adapter, and one that drafts garbage
        adapter = random_adapter(model, exit_layer=2, scale=scale)
        for drafter in ("early_exit", "hybrid"):
            engine = SpeculativeEngine(model, drafter=drafter, exit_adapter=adapter, num_draft_tokens=3)
            assert engine.exit_layer == 2
            for prompt in PROMPTS:
                out = engine.generate_ids(prompt, max_new_tokens=24)
                assert out.token_ids == reference_greedy(model, prompt, 24), (arch, scale, drafter)


def test_the_adapter_changes_the_drafts_only() -> None:
    model = make_model("llama")
    prompt = PROMPTS[1]
    plain = drafts(model, None, prompt)
    garbage = drafts(model, random_adapter(model, 2, scale=30.0), prompt)
    identity = drafts(model, ExitAdapter(ExitAdapterConfig(exit_layer=2, hidden_size=32)).double(), prompt)
    assert identity == plain  # an untrained adapter (zero output projection) is the plain exit
    assert garbage != plain  # the adapter is really used for the draft logits
    engine = SpeculativeEngine(
        model, exit_adapter=random_adapter(model, 2, scale=30.0), num_draft_tokens=3, drafter="early_exit"
    )
    base = SpeculativeEngine(model, exit_layer=2, num_draft_tokens=3, drafter="early_exit")
    with_adapter = engine.generate_ids(prompt, max_new_tokens=24)
    without = base.generate_ids(prompt, max_new_tokens=24)
    assert with_adapter.token_ids == without.token_ids
    assert with_adapter.stats.mean_accepted_length < without.stats.mean_accepted_length  # garbage drafts


@pytest.mark.slow
def test_sampling_with_an_exit_adapter_follows_the_target() -> None:
    import test_core_acceptance as dist

    # the distribution test's model: an 8-token vocabulary, partly agreeing early exits
    model = dist.make_distribution_model()
    adapter = random_adapter(model, exit_layer=1, scale=0.5, seed=3)
    params = SamplingParams(1.0)
    engine = SpeculativeEngine(model, exit_adapter=adapter, num_draft_tokens=2, drafter="early_exit")
    counts = dist.sampled_counts(engine, params)
    assert dist.chi_square_pvalue(counts, dist.exact_distribution(model, params)) > 1e-3
    rates = [
        engine.generate_ids(dist.PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats.acceptance_rate
        for s in range(40)
    ]
    assert 0.1 < sum(rates) / len(rates) < 0.95  # both acceptance and rejection happen


def test_training_raises_agreement_and_round_trips(tmp_path) -> None:
    model = make_model("llama", agreeing=False, dtype=torch.float32, initializer_range=0.2)
    config = AdapterTrainConfig(exit_layer=2, steps=120, rank=16, sequences=32, eval_sequences=8, seq_len=32)
    result = train_exit_adapter(model, config, progress=False)
    assert result.agreement_after > result.agreement_before + 0.03, result.summary()
    assert result.kl_last < result.kl_first
    saved = result.adapter.save(tmp_path / "adapter")
    loaded = load_exit_adapter(saved)
    hidden = torch.randn(1, 5, 32)
    assert torch.equal(loaded(hidden), result.adapter(hidden))
    training = json.loads((saved / "adapter_config.json").read_text())["training"]
    assert training["steps"] == 120 and training["agreement_after"] == round(result.agreement_after, 4)
    assert not any(p.requires_grad for p in model.parameters())  # the model stayed frozen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-stock-model")
    tokenizer = make_tokenizer()
    model = make_model("llama", agreeing=False, dtype=torch.float32, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_train_adapter_cli_end_to_end(model_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "user.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    args = ["train-adapter", "--model", str(model_dir), "--exit-layer", "2", "--steps", "6"]
    assert main([*args, "--sequences", "8", "--seq-len", "16", "--data", str(text)]) == 0
    assert "saved to" in capsys.readouterr().out
    folder = exit_adapter_path(str(model_dir))
    assert folder is not None and folder.is_relative_to(tmp_path / "cache")  # the user cache, not the model folder
    assert not (model_dir / "exit_adapter").exists()
    adapter = load_exit_adapter(folder)
    assert adapter.exit_layer == 2 and adapter.config.training["user_text_windows"] > 0
    # "auto" finds it beside the model; the text is the model's own
    engine = SpeculativeEngine.from_pretrained(
        model_dir, dtype="float64", exit_adapter="auto", num_draft_tokens=3, drafter="early_exit"
    )
    assert engine.exit_adapter is not None and engine.exit_layer == 2
    assert "exit_adapter=ExitAdapter(exit_layer=2" in repr(engine)
    prompt = list(range(10, 25))
    assert engine.generate_ids(prompt, max_new_tokens=16).token_ids == reference_greedy(engine.model, prompt, 16)
    # "auto" leaves a saved adapter out where it does not apply; None never loads one
    assert SpeculativeEngine(engine.model, exit_layer=3, exit_adapter="auto", drafter="early_exit").exit_adapter is None
    assert SpeculativeEngine(engine.model, drafter="prompt_lookup", exit_adapter="auto").exit_adapter is None
    assert SpeculativeEngine(engine.model, drafter="early_exit").exit_adapter is None
    # the CLI's engine option
    parsed = build_parser().parse_args(["generate", "--model", str(model_dir), "--exit-adapter", str(folder), "hi"])
    assert engine_kwargs(parsed)["exit_adapter"] == str(folder)
    out_dir = tmp_path / "cli-out"
    assert (
        main(["generate", "--model", str(model_dir), "--exit-adapter", str(folder), "--max-new-tokens", "4", "hi"]) == 0
    )
    assert main(["generate", "--model", str(model_dir), "--exit-adapter", str(out_dir), "hi"]) == 2
    assert "no exit adapter at" in capsys.readouterr().err


def test_default_folders_follow_the_calibration(tmp_path, monkeypatch) -> None:
    """Where adapters are written and looked for: tests/unit/test_artifacts.py."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    assert exit_adapter_path("org/model") == tmp_path / "cache" / "exit_adapters" / "org--model"
    assert exit_adapter_path(None) is None
    # "auto" for a model without a saved adapter (or without a name) is no adapter, not an error
    model = make_model("llama")
    assert SpeculativeEngine(model, exit_adapter="auto", drafter="early_exit").exit_adapter is None


def test_bad_adapters_are_clear_errors_and_the_engine_stays_usable(tmp_path) -> None:
    model = make_model("llama")
    prompt = PROMPTS[0]
    with pytest.raises(ConfigurationError, match="no exit adapter at"):
        SpeculativeEngine(model, exit_adapter=tmp_path / "missing", drafter="early_exit")
    wide = make_model("llama", hidden_size=48)
    with pytest.raises(ConfigurationError, match="hidden size 48 != the model's 32"):
        SpeculativeEngine(model, exit_adapter=random_adapter(wide, 2), drafter="early_exit")
    with pytest.raises(ConfigurationError, match="exit layer 7 is outside"):
        SpeculativeEngine(
            model, exit_adapter=random_adapter(make_model("llama", num_hidden_layers=8), 7), drafter="early_exit"
        )
    with pytest.raises(ConfigurationError, match="trained for exit layer 2, not 3"):
        SpeculativeEngine(model, exit_layer=3, exit_adapter=random_adapter(model, 2), drafter="early_exit")
    with pytest.raises(ConfigurationError, match="only by the early_exit, hybrid and auto drafters"):
        SpeculativeEngine(model, drafter="prompt_lookup", exit_adapter=random_adapter(model, 2))
    with pytest.raises(ConfigurationError, match="exit_adapter must be None"):
        SpeculativeEngine(model, exit_adapter=42, drafter="early_exit")  # type: ignore[arg-type]
    broken = random_adapter(model, 2).save(tmp_path / "broken")
    (broken / "adapter_config.json").write_text('{"format": "something else"}', encoding="utf-8")
    with pytest.raises(ConfigurationError, match="unreadable exit adapter"):
        SpeculativeEngine(model, exit_adapter=broken, drafter="early_exit")
    # the model and a fresh engine are unaffected
    engine = SpeculativeEngine(
        model, exit_adapter=random_adapter(model, 2).save(tmp_path / "good"), drafter="early_exit"
    )
    assert engine.generate_ids(prompt, max_new_tokens=12).token_ids == reference_greedy(model, prompt, 12)


def test_adapter_fields_reach_the_engine_arguments() -> None:
    from selfspec.serving.engines import engine_args

    langchain = pytest.importorskip("langchain_selfspec")
    llama_index = pytest.importorskip("llama_index.llms.selfspec")
    assert engine_args(langchain.ChatSpeculative(exit_adapter="/a", drafter="early_exit"))["exit_adapter"] == "/a"
    assert engine_args(llama_index.SpeculativeLLM(exit_adapter="/b", drafter="early_exit"))["exit_adapter"] == "/b"
