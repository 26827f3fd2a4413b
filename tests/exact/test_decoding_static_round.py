"""The static round (issue 26): fixed widths, acceptance on the device, one host read per round, compiled.

Greedy text equals transformers' ``generate`` through the traced steps (dynamo, ``fullgraph=True``,
``backend="eager"``: every graph break or recompile shows, without code generation) and through
inductor's compiled code; 50 rounds of varying accepted lengths run with
``torch._dynamo.config.error_on_recompile``; sampling follows the target's distribution
(chi-square over every continuation of an 8-token model, and a lossy acceptance fails it); a round
reads the device once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_core_acceptance import PROMPT as DIST_PROMPT
from test_core_acceptance import chi_square_pvalue, exact_distribution, make_distribution_model, sampled_counts
from test_decoding_sync_budget import PER_CALL, count
from tiny_models import make_model, reference_greedy
from torch.utils._python_dispatch import TorchDispatchMode

import selfspec.decoding.static_round as static_round
from selfspec import SpeculativeEngine
from selfspec.core.sampling import SamplingParams
from selfspec.drafting import DecodeState, DeviceDraft, Draft, Drafter
from selfspec.drafting.eagle.drafter import EagleDrafter
from selfspec.drafting.eagle.head import EagleHead
from selfspec.drafting.exit_adapter.adapter import ExitAdapter, ExitAdapterConfig
from selfspec.errors import ConfigurationError
from selfspec.modeling.static_step import WIDTHS, bucket_for, width_for

REPEATED = list(range(10, 30)) * 2  # prompt lookup drafts land
#: copies of Python data to the device a static call makes: the prompt, the first token, the end-of-sequence ids
COPIES_PER_CALL = 3
RANDOM = [5, 9, 3, 17, 4, 8, 40, 2, 77, 31]


def static_engine(model: Any, drafter: Any = "prompt_lookup", **kwargs: Any) -> SpeculativeEngine:
    kwargs = {"num_draft_tokens": 6, "calibration": {}, "compile": "eager", **kwargs}
    return SpeculativeEngine(model, None, drafter=drafter, **kwargs)


def test_widths_and_buckets() -> None:
    assert [width_for(k) for k in (0, 1, 2, 3, 4, 8, 16, 32)] == [1, 2, 3, 5, 5, 9, 17, 33]
    with pytest.raises(ValueError, match="at most 32"):
        width_for(33)
    assert [bucket_for(n) for n in (1, 256, 257, 3000)] == [256, 256, 512, 4096]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["none", "prompt_lookup"])
def test_greedy_equals_generate(arch: str, drafter: str) -> None:
    model = make_model(arch, agreeing=True)
    engine = static_engine(model, drafter)
    for prompt in (REPEATED, RANDOM):
        out = engine.generate_ids(prompt, max_new_tokens=40)
        assert out.token_ids == reference_greedy(model, prompt, 40)
    assert engine.static_round is not None and engine.static_round.step.compiled  # the calls ran there
    if drafter == "prompt_lookup":
        assert engine.generate_ids(REPEATED, max_new_tokens=40).stats.num_accepted > 10


def test_eagle_chain_greedy_equals_generate() -> None:
    model = make_model("llama", agreeing=True)
    torch.manual_seed(0)
    engine = static_engine(model, "eagle", eagle_head=EagleHead(model), num_draft_tokens=4)
    for prompt in (REPEATED, RANDOM):
        assert engine.generate_ids(prompt, max_new_tokens=30).token_ids == reference_greedy(model, prompt, 30)
    assert engine.static_round is not None and engine.static_round.step.compiled


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_early_exit_chain_greedy_equals_generate(arch: str) -> None:
    """The early exit drafts on the device with its KV reuse: the verify continues every row from the exit layer."""
    model = make_model(arch, agreeing=True)
    engine = static_engine(model, "early_exit", exit_layer=1, num_draft_tokens=4)
    for prompt in (REPEATED, RANDOM):
        out = engine.generate_ids(prompt, max_new_tokens=40)
        assert out.token_ids == reference_greedy(model, prompt, 40)
        assert out.stats.num_accepted > 10  # the drafts ran and landed
    assert engine.static_round is not None
    kinds = {kind for kind, _, _ in engine.static_round.step.compiled}
    assert kinds >= {"exit_draft@1", "exit_state@1", "exit_greedy@1"} and "greedy" not in kinds, kinds


def test_hybrid_chains_greedy_equal_generate() -> None:
    """The hybrid picks prompt lookup (host chain) or the early exit (device chain) per round, no graft."""
    model = make_model("qwen2", agreeing=False)  # early exits that agree poorly: copies win where the text repeats
    engine = static_engine(model, "hybrid", exit_layer=1, num_draft_tokens=4)
    assert engine.static_round is not None
    engine.static_round.prepare(len(REPEATED), 40, drafter=engine.drafter)  # both sources' steps, every width
    prepared = {kind for kind, _, _ in engine.static_round.step.compiled}
    assert prepared == {"greedy", "exit_greedy@1", "exit_draft@1", "exit_state@1"}, prepared
    for prompt in (REPEATED, RANDOM):
        out = engine.generate_ids(prompt, max_new_tokens=40)
        assert out.token_ids == reference_greedy(model, prompt, 40)
        assert out.stats.num_drafted > 0
    assert engine.static_round is not None
    kinds = {kind for kind, _, _ in engine.static_round.step.compiled}
    assert {"exit_greedy@1", "greedy"} <= kinds, kinds  # both sources ran


def test_early_exit_with_an_adapter_in_the_static_round() -> None:
    model = make_model("llama", agreeing=True, dtype=torch.float64)
    torch.manual_seed(0)
    adapter = ExitAdapter(ExitAdapterConfig(exit_layer=1, hidden_size=model.config.hidden_size)).double()
    engine = static_engine(model, "early_exit", exit_layer=1, exit_adapter=adapter, num_draft_tokens=3)
    assert engine.generate_ids(RANDOM, max_new_tokens=24).token_ids == reference_greedy(model, RANDOM, 24)
    assert engine.static_round is not None
    assert any(kind.startswith("exit_draft+adapter") for kind, _, _ in engine.static_round.step.compiled)


def test_calls_it_cannot_serve_take_the_eager_loop_with_the_same_text() -> None:
    model = make_model("llama", agreeing=True)
    reference = reference_greedy(model, REPEATED, 30)
    tree = static_engine(model, "early_exit", exit_layer=1, tree_nodes=6)
    assert tree.generate_ids(REPEATED, max_new_tokens=30).token_ids == reference
    assert tree.static_round is not None and not tree.static_round.step.compiled
    # one generation at a time: a call while a stream holds the engine's cache runs eagerly, same text
    demo = SpeculativeEngine.from_pretrained("selfspec-demo", drafter="prompt_lookup", compile="eager")
    prompt = "It is a truth universally acknowledged, that a single man"
    alone = demo.generate(prompt, max_new_tokens=24).text
    stream = demo.stream(prompt, max_new_tokens=24)
    pieces = [next(stream)]
    assert demo.generate(prompt, max_new_tokens=24).text == alone
    pieces.extend(stream)
    assert "".join(pieces) == alone
    assert demo.generate(prompt, max_new_tokens=24).text == alone  # the cache is free again


class Constant(Drafter):
    """A user's drafter: always proposes token 5 (a chain)."""

    name = "constant"
    chain_only = True
    tree = False

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        parents = [-1, *range(max_tokens - 1)] if self.tree else None
        return Draft(tokens=[5] * max_tokens, parents=parents)


def test_a_users_chain_drafter_runs_there_and_one_that_is_not_is_refused() -> None:
    model = make_model("llama", agreeing=True)
    drafter = Constant()
    engine = static_engine(model, drafter, num_draft_tokens=3)
    assert engine.generate_ids(RANDOM, max_new_tokens=20).token_ids == reference_greedy(model, RANDOM, 20)
    assert engine.static_round is not None and engine.static_round.step.compiled
    drafter.tree = True  # says chain_only, drafts a tree
    with pytest.raises(ConfigurationError, match="chain_only but drafted a tree"):
        engine.generate_ids(RANDOM, max_new_tokens=20)
    drafter.tree = False
    assert engine.generate_ids(RANDOM, max_new_tokens=20).token_ids == reference_greedy(model, RANDOM, 20)


def test_compile_option() -> None:
    model = make_model("llama", agreeing=True)
    assert SpeculativeEngine(model, None, drafter="none", calibration={}).static_round is None  # auto: CPU -> eager
    assert SpeculativeEngine(model, None, drafter="none", calibration={}, compile=False).static_round is None
    gemma = make_model("gemma2", agreeing=True)  # eager attention: no lean layer path
    with pytest.raises(ConfigurationError, match="lean layer path"):
        SpeculativeEngine(gemma, None, drafter="none", calibration={}, compile=True)
    with pytest.raises(ConfigurationError, match="compile must be"):
        SpeculativeEngine(model, None, drafter="none", calibration={}, compile="in ductor")
    assert "backend='eager'" in repr(static_engine(model).static_round)


@pytest.mark.parametrize("drafter", ["none", "prompt_lookup", "eagle", "early_exit", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_host_read_per_round(drafter: str, temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain decoding, prompt lookup, EAGLE chains and the early exit (drafted on the device) read once a round.

    Counted over whole calls, a copy of Python data to the device included (issue 40: 2.00 a
    round before, the round's own inputs made from a list each round): one read a round, and a
    few copies a call.
    """
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    torch.manual_seed(0)
    extra: dict[str, Any] = {"eagle_head": EagleHead(model)} if drafter == "eagle" else {}
    extra |= {"exit_layer": 1} if drafter in ("early_exit", "hybrid") else {}
    engine = static_engine(model, drafter, num_draft_tokens=4, **extra)
    assert engine.static_round is not None
    # the counter is a dispatch mode, which dynamo refuses: count the same round with its steps run eagerly
    # (a compiled step cannot read the device: fullgraph=True turns any read into an error)
    engine.static_round.step.backend = None
    keywords: dict[str, Any] = {"temperature": temperature, "seed": 3} if temperature else {}
    engine.generate_ids(REPEATED, max_new_tokens=40, **keywords)  # trace every width first
    out, counter = count(engine, REPEATED, monkeypatch, **keywords)
    if not temperature:
        assert out.token_ids == reference_greedy(model, REPEATED, 40)
    rounds = out.stats.target_forwards - 1
    drafted = out.stats.num_drafted if temperature or drafter == "eagle" else out.stats.num_accepted
    assert drafter == "none" or drafted > 0
    assert counter.reads <= rounds + PER_CALL, (counter.reads, rounds)
    # and no copy of Python data to the device a round: the host drafts go through a buffer made once
    assert counter.copies <= COPIES_PER_CALL, (counter.copies, rounds)


class _Mutations(TorchDispatchMode):
    """Records the storages an in-place op writes that the recorded code did not create itself."""

    def __init__(self) -> None:
        super().__init__()
        self.created: set[int] = set()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = kwargs.get(argument.name, args[index] if index < len(args) else None)
                if isinstance(value, torch.Tensor):
                    self.written.add(value.untyped_storage().data_ptr())
        out = func(*args, **kwargs)
        if all(r.alias_info is None for r in func._schema.returns):  # a new tensor, not a view or an in-place op
            for leaf in torch.utils._pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.created.add(leaf.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("width", [1, 5])
def test_a_step_mutates_only_the_caches_static_buffers(width: int) -> None:
    """On CUDA a graphed step runs without graphs if it writes an input that is not a static address.

    The first GPU check found the device length unmarked (every round launched its kernels one by
    one): every storage a greedy or sampled step writes must be one of ``static_buffers()``.
    """
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    engine = static_engine(model, num_draft_tokens=4)
    assert engine.static_round is not None
    step = engine.static_round.step
    step.backend = None  # a dispatch mode cannot wrap a traced call: the same step, run eagerly
    engine.generate_ids(REPEATED, max_new_tokens=8)
    cache = step._cache()
    static = {buffer.untyped_storage().data_ptr() for buffer in cache.static_buffers()}
    tokens, num_draft = torch.tensor([REPEATED[:width]]), torch.tensor(width - 1)
    greedy, sampled = step.greedy, step.forward
    for run in (lambda: greedy(tokens, num_draft, cache.max_length), lambda: sampled(tokens, cache.max_length)):
        with torch.inference_mode(), _Mutations() as recorded:
            run()
        foreign = recorded.written - recorded.created
        assert foreign and foreign <= static, (foreign, static)


def test_early_exit_rounds_never_recompile() -> None:
    """The early exit's draft and verify steps, traced by dynamo: 50+ rounds of varying lengths, no recompile."""
    model = make_model("llama", agreeing=False, dtype=torch.float32, num_hidden_layers=3)
    engine = static_engine(model, "early_exit", exit_layer=1, num_draft_tokens=2)
    assert engine.static_round is not None
    prompt = [*RANDOM, *REPEATED]
    new_tokens = 200
    engine.static_round.prepare(len(prompt), new_tokens, drafter=engine.drafter)  # its exit steps, every width
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(model, prompt, new_tokens)
    assert out.stats.target_forwards - 1 >= 50
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for n in histogram if n) >= 3, histogram


@pytest.mark.slow
def test_inductor_compiled_rounds_equal_generate_and_never_recompile() -> None:
    """inductor's code for a 2-layer float32 Llama: the text of ``generate``; 50+ rounds, no recompile."""
    model = make_model("llama", agreeing=True, dtype=torch.float32, num_hidden_layers=2)
    engine = static_engine(model, num_draft_tokens=4, compile="inductor")
    assert engine.static_round is not None
    prompt = [*REPEATED, *RANDOM, *REPEATED[:7], 3, 3, 3]  # copies that run out: accepted lengths vary
    new_tokens = 190
    engine.static_round.step.prepare(len(prompt) + new_tokens + WIDTHS[-1], widths=(1, 2, 3, 5))  # 0..4 drafts
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(model, prompt, new_tokens)
    assert out.stats.target_forwards - 1 >= 50
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for n in histogram if n) >= 3, histogram  # several accepted lengths, one graph per width


def first_layer_head(model: Any, draft_token_ids: torch.Tensor) -> EagleHead:
    """The target's first layer over the next token's embedding, drafting only ``draft_token_ids``.

    On an agreeing model it predicts the target's next token (the deeper layers add little), so
    its chains run until the text needs a token outside its draft vocabulary: accepted lengths vary.
    """
    head = EagleHead(model, draft_token_ids=draft_token_ids)
    hidden = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :hidden].copy_(torch.eye(hidden))  # fc([embed, feature]) = embed
        head.fc.bias.zero_()
    head.layer.load_state_dict(model.model.layers[0].state_dict())
    return head.eval().requires_grad_(False)


class TwinDrafter(EagleDrafter):
    """Drafts through the static head step, and checks each chain against the Python-length cache's."""

    def __init__(self, head: EagleHead) -> None:
        super().__init__(head)
        self.twin = EagleDrafter(head)  # never asked to compile: its own HeadCache
        self.chains: list[tuple[list[int], list[int]]] = []

    def propose_device(self, state: DecodeState, width: int) -> DeviceDraft:
        pending = state.pending_hidden
        expected = self.twin.propose_device(state, width)
        state.pending_hidden = pending  # the same catch-up, on the static cache
        draft = super().propose_device(state, width)
        self.chains.append(
            (draft.tokens[: int(draft.length)].tolist(), expected.tokens[: int(expected.length)].tolist())
        )
        return draft


def test_the_static_head_step_drafts_the_chains_of_the_eager_head() -> None:
    """The head over its fixed-slot cache (traced step, eager catch-up) drafts what it drafts over the Python one."""
    model = make_model("llama", agreeing=True)  # float64
    drafter = TwinDrafter(first_layer_head(model, draft_token_ids=torch.arange(1, model.config.vocab_size, 2)))
    engine = static_engine(model, drafter, num_draft_tokens=4)
    for prompt in (REPEATED, RANDOM):
        assert engine.generate_ids(prompt, max_new_tokens=40).token_ids == reference_greedy(model, prompt, 40)
    assert drafter.static_chain and drafter.backend == "eager" and drafter.compiled_steps
    assert len(drafter.chains) > 20 and sum(len(chain) for chain, _ in drafter.chains) > 40
    for static, eager in drafter.chains:
        assert static == eager


@pytest.mark.slow
def test_compiled_eagle_head_steps_never_recompile() -> None:
    """The EAGLE head's draft step, compiled by inductor beside the verify steps: 50+ rounds, no recompile."""
    model = make_model("llama", agreeing=True, dtype=torch.float32, num_hidden_layers=2)
    head = first_layer_head(model, draft_token_ids=torch.arange(1, model.config.vocab_size, 2))  # odd tokens
    engine = static_engine(model, "eagle", eagle_head=head, num_draft_tokens=4, compile="inductor")
    assert engine.static_round is not None
    prompt = [*RANDOM, *REPEATED]
    new_tokens = 160
    engine.static_round.step.prepare(len(prompt) + new_tokens + WIDTHS[-1], widths=(1, 2, 3, 5))  # 0..4 drafts
    engine.generate_ids(RANDOM, max_new_tokens=10)  # compiles the head's step for the cache prepare() sized
    drafter = engine.drafter
    assert drafter.compiled_steps and drafter.backend == "inductor"
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate_ids(prompt, max_new_tokens=new_tokens)
    assert out.token_ids == reference_greedy(model, prompt, new_tokens)
    assert out.stats.target_forwards - 1 >= 50
    histogram = out.stats.accepted_length_histogram
    assert sum(1 for n in histogram if n) >= 3, histogram  # several accepted lengths: catch-ups of varying rows
    assert len(drafter.compiled_steps) == 1


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "eagle", "early_exit", "hybrid"])
@pytest.mark.parametrize(
    "params", [SamplingParams(1.0), SamplingParams(0.7, top_k=4, top_p=0.9)], ids=["t1", "t0.7-topk4-topp0.9"]
)
def test_sampling_follows_the_target_distribution(drafter: str, params: SamplingParams) -> None:
    """Chi-square over every 3-token continuation; the EAGLE head (random) and the early exit draft sampled tokens."""
    model = make_distribution_model()
    torch.manual_seed(1)
    extra: dict[str, Any] = {"eagle_head": EagleHead(model)} if drafter == "eagle" else {}
    extra |= {"exit_layer": 2} if drafter in ("early_exit", "hybrid") else {}
    engine = static_engine(model, drafter, num_draft_tokens=2, **extra)
    counts = sampled_counts(engine, params)
    assert chi_square_pvalue(counts, exact_distribution(model, params)) > 1e-3
    if drafter != "none":
        stats = [engine.generate_ids(DIST_PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats for s in range(30)]
        assert sum(s.num_accepted for s in stats) > 0 and sum(s.num_drafted - s.num_accepted for s in stats) > 0


@pytest.mark.slow
def test_the_test_rejects_a_lossy_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping every real draft gives the draft's distribution: the chi-square test must fail."""

    def keep_everything(tokens, num_draft, draft_probs, target_probs, generator):  # type: ignore[no-untyped-def]
        bonus = torch.multinomial(target_probs.index_select(0, num_draft.view(1)), 1, generator=generator)[0]
        return torch.cat([num_draft.view(1), bonus])

    monkeypatch.setattr(static_round, "accept_sampled_step", keep_everything)
    model = make_distribution_model()
    torch.manual_seed(1)
    engine = static_engine(model, "eagle", num_draft_tokens=2, eagle_head=EagleHead(model))
    params = SamplingParams(1.0)
    assert chi_square_pvalue(sampled_counts(engine, params), exact_distribution(model, params)) < 1e-6
