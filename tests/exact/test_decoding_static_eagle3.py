"""EAGLE-3 heads in the static round (issue 40): the verify hands back the tapped layers' inputs.

A head in vLLM's ``speculators`` layout, written for a tiny Llama (random, and trained for a few
seconds on the target's greedy text so that its chains land and the accepted lengths vary), drafts
chains through the static round's compiled head step (its draft vocabulary mapped to the target's
on the device) while the fixed-width verify returns the states entering the head's feature layers.
Greedy text equals transformers' ``generate`` in float32 through dynamo's trace
(``backend="eager"``) and inductor's code; a round reads the device once; 50+ rounds of varying
accepted lengths never recompile; sampled chains follow the target's distribution (chi-square);
SmolLM2-135M with a new head exported to that layout gives ``generate``'s text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_decoding_static_round import COPIES_PER_CALL, RANDOM, REPEATED, static_engine
from test_decoding_sync_budget import PER_CALL, count
from test_drafting_eagle_eagle3 import (
    draft_vocab,
    random_eagle3,
    speculators_config,
    tapped_states,
    train_eagle3,
    write,
)
from tiny_models import make_model, reference_greedy

from selfspec.drafting import StaticDrafting
from selfspec.drafting.eagle.eagle3 import Eagle3Head
from selfspec.modeling.static_step import WIDTHS

LAYERS = [1, 3, 6]  # the 6-layer tiny target: 6 is its last layer's output (before the final norm)
SHALLOW = [0, 1, 2]  # the 2-layer target of the inductor test
VERIFY = "greedy+taps1,3,6"


def folders(tmp: Path, layers: list[int], **model: Any) -> tuple[Path, Path]:
    """A trained and a random head for the float64 twin of ``make_model("llama", **model)``, speculators layout."""
    twin = make_model("llama", agreeing=True, **model)  # float64: the float32 model's weights, rounded
    trained = write(tmp / "trained", train_eagle3(twin, layers), speculators_config(twin, layers, 80, False))
    weights = random_eagle3(twin, layers, draft_vocab(twin, 64), seed=3)
    random = write(tmp / "random", weights, speculators_config(twin, layers, 64, True))
    return trained, random


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return folders(tmp_path_factory.mktemp("static_eagle3"), LAYERS)


def test_eagle3_chains_run_in_the_static_round_and_equal_generate(heads: tuple[Path, Path]) -> None:
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    for folder in heads:
        engine = static_engine(model, "eagle", eagle_head=folder, num_draft_tokens=4)
        drafter = engine.drafter
        assert isinstance(drafter.head, Eagle3Head) and drafter.feature_layers == tuple(LAYERS)  # type: ignore[attr-defined]
        assert drafter.static_drafting is StaticDrafting.DEVICE
        accepted = 0
        for prompt in (REPEATED, RANDOM):
            out = engine.generate_ids(prompt, max_new_tokens=40)
            assert out.token_ids == reference_greedy(model, prompt, 40), folder.name
            accepted += out.stats.num_accepted
        assert engine.static_round is not None
        kinds = {kind for kind, _, _ in engine.static_round.step.compiled}
        assert kinds == {VERIFY}, kinds  # every round's verify handed back the taps
        assert drafter.compiled_steps and drafter.backend == "eager"  # type: ignore[attr-defined]
        if folder.name == "trained":
            assert accepted > 10, accepted  # its chains ran and landed


def test_the_static_verify_hands_over_the_tapped_states(heads: tuple[Path, Path]) -> None:
    """Every state the head fuses is the state entering the named layers at that position, in that order."""
    model = make_model("llama", agreeing=True, dtype=torch.float64)
    engine = static_engine(model, "eagle", eagle_head=heads[0], num_draft_tokens=3)
    head = engine.drafter.head  # type: ignore[attr-defined]
    handed: list[torch.Tensor] = []
    fuse = head.target_features

    def spy(states: torch.Tensor) -> torch.Tensor:
        handed.append(states.detach().clone())
        return fuse(states)

    head.target_features = spy
    out = engine.generate_ids(RANDOM, max_new_tokens=30)
    assert out.token_ids == reference_greedy(model, RANDOM, 30)
    states = torch.cat(handed, dim=1)  # [1, n, 3H]: every committed position once, in order
    full = torch.tensor([[*RANDOM, *out.token_ids]])
    assert states.shape[1] >= len(RANDOM) + len(out.token_ids) - 5 and states.shape[-1] == 3 * model.config.hidden_size
    expected = tapped_states(model, full, LAYERS)[:, : states.shape[1]]
    torch.testing.assert_close(states, expected, rtol=1e-9, atol=1e-9)
    swapped = torch.cat(expected.chunk(3, dim=-1)[::-1], dim=-1)  # the order matters: the test can fail
    assert (swapped - states).abs().max() > 1e-3
    assert out.stats.num_accepted > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_host_read_per_round(heads: tuple[Path, Path], temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    engine = static_engine(model, "eagle", eagle_head=heads[0], num_draft_tokens=4)
    assert engine.static_round is not None
    # the counter is a dispatch mode, which dynamo refuses: the same round with its steps run eagerly
    engine.static_round.step.backend = None
    engine.drafter.compile_device_chain(None)
    keywords: dict[str, Any] = {"temperature": temperature, "seed": 3} if temperature else {}
    engine.generate_ids(REPEATED, max_new_tokens=40, **keywords)
    out, counter = count(engine, REPEATED, monkeypatch, **keywords)
    if not temperature:
        assert out.token_ids == reference_greedy(model, REPEATED, 40)
    rounds = out.stats.target_forwards - 1
    assert out.stats.num_drafted > 0
    assert counter.reads <= rounds + PER_CALL, (counter.reads, rounds)
    assert counter.copies <= COPIES_PER_CALL, (counter.copies, rounds)  # the catch-up's tokens never left the device


@pytest.mark.parametrize("drafter", ["eagle", "eagle_hybrid"])
def test_eagle3_rounds_never_recompile(heads: tuple[Path, Path], drafter: str) -> None:
    """The tapped verify steps and the head's step, traced by dynamo: 50+ rounds of varying lengths, no recompile.

    The head's own chains land one token at most (trained teacher-forced, it never saw its own
    features fed back); with prompt lookup (``eagle_hybrid``: host chains, the head drafting where
    nothing repeats) the copies land at every length.
    """
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    drafts = 4 if drafter == "eagle" else 2  # copies land whole: shorter ones make 50+ rounds
    engine = static_engine(model, drafter, eagle_head=heads[0], num_draft_tokens=drafts)
    assert engine.static_round is not None
    prompt = [*RANDOM, *REPEATED]
    new_tokens = 160
    engine.static_round.prepare(len(prompt), new_tokens, drafter=engine.drafter)  # the tapped verify, every width
    engine.generate_ids(RANDOM, max_new_tokens=10)  # traces the head's step for the cache prepare() sized
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(model, prompt, new_tokens)
    assert out.stats.target_forwards - 1 >= 50
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for n in histogram if n) >= (2 if drafter == "eagle" else 3), histogram
    assert {kind for kind, _, _ in engine.static_round.step.compiled} == {VERIFY}


@pytest.mark.slow
def test_inductor_compiled_eagle3_rounds_equal_generate_and_never_recompile(tmp_path: Path) -> None:
    """inductor's code for a 2-layer float32 Llama and its EAGLE-3 head: ``generate``'s text, no recompile."""
    trained, _ = folders(tmp_path, SHALLOW, num_hidden_layers=2)
    model = make_model("llama", agreeing=True, dtype=torch.float32, num_hidden_layers=2)
    engine = static_engine(model, "eagle", eagle_head=trained, num_draft_tokens=4, compile="inductor")
    assert engine.static_round is not None
    prompt = [*RANDOM, *REPEATED]
    new_tokens = 160
    step = engine.static_round.step
    step.prepare(len(prompt) + new_tokens + WIDTHS[-1], widths=(1, 2, 3, 5), feature_layers=tuple(SHALLOW))
    engine.generate_ids(RANDOM, max_new_tokens=10)  # compiles the head's step for the cache prepare() sized
    drafter = engine.drafter
    assert drafter.compiled_steps and drafter.backend == "inductor"  # type: ignore[attr-defined]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(model, prompt, new_tokens)
    assert out.stats.target_forwards - 1 >= 50
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for n in histogram if n) >= 2, histogram  # the head's chains land one token at most
    assert {kind for kind, _, _ in step.compiled} == {"greedy+taps0,1,2"}
    assert len(drafter.compiled_steps) == 1  # type: ignore[attr-defined]


@pytest.mark.slow
def test_smollm2_with_an_eagle3_head_in_the_speculators_layout(smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2-135M (float32) and a new EAGLE-3 head (taps 2, 15, 27), exported and loaded back: ``generate``'s text."""
    from selfspec import SpeculativeEngine
    from selfspec.drafting.eagle.eagle3 import default_feature_layers, new_eagle3_head
    from selfspec.drafting.eagle.export import export_eagle
    from selfspec.modeling.loading import load_model_and_tokenizer

    model, tokenizer, _ = load_model_and_tokenizer(smollm2_path, dtype="float32", device="cpu")
    torch.manual_seed(0)
    layers = tuple(default_feature_layers(model.config.num_hidden_layers))
    head = new_eagle3_head(model, layers, torch.arange(0, model.config.vocab_size, 7))  # a 7x smaller draft vocabulary
    folder = export_eagle(model, head, tmp_path / "head", dtype=torch.float32)
    engine = SpeculativeEngine(
        model, tokenizer, drafter="eagle", eagle_head=folder, num_draft_tokens=3, calibration={}, compile="eager"
    )
    assert isinstance(engine.drafter.head, Eagle3Head) and engine.drafter.static_drafting is StaticDrafting.DEVICE  # type: ignore[attr-defined]
    prompt = tokenizer("The committee met on Tuesday to review the budget. The budget covers")["input_ids"]
    out = engine.generate_ids(prompt, max_new_tokens=24)
    assert out.token_ids == reference_greedy(model, prompt, 24)
    assert out.stats.num_drafted > 0 and out.stats.target_forwards > 1
    assert engine.static_round is not None
    assert {kind for kind, _, _ in engine.static_round.step.compiled} == {"greedy+taps2,15,27"}  # served there


@pytest.mark.slow
def test_sampling_in_the_static_round_follows_the_target_distribution(tmp_path: Path) -> None:
    """Chi-square over every 3-token continuation of an 8-token model: a random EAGLE-3 head's sampled chains."""
    from test_core_acceptance import PROMPT as DIST_PROMPT
    from test_core_acceptance import chi_square_pvalue, exact_distribution, make_distribution_model, sampled_counts

    from selfspec.core.sampling import SamplingParams

    model = make_distribution_model()
    layers = [1, 2, 4]
    weights = random_eagle3(model, layers, torch.tensor([0, 1, 3, 4, 6, 7]), seed=4)
    folder = write(tmp_path / "dist", weights, speculators_config(model, layers, 6, True))
    engine = static_engine(model, "eagle", eagle_head=folder, num_draft_tokens=2)
    params = SamplingParams(1.0)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    assert engine.static_round is not None
    assert {kind for kind, _, _ in engine.static_round.step.compiled} == {"forward+taps1,2,4"}  # served there
    stats = [engine.generate_ids(DIST_PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats for s in range(30)]
    assert sum(s.num_accepted for s in stats) > 0 and sum(s.num_drafted - s.num_accepted for s in stats) > 0
