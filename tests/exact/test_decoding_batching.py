"""Batched speculation: concurrent calls decoded together each get exactly their solo output.

Greedy exactness is checked in float64 (batched float32 kernels are not batch-invariant)
against the same call on an unbatched engine and against transformers' ``generate``;
sampling is checked per row with the chi-square exact-distribution test of
``test_core_acceptance.py``, and seeded sampling gives the text it gives alone.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
import test_decoding_stopping as text_tests
import torch
from test_core_acceptance import (
    NEW_TOKENS,
    PROMPT,
    SAMPLES,
    chi_square_pvalue,
    exact_distribution,
    make_distribution_model,
)
from tiny_models import make_config, make_model, reference_greedy, scale_deep_layers

import selfspec.decoding.loop
from selfspec import SpeculativeEngine
from selfspec.core.sampling import SamplingParams
from selfspec.decoding.batching import BatchedKVCache, BatchScheduler, rope_depends_on_batch
from selfspec.errors import ConfigurationError

Job = tuple[list[int], int]  # (prompt ids, max_new_tokens)


def ragged_jobs(count: int, seed: int = 0, vocab: int = 96) -> list[Job]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randrange(1, 24))], rng.randrange(1, 32)) for _ in range(count)
    ]


def run_concurrently(engine: SpeculativeEngine, jobs: list[Job], **kwargs: Any) -> list[Any]:
    """Each job from its own thread, started at staggered times (rows join and leave mid-flight)."""
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        time.sleep(0.004 * i)
        try:
            results[i] = engine.generate_ids(jobs[i][0], max_new_tokens=jobs[i][1], **kwargs)
        except Exception as error:  # noqa: BLE001 - reported by the caller's assertions
            results[i] = error

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a batched call did not finish (deadlock?)"
    return [results[i] for i in range(len(jobs))]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2", "gemma3_text"])
def test_batched_greedy_equals_alone_and_generate(arch: str) -> None:
    model = make_model(arch)  # float64; mistral/gemma2/gemma3 windows of 12 are crossed
    jobs = ragged_jobs(8, seed=1)
    alone = SpeculativeEngine(model, exit_layer=2, num_draft_tokens="auto", calibration={}, drafter="early_exit")
    batched = SpeculativeEngine(
        model, exit_layer=2, num_draft_tokens="auto", calibration={}, batching=True, drafter="early_exit"
    )
    expected = [reference_greedy(model, prompt, n) for prompt, n in jobs]
    assert [alone.generate_ids(p, max_new_tokens=n).token_ids for p, n in jobs] == expected
    outputs = run_concurrently(batched, jobs)
    assert [out.token_ids for out in outputs] == expected
    assert [out.finish_reason for out in outputs] == ["length"] * len(jobs)
    scheduler = batched._batcher
    assert scheduler is not None and scheduler.max_rows_seen >= 2, "the calls never shared a round"
    assert sum(out.stats.num_accepted for out in outputs) > 0, "no draft was ever accepted"
    deadline = time.monotonic() + 10
    while scheduler._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.rows == [] and scheduler._thread is None, "the scheduler did not go idle"


@pytest.mark.parametrize("drafter", ["hybrid", "prompt_lookup", "none", "layer_skip"])
def test_other_drafters_batched_equal_alone(drafter: str) -> None:
    model = make_model("llama")
    # repetitive prompts so that prompt lookup finds matches
    jobs = [([5, 6, 7, 8, 5, 6, 7, 8, 5, 6][: 3 + i], 6 + 3 * i) for i in range(6)] + ragged_jobs(3, seed=2)
    alone = SpeculativeEngine(model, exit_layer=2, calibration={}, drafter=drafter)
    batched = SpeculativeEngine(model, exit_layer=2, calibration={}, drafter=drafter, batching=True)
    expected = [reference_greedy(model, prompt, n) for prompt, n in jobs]
    outputs = run_concurrently(batched, jobs)
    assert [out.token_ids for out in outputs] == expected
    assert [alone.generate_ids(p, max_new_tokens=n).token_ids for p, n in jobs] == expected
    rounds = batched._batcher.rounds_run if batched._batcher is not None else 0
    assert (rounds == 0) == (drafter == "layer_skip")  # layer skip runs unbatched


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid", "early_exit+adapter"])
def test_seeded_sampling_gives_the_solo_text(drafter: str) -> None:
    """The batched round drafts what the solo round drafts (the hybrid's per-generation choice
    and an exit adapter included), so a seed gives the solo text."""
    from test_drafting_exit_adapter import random_adapter

    model = make_model("llama", agreeing=False)
    scale_deep_layers(model, start=1, factor=0.5)  # drafts accepted and rejected
    jobs = ragged_jobs(8, seed=3)
    if drafter == "hybrid":  # repeated spans, so that lookup competes with the early exit
        jobs += [([5, 6, 7, 8, 5, 6, 7, 8, 5, 6][: 4 + i], 12 + 4 * i) for i in range(4)]
    kwargs: dict[str, Any] = {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "seed": 11}
    options: dict[str, Any] = {"exit_layer": 2, "calibration": {}}
    if drafter == "early_exit+adapter":
        options.update(exit_adapter=random_adapter(model, 2), drafter="early_exit")
    else:
        options["drafter"] = drafter
    alone = SpeculativeEngine(model, **options)
    batched = SpeculativeEngine(model, **options, batching=True)
    expected = [alone.generate_ids(p, max_new_tokens=n, **kwargs).token_ids for p, n in jobs]
    assert [out.token_ids for out in run_concurrently(batched, jobs, **kwargs)] == expected
    assert batched._batcher is not None and batched._batcher.rounds_run > 0


def test_trees_run_unbatched_and_exact() -> None:
    model = make_model("llama")
    jobs = ragged_jobs(4, seed=8)
    engine = SpeculativeEngine(model, exit_layer=2, calibration={}, tree_nodes=6, batching=True, drafter="early_exit")
    outputs = run_concurrently(engine, jobs)
    assert [out.token_ids for out in outputs] == [reference_greedy(model, p, n) for p, n in jobs]
    assert engine._batcher is not None and engine._batcher.rounds_run == 0


@pytest.fixture(scope="module")
def sampling_model() -> Any:
    """The model of ``test_core_acceptance.py``: 8 tokens, partly agreeing early exits."""
    return make_distribution_model()


@pytest.mark.slow
def test_sampling_distribution_per_row(sampling_model: Any) -> None:
    """Three rows with different sampling settings decode together; each follows its target."""
    engine = SpeculativeEngine(sampling_model, exit_layer=1, num_draft_tokens=2, batching=True, drafter="early_exit")
    settings = [SamplingParams(1.0), SamplingParams(0.7, top_k=4, top_p=0.9), SamplingParams(1.3, top_p=0.8)]
    counts = [Counter() for _ in settings]
    peak = [0]

    def row(i: int) -> None:
        params = settings[i]
        for seed in range(SAMPLES):
            out = engine.generate_ids(
                PROMPT,
                max_new_tokens=NEW_TOKENS,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=1000 * i + seed,
            )
            counts[i][tuple(out.token_ids)] += 1
            peak[0] = max(peak[0], engine._batcher.max_rows_seen if engine._batcher else 0)

    threads = [threading.Thread(target=row, args=(i,)) for i in range(len(settings))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert peak[0] >= 2, "the rows never shared a round"
    for params, observed in zip(settings, counts, strict=True):
        assert chi_square_pvalue(observed, exact_distribution(sampling_model, params)) > 1e-3, params


@pytest.mark.slow
def test_the_per_row_test_can_fail(sampling_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler that accepts every draft outputs the draft's distribution: the test rejects it."""
    from selfspec.core.acceptance import Acceptance

    def accept_everything(draft_tokens, draft_probs, target_probs, generator):  # type: ignore[no-untyped-def]
        k = draft_tokens.shape[0]
        return Acceptance(k, int(torch.multinomial(target_probs[k], 1, generator=generator)))

    monkeypatch.setattr(selfspec.decoding.loop, "accept_sampled", accept_everything)
    engine = SpeculativeEngine(sampling_model, exit_layer=1, num_draft_tokens=2, batching=True, drafter="early_exit")
    counts: Counter = Counter()
    for seed in range(SAMPLES):
        out = engine.generate_ids(PROMPT, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed)
        counts[tuple(out.token_ids)] += 1
    assert chi_square_pvalue(counts, exact_distribution(sampling_model, SamplingParams(1.0))) < 1e-6


def test_an_error_in_one_row_spares_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("llama")
    jobs = ragged_jobs(6, seed=4)
    engine = SpeculativeEngine(
        model, exit_layer=2, num_draft_tokens=3, calibration={}, batching=True, drafter="early_exit"
    )
    expected = [reference_greedy(model, prompt, n) for prompt, n in jobs]
    real_accept = selfspec.decoding.loop.accept_greedy
    calls = [0]

    def fail_once(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Any:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("injected failure")
        return real_accept(draft_tokens, target_logits)

    monkeypatch.setattr(selfspec.decoding.loop, "accept_greedy", fail_once)
    outputs = run_concurrently(engine, jobs)
    failed = [i for i, out in enumerate(outputs) if isinstance(out, Exception)]
    assert len(failed) == 1 and "injected failure" in str(outputs[failed[0]])
    for i, out in enumerate(outputs):
        if i not in failed:
            assert out.token_ids == expected[i]
    monkeypatch.setattr(selfspec.decoding.loop, "accept_greedy", real_accept)
    # a request that fails in its prefill fails alone, too (tiny temperatures are greedy now: inject the failure)
    real_prefill = selfspec.decoding.loop.prefill_row

    def failing_prefill(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(selfspec.decoding.loop, "prefill_row", failing_prefill)
    with pytest.raises(RuntimeError, match="injected prefill failure"):
        engine.generate_ids(jobs[0][0], max_new_tokens=4)
    monkeypatch.setattr(selfspec.decoding.loop, "prefill_row", real_prefill)
    # and the engine is still usable afterwards
    assert [out.token_ids for out in run_concurrently(engine, jobs)] == expected


def test_streams_join_leave_and_cancel() -> None:
    """Streams read in one thread, round-robin: rows join mid-flight, one is closed early."""
    from tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    model = make_model("mistral", vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    alone = SpeculativeEngine(model, tokenizer, exit_layer=2, calibration={}, drafter="early_exit")
    batched = SpeculativeEngine(model, tokenizer, exit_layer=2, calibration={}, batching=True, drafter="early_exit")
    prompts = ["It is a truth", "The quick brown fox", "Hello world! STOP", "must be in want of"]
    limits = [30, 8, 20, 14]
    expected = [alone.generate(p, max_new_tokens=n, stop="e t") for p, n in zip(prompts, limits, strict=True)]
    first = batched.stream(prompts[0], max_new_tokens=limits[0], stop="e t")
    parts: list[list[str]] = [[next(first)]]  # row 0 is decoding before the others join
    streams = [first] + [
        batched.stream(p, max_new_tokens=n, stop="e t") for p, n in zip(prompts[1:], limits[1:], strict=True)
    ]
    parts += [[] for _ in streams[1:]]
    cancelled = batched.stream(prompts[1], max_new_tokens=30)
    next(cancelled)
    cancelled.close()  # leaves mid-flight
    assert cancelled.finish_reason == "cancelled"
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            piece = next(streams[i], None)
            if piece is None:
                live.discard(i)
            else:
                parts[i].append(piece)
    for i, stream in enumerate(streams):
        assert "".join(parts[i]) == expected[i].text
        assert stream.output is not None and stream.output.token_ids == expected[i].token_ids
        assert stream.finish_reason == expected[i].finish_reason
    assert batched._batcher is not None and batched._batcher.max_rows_seen >= 2


class AllowEven:
    """A constraint that allows only even token ids (runs unbatched on a batching engine)."""

    def __init__(self, vocab: int) -> None:
        self.allowed = torch.arange(vocab) % 2 == 0

    def allowed_tokens(self) -> torch.Tensor:
        return self.allowed

    def advance(self, token_id: int) -> None:
        assert token_id % 2 == 0

    def rollback(self, num_tokens: int) -> None:
        pass


def test_constrained_requests_run_unbatched_beside_the_batch() -> None:
    model = make_model("llama")
    jobs = ragged_jobs(4, seed=5)
    alone = SpeculativeEngine(model, exit_layer=2, calibration={}, drafter="early_exit")
    batched = SpeculativeEngine(model, exit_layer=2, calibration={}, batching=True, drafter="early_exit")
    constrained = alone.generate_ids(jobs[0][0], max_new_tokens=12, constraint=AllowEven(96)).token_ids
    assert all(t % 2 == 0 for t in constrained)
    results: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: results.update(c=batched.generate_ids(jobs[0][0], max_new_tokens=12, constraint=AllowEven(96)))
    )
    thread.start()
    outputs = run_concurrently(batched, jobs)
    thread.join()
    assert results["c"].token_ids == constrained
    assert [out.token_ids for out in outputs] == [reference_greedy(model, p, n) for p, n in jobs]


def test_requests_beyond_the_batch_size_wait_for_a_free_row() -> None:
    model = make_model("qwen3")
    jobs = ragged_jobs(7, seed=7)
    engine = SpeculativeEngine(model, exit_layer=2, calibration={}, batching=True, drafter="early_exit")
    assert engine._batcher is not None
    engine._batcher.max_batch_size = 2
    outputs = run_concurrently(engine, jobs)
    assert [out.token_ids for out in outputs] == [reference_greedy(model, p, n) for p, n in jobs]
    assert 1 <= engine._batcher.max_rows_seen <= 2


def test_batching_argument_and_reprs() -> None:
    model = make_model("llama")
    with pytest.raises(ConfigurationError, match="batching"):
        SpeculativeEngine(model, batching="yes", drafter="early_exit")  # type: ignore[arg-type]
    engine = SpeculativeEngine(model, exit_layer=2, calibration={}, batching=True, drafter="early_exit")
    assert "batching=True" in repr(engine)
    assert isinstance(engine._batcher, BatchScheduler) and "BatchScheduler(active=0" in repr(engine._batcher)
    assert "BatchedKVCache(num_layers=6" in repr(BatchedKVCache(6))
    assert SpeculativeEngine(model, exit_layer=2, calibration={}, drafter="early_exit")._batcher is None


def test_serve_with_batching_answers_like_without() -> None:
    """Concurrent HTTP requests to a batching server get the texts an unbatched server gives."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")

    from selfspec.serving.server import serve_in_background

    base = SpeculativeEngine.from_pretrained("selfspec-demo", dtype="float64")
    prompts = ["It is a truth universally acknowledged", "Tell me about Bath.", "Mr. Darcy said", "Once upon"]
    limits = [20, 7, 14, 11]

    def answers(engine: SpeculativeEngine) -> list[str]:
        texts: dict[int, str] = {}
        with serve_in_background(engine, model_id="m") as root:

            def ask(i: int) -> None:
                body = {"model": "m", "prompt": prompts[i], "max_tokens": limits[i], "temperature": 0}
                reply = httpx.post(f"{root}/v1/completions", json=body, timeout=120)
                reply.raise_for_status()
                texts[i] = reply.json()["choices"][0]["text"]

            askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for asker in askers:
                asker.start()
            for asker in askers:
                asker.join()
        return [texts[i] for i in range(len(prompts))]

    batched = SpeculativeEngine(
        base.model, base.tokenizer, calibration=base.calibration, batching=True, drafter="early_exit"
    )
    assert answers(batched) == answers(base)
    assert batched._batcher is not None and batched._batcher.rounds_run > 0


def test_batch_dependent_rotary_scaling_runs_unbatched() -> None:
    """Dynamic / longrope scaling reads the batch's largest position: those models do not batch."""
    assert not rope_depends_on_batch(make_config("llama"))
    assert not rope_depends_on_batch(make_config("gemma3_text"))
    assert rope_depends_on_batch(make_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    model = make_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    engine = SpeculativeEngine(model, exit_layer=2, calibration={}, batching=True, drafter="early_exit")
    jobs = ragged_jobs(3, seed=6)
    outputs = run_concurrently(engine, jobs)
    assert [out.token_ids for out in outputs] == [reference_greedy(model, p, n) for p, n in jobs]
    assert engine._batcher is not None and engine._batcher.rounds_run == 0


def test_serve_command_passes_batching_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``selfspec serve --batching`` builds a batching engine (uvicorn's blocking ``Server.run`` is replaced)."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from selfspec.cli import main

    apps: list[Any] = []

    def run_returns_at_once(server: Any, sockets: Any = None) -> None:
        apps.append(server.config.app)
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run_returns_at_once)
    assert main(["serve", "--model", "selfspec-demo", "--batching", "--port", "0"]) == 0
    assert main(["serve", "--model", "selfspec-demo", "--port", "0"]) == 0
    batched, plain = (app.state.selfspec.engine for app in apps)
    assert batched.batching and batched._batcher is not None
    assert not plain.batching and plain._batcher is None


# ----------------------------------------------------------------------------------------------
# The text-output tests of test_decoding_stopping.py, run again on a batching engine: streaming,
# stop strings, multi-byte characters, cancellation, abandoned streams and concurrent callers.
test_batched_abandoned_stream_does_not_block_others = text_tests.test_abandoned_stream_does_not_block_others
test_batched_close_cancels_and_next_call_is_unaffected = text_tests.test_close_cancels_and_next_call_is_unaffected
test_batched_stop_string_spanning_tokens = text_tests.test_stop_string_spanning_tokens
test_batched_stream_joins_to_generate_text = text_tests.test_stream_joins_to_generate_text
test_batched_stream_never_splits_a_multibyte_character = text_tests.test_stream_never_splits_a_multibyte_character
test_batched_threads_get_the_text_they_would_get_alone = text_tests.test_threads_get_the_text_they_would_get_alone


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tiny_tokenizer import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> SpeculativeEngine:
    """The engine of test_decoding_stopping.py, with batching on."""
    model = make_model("llama", vocab_size=len(tokenizer), max_position_embeddings=512)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return SpeculativeEngine(model, tokenizer, exit_layer=2, num_draft_tokens=3, batching=True, drafter="early_exit")
