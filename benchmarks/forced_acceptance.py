"""Test-only forced acceptance through the real verify (issue 40, item 7), and a round-phase recorder.

Not a user drafter: it lives in ``benchmarks/``, is never registered, so ``drafter="auto"``,
``list_drafters()`` and calibration never see it. The GPU check (``benchmarks/gpu_check.py``),
the round-phase benchmark (``benchmarks/round_times.py``) and their smoke test import it.

**The approach.** Greedy verification accepts a draft token exactly when it equals the target's
argmax at its position, and that argmax is known ahead of the target only for a model whose next
token depends on the last token alone. :func:`make_context_free` makes a random model one, in
place and reversibly (:meth:`ContextFree.restore`):

- every layer's ``o_proj`` and ``down_proj`` weights are zeroed, so attention and the MLP add
  exact zeros to the residual stream (``x + 0 == x`` in every dtype) and the last layer's output
  is the token's embedding, whatever came before it;
- the LM head's rows become the embeddings permuted (row ``perm[t]`` = ``embed[t]``), so the
  successor of ``t`` is ``perm[t]`` with a wide margin (the self inner product grows like the
  hidden size, the others like its square root);
- :attr:`ContextFree.successor` is then *measured*, not assumed: the model's own final norm and LM
  head on every embedding, the argmax taken as the verify takes it (float32 logits); the margin
  between its best and second logit is recorded (:attr:`ContextFree.min_margin`).

:class:`ForcedAcceptanceDrafter` draws ``n ~ Geometric(alpha)`` capped at ``k`` (each draft kept
with probability ``alpha``, the first miss ends the run), drafts ``successor`` ``n`` times from
the last token, then a token that is not the successor (rejected), then anything up to ``k``
tokens. The real verify, eager loop or static round at any width, then accepts exactly ``n``
tokens and emits the successor as its correction (the bonus token at ``n = k``). Every round
verifies ``k`` drafts (width ``k + 1``), as a real drafter of ``k`` drafts would; the rounds whose
budget is under ``k`` (a call's tail) draft nothing, so only widths 1 and ``k + 1`` are used.

**Cost.** Dense GEMVs and GEMMs do not skip zeros and attention runs unchanged, so a round of
the context-free model costs what a round of the random one costs; its speed is the loop's
speed at a known acceptance, independent of whether bf16 rows match across widths.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.drafting.base import DecodeState, Draft, Drafter


def expected_tokens_per_round(alpha: float, drafts: int) -> float:
    """``1 + alpha + ... + alpha^drafts``: tokens a round emits when each draft is kept with ``alpha``."""
    return sum(alpha**i for i in range(drafts + 1))


@dataclass
class ContextFree:
    """A model made context-free by :func:`make_context_free`, and what it takes to undo it.

    Attributes:
        successor: per token id, the target's greedy next token (measured).
        min_margin: the smallest gap between the best and second float32 logit over every token.
        saved: the weights overwritten, by name (restored in place by :meth:`restore`).
    """

    model: Any
    successor: list[int]
    min_margin: float
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def restore(self) -> None:
        """Write the saved weights back in place (the same storage: compiled graphs keep reading it)."""
        with torch.no_grad():
            for parameter, original in self.saved.values():
                parameter.copy_(original)
        self.saved.clear()


def make_context_free(model: Any, seed: int = 0, chunk: int = 8192) -> ContextFree:
    """Make a Llama-like random ``model``'s next token a function of its last token (see the module docstring).

    Raises:
        ValueError: the embedding is tied to the LM head, or the model has no ``o_proj``/``down_proj`` layers.
    """
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if embed.data_ptr() == head.data_ptr():
        raise ValueError("make_context_free needs an LM head not tied to the input embedding")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError("make_context_free needs a decoder with model.model.layers")
    saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    vocab = embed.shape[0]
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).to(embed.device)
    with torch.no_grad():
        for index, layer in enumerate(layers):
            for name, module in (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj)):
                for kind in ("weight", "bias"):
                    tensor = getattr(module, kind, None)
                    if tensor is not None:
                        saved[f"layers.{index}.{name}.{kind}"] = (tensor, tensor.detach().clone())
                        tensor.zero_()
        saved["lm_head.weight"] = (head, head.detach().clone())
        head[perm] = embed.detach().to(head.dtype)  # row perm[t] = embed[t]: the successor of t is perm[t]
        successor, margin = measured_successor(model, chunk)
    return ContextFree(model, successor, margin, saved)


def measured_successor(model: Any, chunk: int = 8192) -> tuple[list[int], float]:
    """The argmax of the model's final norm and LM head on every embedding, and the smallest top-2 margin."""
    embed = model.get_input_embeddings().weight
    norm, head = model.model.norm, model.get_output_embeddings()
    successor: list[int] = []
    margin = float("inf")
    with torch.no_grad():
        for start in range(0, embed.shape[0], chunk):
            logits = head(norm(embed[start : start + chunk][None]))[0].float()
            top = logits.topk(2, dim=-1)
            successor.extend(top.indices[:, 0].tolist())
            margin = min(margin, float((top.values[:, 0] - top.values[:, 1]).min()))
    return successor, margin


class ForcedAcceptanceDrafter(Drafter):
    """Drafts so that the real greedy verify accepts ``n ~ Geometric(alpha)`` tokens capped at ``k``.

    Args:
        successor: the context-free target's next token per token (:attr:`ContextFree.successor`).
        num_draft_tokens: ``k``, the drafts of every full round (``0``: plain decoding).
        alpha: the probability that each draft is kept (``1.0``: all ``k`` every round).
        seed: the draws' seed (:meth:`reset` restarts them).

    Attributes:
        forced: the accepted length forced in each round, in order (a round that drafted nothing: 0).
        drafted: the drafts proposed in each round.
    """

    name = "forced_acceptance"
    chain_only = True

    def __init__(self, successor: list[int], num_draft_tokens: int, alpha: float = 1.0, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.successor = successor
        self.vocab_size = len(successor)
        self.num_draft_tokens = num_draft_tokens
        self.reset(alpha, seed)

    def __repr__(self) -> str:
        return f"ForcedAcceptanceDrafter(k={self.num_draft_tokens}, alpha={self.alpha})"

    def reset(self, alpha: float | None = None, seed: int | None = None, num_draft_tokens: int | None = None) -> None:
        """Start a new call's draws (optionally with a new ``alpha``, ``seed`` or ``k``)."""
        if alpha is not None:
            self.alpha = alpha
        if seed is not None:
            self.seed = seed
        if num_draft_tokens is not None:
            self.num_draft_tokens = num_draft_tokens
        self.draws = random.Random(self.seed)
        self.forced: list[int] = []
        self.drafted: list[int] = []

    def propose(self, state: DecodeState, max_tokens: int) -> Draft:
        """``successor`` for the forced length, one wrong token, then padding up to ``k`` tokens."""
        k = self.num_draft_tokens
        if k == 0 or max_tokens < k:  # plain decoding, or a call's tail: width 1, no narrower width
            self.forced.append(0)
            self.drafted.append(0)
            return Draft()
        kept = 0
        while kept < k and self.draws.random() < self.alpha:
            kept += 1
        tokens: list[int] = []
        token = state.last_token
        for _ in range(kept):
            token = self.successor[token]
            tokens.append(token)
        if kept < k:
            token = (self.successor[token] + 1) % self.vocab_size  # never the target's argmax: rejected
            tokens.append(token)
            while len(tokens) < k:
                token = self.successor[token]
                tokens.append(token)
        self.forced.append(kept)
        self.drafted.append(k)
        return Draft(tokens=tokens)


def follows_successor(tokens: list[int], successor: list[int]) -> bool:
    """Whether every token of ``tokens`` is the successor of the one before it (the context-free model's text)."""
    return all(successor[a] == b for a, b in itertools.pairwise(tokens))


# ----------------------------------------------------------------------------- round phases
@dataclass
class RoundRecord:
    """One round's host phases (milliseconds) from the loop's :class:`~selfspec.decoding.loop.RoundTimes`.

    Attributes:
        path: ``"static"`` (the static round) or ``"eager"`` (the eager loop).
        draft_ms: ``started -> drafted``: the drafter's proposal (and, static, its copy to the device).
        launch_ms: static only: the verify step's call (its launches; on CPU the whole forward).
        wait_ms: static: ``drafted -> scored`` less the launch, i.e. the blocking read's wait; eager: the
            whole verify (forward, acceptance, its read).
        commit_ms: the commit (cache, controller, statistics, the emitted tokens).
        gap_ms: from the previous round's commit to this round's start (the generator, streaming, the engine).
        device_ms: static on CUDA: the verify step's device time by CUDA events, else ``None``.
        drafted: drafts proposed; accepted: drafts accepted.
    """

    path: str
    draft_ms: float
    launch_ms: float | None
    wait_ms: float
    commit_ms: float
    gap_ms: float | None
    device_ms: float | None
    drafted: int
    accepted: int

    @property
    def total_ms(self) -> float:
        """The whole round: draft, launch, wait, commit and the gap before it."""
        return self.draft_ms + (self.launch_ms or 0) + self.wait_ms + self.commit_ms + (self.gap_ms or 0)


@contextlib.contextmanager
def record_rounds(engine: Any) -> Iterator[list[RoundRecord]]:
    """Record every round's phases while the block runs (both loops' ``commit`` wrapped, nothing else changed).

    The static round's verify step is wrapped too (its call time, and CUDA events around it on
    CUDA). The wrappers only time the real functions; they are removed when the block ends.
    """
    from selfspec.decoding import loop, static_round

    records: list[RoundRecord] = []
    pending: dict[str, Any] = {}
    last_end: list[float] = []
    step = engine.static_round.step if engine.static_round is not None else None
    cuda = engine.runner.device.type == "cuda"
    commits = {"static": static_round.commit, "eager": loop.commit}

    def timed_commit(path: str) -> Any:
        original = commits[path]

        def commit(drafter: Any, row: Any, draft: Any, acceptance: Any, times: Any) -> list[int]:
            begun = time.perf_counter()
            tokens: list[int] = original(drafter, row, draft, acceptance, times)
            ended = time.perf_counter()
            launch = pending.pop("launch", None) if path == "static" else None
            events = pending.pop("events", None) if path == "static" else None
            verify_ms = 1000 * (times.scored - times.drafted)
            records.append(
                RoundRecord(
                    path=path,
                    draft_ms=1000 * (times.drafted - times.started),
                    launch_ms=None if launch is None else 1000 * launch,
                    wait_ms=verify_ms - (0.0 if launch is None else 1000 * launch),
                    commit_ms=1000 * (ended - begun),
                    gap_ms=1000 * (times.started - last_end[-1]) if last_end else None,
                    device_ms=None if events is None else events[0].elapsed_time(events[1]),
                    drafted=len(draft),
                    accepted=int(acceptance.num_accepted),
                )
            )
            last_end[:] = [ended]
            return tokens

        return commit

    original_greedy = step.greedy if step is not None else None

    def timed_greedy(*args: Any, **kwargs: Any) -> Any:
        assert original_greedy is not None
        started = time.perf_counter()
        events = None
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        result = original_greedy(*args, **kwargs)
        if events is not None:
            events[1].record()
        pending["launch"], pending["events"] = time.perf_counter() - started, events
        return result

    static_round.commit, loop.commit = timed_commit("static"), timed_commit("eager")  # type: ignore[assignment]
    if step is not None:
        step.greedy = timed_greedy  # type: ignore[method-assign]
    try:
        yield records
    finally:
        static_round.commit, loop.commit = commits["static"], commits["eager"]  # type: ignore[assignment]
        if step is not None:
            del step.greedy  # the class's method again


def phase_medians(records: list[RoundRecord]) -> dict[str, float | None]:
    """Each phase's median over ``records`` (milliseconds, 4 decimals; ``None`` where not measured)."""
    import statistics

    medians: dict[str, float | None] = {}
    for name in ("draft_ms", "launch_ms", "wait_ms", "commit_ms", "gap_ms", "device_ms"):
        values = [getattr(r, name) for r in records if getattr(r, name) is not None]
        medians[name] = round(statistics.median(values), 4) if values else None
    return medians
