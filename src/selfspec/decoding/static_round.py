"""The static round: the decoding loop with fixed shapes and one host read per round (issue 26).

The same four steps as :mod:`selfspec.decoding.loop` (draft, score, accept, commit), over the
engine's :class:`~selfspec.modeling.static_step.StaticStep`:

1. **draft**: the round reaches the drafter through its contract only
   (:attr:`~selfspec.drafting.Drafter.static_drafting` and
   :meth:`~selfspec.drafting.Drafter.draft_static`, never its class). A device draft
   (:class:`~selfspec.drafting.StaticDrafting` ``DEVICE``: EAGLE chains, the early exit, the
   hybrid's early-exit rounds) drafts the round's budget of tokens on the device, their real
   length decided there (the cost gate, the confidence stop, end-of-sequence), its draft steps
   compiled with the round's backend (:meth:`~selfspec.drafting.Drafter.compile_device_chain`:
   the EAGLE head's one-query step over a fixed-slot cache; the early exit's through the round's
   own exit steps, layers ``[0, E)`` on one token a step, writing their keys and values, whose
   exit states the drafter hands back: the verify then runs layers ``[E, L)`` on every row). A
   host draft (``HOST``: plain decoding, prompt lookup, the hybrid's copies, a user's chain
   drafter) is sent to the device in one non-blocking copy with its length. The round pads the
   draft to the next fixed width (:data:`~selfspec.modeling.static_step.WIDTHS`; a quantized
   target's widths stop where its kernels are not row-invariant: :attr:`StaticStep.widths`);
2. **score** and 3. **accept**: one forward of that width over the call's bucket of slots, then
   acceptance on the device (greedy inside the compiled step; sampled right after it, on the
   device too), which also moves the cache length past the accepted text;
4. **commit**: the round's **one** device-to-host read (the accepted count and the next token,
   and for a device draft its tokens and length) feeds end-of-sequence, streaming, the statistics
   and the controller, exactly as in the eager loop.

Which calls run here (:func:`static_round_reason`): an engine built with ``compile=True`` (or a
backend name; ``compile="auto"`` means on CUDA), a model on the lean layer path, a drafter whose
``static_drafting`` is not ``NONE`` (token trees are), no grammar constraint, and one generation
at a time (the engine's cache is shared by its calls: a call that finds it busy runs the eager loop).
Everything else runs the eager loop, with the same text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..core.acceptance import Acceptance
from ..core.sampling import logits_to_probs
from ..drafting.base import DecodeState, DeviceDraft, Draft, Drafter, StaticDraft, StaticDrafting
from ..drafting.fitting import truncate_chain
from ..errors import ConfigurationError
from ..modeling.runner import ModelRunner
from ..modeling.static_step import (
    WIDTHS,
    StaticStep,
    accept_sampled_step,
    bucket_for,
    static_prefill,
    static_round_supported,
    width_for,
)
from ..modeling.transfer import device_ids
from .generation import Generation
from .loop import Prefilled, RoundTimes, Row, commit, emitted_rows, first_row, token_logprobs
from .outputs import FinishReason

logger = logging.getLogger(__name__)


def compile_backend(compile: bool | str, device: torch.device) -> str | None:
    """The ``torch.compile`` backend ``compile=`` asks for on ``device`` (``None``: the eager loop)."""
    if compile == "auto":
        return "inductor" if device.type == "cuda" else None
    if compile is True or compile == "on":
        return "inductor"
    if compile is False or compile == "off":
        return None
    return str(compile)


def static_rounds(runner: ModelRunner, compile: bool | str) -> StaticRounds | None:
    """The engine's static round for ``compile=``, or ``None`` when its calls take the eager loop.

    Raises:
        ConfigurationError: ``compile`` was asked for explicitly and the model cannot run the static round.
    """
    backend = compile_backend(compile, runner.device)
    if backend is None:
        return None
    reason = static_round_supported(runner)
    if reason is not None:
        if compile == "auto":
            logger.info("compile='auto': %s; decoding eagerly", reason)
            return None
        raise ConfigurationError(f"compile={compile!r}: {reason}; use compile=False")
    return StaticRounds(StaticStep(runner, backend))


def static_round_reason(drafter: Drafter, run: Generation) -> str | None:
    """Why ``run`` takes the eager loop with this drafter, or ``None`` when the static round serves it."""
    if drafter.static_drafting is StaticDrafting.NONE:
        return f"drafter {drafter.name!r} drafts trees or runs the target's layers itself (static_drafting NONE)"
    if run.constraint is not None:
        return "grammar-constrained calls run the eager loop"
    return None


class StaticRounds:
    """The engine's static round: one :class:`StaticStep`, used by one generation at a time.

    Args:
        step: the engine's step (its cache and compiled forwards).
    """

    def __init__(self, step: StaticStep) -> None:
        self.step = step
        self._busy = threading.Lock()
        self._inputs: _RoundInputs | None = None

    def __repr__(self) -> str:
        return f"StaticRounds({self.step!r})"

    def prepare(
        self, prompt_tokens: int, max_new_tokens: int, sampled: bool = False, drafter: Drafter | None = None
    ) -> None:
        """Compile every width's step for calls of this size now, so that no round waits for it.

        With the engine's ``drafter`` (``engine.drafter``), the steps its rounds use
        (:meth:`~selfspec.drafting.Drafter.prepare_static`: the early exit's draft and verify
        steps too). The EAGLE head's draft step compiles on its first round.
        """
        kinds = ("greedy", "forward") if sampled else ("greedy",)
        slots = prompt_tokens + max_new_tokens + WIDTHS[-1]
        if drafter is None:
            self.step.prepare(slots, kinds=kinds)
        else:
            drafter.prepare_static(self.step, slots, kinds)

    def try_decode(
        self, drafter: Drafter, run: Generation, lock: threading.RLock, eos_token_ids: frozenset[int]
    ) -> Generator[list[int], None, FinishReason] | None:
        """The call's rounds here, or ``None`` when it must take the eager loop (see the module docstring)."""
        if static_round_reason(drafter, run) is not None or not self._busy.acquire(blocking=False):
            return None
        if drafter.static_drafting is StaticDrafting.DEVICE:  # its draft steps too: fixed shapes, this backend
            drafter.compile_device_chain(self.step.backend)
        return self._decode(drafter, run, lock, eos_token_ids)

    def _decode(
        self, drafter: Drafter, run: Generation, lock: threading.RLock, eos_token_ids: frozenset[int]
    ) -> Generator[list[int], None, FinishReason]:
        try:
            slots = len(run.prompt_ids) + run.max_new_tokens + WIDTHS[-1]
            with lock, torch.inference_mode():
                row, last = self._start(drafter, run, slots, eos_token_ids)
            yield [row.state.last_token]
            if row.state.last_token in eos_token_ids:
                return "stop"
            bucket = bucket_for(slots)
            while row.emitted < run.max_new_tokens:
                with lock, torch.inference_mode():
                    tokens, last = self._round(drafter, row, bucket, last)
                yield tokens
                if tokens[-1] in eos_token_ids:
                    return "stop"
            return "length"
        finally:
            self._busy.release()

    def _start(
        self, drafter: Drafter, run: Generation, slots: int, eos_token_ids: frozenset[int]
    ) -> tuple[Row, torch.Tensor]:
        """Prefill the prompt into the engine's cache and choose the first token.

        Returns:
            The row, and its last token as a ``[1]`` tensor on the device (the call's one copy of
            it: each round's comes from its acceptance, on the device).
        """
        started = time.perf_counter()
        runner = self.step.runner
        cache = self.step.reserve(slots)
        if self._inputs is None or self._inputs.device.device != runner.device:
            self._inputs = _RoundInputs.allocate(runner.device)
        ids = device_ids([run.prompt_ids], runner.device)
        hidden, logits = static_prefill(runner, cache, ids, drafter.feature_layers)  # EAGLE-3: its taps
        row = first_row(runner, drafter, run, cache, eos_token_ids, Prefilled(hidden, logits, started))
        last = device_ids([row.state.last_token], runner.device)
        if drafter.needs_committed_hidden:  # the prompt's states are followed by the prompt's tokens and the first
            row.state.pending_tokens = torch.cat([ids[0, 1:], last])
        return row, last

    def _round(self, drafter: Drafter, row: Row, bucket: int, last: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """One round: draft, one fixed-width forward, acceptance on the device, one read, commit.

        ``last``: the row's last token, ``[1]`` on the device. Returns the tokens the round adds
        and the next round's ``last`` (the acceptance's next token, never read back for it).
        """
        state, run = row.state, row.run
        started = time.perf_counter()
        budget = min(run.controller.budget(), run.max_new_tokens - row.emitted - 1, self.step.max_drafts)
        rows = self._draft(drafter, state, budget, bucket, last)
        drafted = time.perf_counter()
        tokens, width = rows.tokens, rows.tokens.shape[1]
        exits = rows.exit_states, rows.exit_layer  # (None, 0): the forward runs every layer
        taps = drafter.feature_layers  # EAGLE-3: the verify hands back the states entering these layers
        if state.params.greedy:
            decided, hidden, logits = self.step.greedy(tokens, rows.real, bucket, *exits, feature_layers=taps)
        else:
            hidden, logits = self.step.forward(tokens, bucket, *exits, feature_layers=taps)
            target_probs = logits_to_probs(logits, state.params)
            draft_probs = _padded(rows.draft_probs, width - 1)
            decided = accept_sampled_step(tokens, rows.real, draft_probs, target_probs, run.generator)
            self.step.cache.length.add_(decided[0] + 1)  # type: ignore[union-attr]
        if drafter.needs_hidden:
            state.last_hidden = hidden
        if rows.host_draft is not None:
            draft = rows.host_draft
            accepted, next_token = decided.tolist()  # the round's one read
        else:  # the round's one read also brings the drafted tokens and how many are real
            accepted, next_token, length, *drafts = torch.cat([decided, rows.real[None], tokens[0, 1:]]).tolist()
            probs = rows.draft_probs
            draft = Draft(tokens=drafts[:length], draft_probs=None if probs is None else probs[:length])
        if rows.settle is not None:  # the drafter learns what it drafted (the hybrid's books)
            rows.settle(draft.tokens)
        acceptance = Acceptance(accepted, next_token)
        tokens_out = commit(drafter, row, draft, acceptance, RoundTimes(started, drafted, time.perf_counter()))
        next_last = decided[1:].clone()  # [1]: a fresh tensor (a graphed step's outputs are overwritten)
        if drafter.needs_committed_hidden:  # the committed states' next tokens, as commit kept those states
            committed = torch.cat([tokens[0, 1 : accepted + 1], next_last])
            pending = state.pending_tokens
            state.pending_tokens = committed if pending is None else torch.cat([pending, committed])
        if run.top_logprobs is not None:
            used = emitted_rows(acceptance)[: len(tokens_out)]
            run.computed_logprobs.extend(token_logprobs(logits[used], tokens_out, run.top_logprobs))
        return tokens_out, next_last

    def _draft(self, drafter: Drafter, state: DecodeState, budget: int, bucket: int, last: torch.Tensor) -> _Rows:
        """The round's draft as the step's rows (:meth:`~selfspec.drafting.Drafter.draft_static`), no host read."""
        if budget <= 0:
            return self._host_rows(state, Draft())
        drafted = drafter.draft_static(state, budget, self.step, bucket)
        rows = self._static_rows(drafter, state, budget, drafted, last)
        rows.settle = drafted.settle
        return rows

    def _static_rows(
        self, drafter: Drafter, state: DecodeState, budget: int, drafted: StaticDraft, last: torch.Tensor
    ) -> _Rows:
        """A :class:`StaticDraft` as the step's rows: a host chain (checked), or a device chain and its exit states."""
        if drafted.device is None:
            draft = truncate_chain(drafted.host or Draft(), budget)
            if draft.parents is not None or draft.exit_states is not None:
                raise ConfigurationError(
                    f"drafter {drafter.name!r} says chain_only but drafted a tree or exit states for the static round"
                )
            return self._host_rows(state, draft)
        rows = self._device_rows(drafted.device, last)
        if drafted.exit_states is not None:  # padded rows never accepted: zero states
            exits = drafted.exit_states
            padding = rows.tokens.shape[1] - exits.shape[1]
            rows.exit_states = torch.cat([exits, exits.new_zeros(1, padding, exits.shape[-1])], dim=1)
            rows.exit_layer = drafted.exit_layer
        return rows

    def _host_rows(self, state: DecodeState, draft: Draft) -> _Rows:
        """A host draft as the step's rows, padded to the width that holds it (one non-blocking copy)."""
        num_draft, width = len(draft), width_for(len(draft))
        padding = [state.last_token] * (width - 1 - num_draft)
        assert self._inputs is not None, "_start() before a round"
        sent = self._inputs.send([state.last_token, *draft.tokens, *padding], num_draft)
        # the strides of a fresh [1, w] (no recompile)
        return _Rows(sent[:width].view(1, width), sent[-1], draft.draft_probs, host_draft=draft)

    @staticmethod
    def _device_rows(draft: DeviceDraft, last: torch.Tensor) -> _Rows:
        """A device draft of ``k`` tokens after ``last`` (``[1]``) as the step's rows, padded to the width (no copy)."""
        width = width_for(draft.width)
        padding = last.expand(width - 1 - draft.width)  # padded rows are never accepted
        tokens = torch.cat([last, draft.tokens, padding]).view(1, width)
        return _Rows(tokens, draft.length, draft.draft_probs)


@dataclass
class _RoundInputs:
    """The round's host-drafted rows, sent through buffers made once (a host draft's one non-blocking copy).

    ``host`` (pinned on CUDA) takes the round's ids from Python through its NumPy view (no tensor
    made from a list); ``device`` receives them in one non-blocking copy (on a CPU they are the
    same buffer: nothing is copied). The previous round's copy out of ``host`` is always done when
    the next round writes it: the previous round read its acceptance back after the copy, on the
    same stream.

    Attributes:
        host: ``[WIDTHS[-1] + 1]`` ``long``: the rows, then the number of real drafts last.
        device: the same on the device.
    """

    host: torch.Tensor
    device: torch.Tensor

    @classmethod
    def allocate(cls, device: torch.device) -> _RoundInputs:
        """Buffers for ``device`` (made as inference tensors, as the rounds' own are)."""
        with torch.inference_mode():
            host = torch.zeros(WIDTHS[-1] + 1, dtype=torch.long, pin_memory=device.type == "cuda")
            sent = host if device.type == "cpu" else torch.zeros_like(host, device=device)
        return cls(host, sent)

    def send(self, rows: list[int], num_draft: int) -> torch.Tensor:
        """:attr:`device` holding ``rows`` first and ``num_draft`` last (what follows the rows is stale)."""
        staged = self.host.numpy()
        staged[: len(rows)] = rows
        staged[-1] = num_draft
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)
        return self.device


@dataclass
class _Rows:
    """What a round's verify step reads.

    Attributes:
        tokens: ``[1, w]`` the last token, then the drafts (padded to the width).
        real: 0-d: how many drafts are real.
        draft_probs: the drafts' distributions (sampled drafts), ``[k, vocab]``.
        host_draft: the draft, when it was drafted on the host (else it is read with the round's result).
        exit_states: ``[1, w, hidden]`` the early exit's states of every row (the verify starts at its layer).
        exit_layer: the early exit's layer (with ``exit_states``).
        settle: the drafter's :attr:`~selfspec.drafting.StaticDraft.settle` (called with the read draft).
    """

    tokens: torch.Tensor
    real: torch.Tensor
    draft_probs: torch.Tensor | None
    host_draft: Draft | None = None
    exit_states: torch.Tensor | None = None
    exit_layer: int = 0
    settle: Callable[[list[int]], None] | None = None


def _padded(draft_probs: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``[k, vocab]`` draft distributions padded with zero rows to ``[rows, vocab]`` (never read past ``k``)."""
    if draft_probs is None or draft_probs.shape[0] == rows:
        return draft_probs
    return torch.cat([draft_probs, draft_probs.new_zeros(rows - draft_probs.shape[0], draft_probs.shape[1])])
