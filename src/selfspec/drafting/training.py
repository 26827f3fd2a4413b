"""The training loop every learned head shares: EAGLE heads, Medusa heads and exit adapters.

Each trainer brings its data (an iterator of batches), its loss and its learning-rate schedule;
this module runs the rest, the same way for all three:

1. **Budget.** Stop at ``max_steps`` optimizer steps or at a wall-clock ``deadline``,
   whichever comes first (checked before each step, so a step never starts past the budget).
2. **Step.** Set the learning rate, compute the loss, clip the gradient norm, take an AdamW step.
3. **Record.** Keep every step's loss, let the trainer evaluate (``on_step``) and show its text
   on the progress bar, and save a checkpoint every ``checkpoint_every`` seconds when asked.

The frozen model never learns: :func:`freeze` switches off its gradients before training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

BatchT = TypeVar("BatchT")


@dataclass(frozen=True)
class TrainingStep:
    """Where training stands when a step starts.

    Attributes:
        step: optimizer steps taken so far (those of a resumed run included).
        fraction: the share of the budget used, in ``[0, 1]``: the larger of the time share and
            (with ``max_steps``) the step share, counted from where this run started.
    """

    step: int
    fraction: float


@dataclass
class StepLoss:
    """A step's loss and whatever else the trainer's loss function computed (shown by ``on_step``)."""

    loss: torch.Tensor
    extra: Any = None


@dataclass
class StepDone:
    """What one step left behind, handed to the trainer's ``on_step``."""

    step: int  # optimizer steps taken so far, this one included
    loss: float
    extra: Any
    losses: list[float]  # every step's loss in this run, this one last


@dataclass
class TrainingLoop(Generic[BatchT]):
    """One run of the shared loop: what it optimises, its budget and its schedule.

    Attributes:
        optimizer: the optimizer of the trained parameters (the head's, never the model's;
            restored from a checkpoint already, when resuming).
        loss_of: the loss of a batch at a given point of training.
        lr_at: the learning rate of a step.
        max_grad_norm: the gradient norm is clipped to this before each step.
        max_steps: stop after this many optimizer steps in all (``None``: no step limit).
        deadline: stop at this :func:`time.perf_counter` value (``None``: no time limit).
        first_step: steps already taken (a resumed run counts on from here).
    """

    optimizer: torch.optim.Optimizer
    loss_of: Callable[[BatchT, TrainingStep], StepLoss]
    lr_at: Callable[[TrainingStep], float]
    max_grad_norm: float
    max_steps: int | None = None
    deadline: float | None = None
    first_step: int = 0


@dataclass
class LoopResult:
    """What the loop did: steps taken in all, every loss of this run, and the seconds it trained."""

    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def freeze(model: Any, seed: int, threads: int | None = None) -> None:
    """Put the frozen model in eval mode without gradients, seed torch and set its threads (when given)."""
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model.eval().requires_grad_(False)


def first_token_id(*candidates: Any) -> int:
    """The first candidate token id that is set (of a list, its first element), else ``0``."""
    for value in candidates:
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def adamw(
    parameters: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999)
) -> torch.optim.AdamW:
    """The optimizer every head trains with: AdamW without weight decay."""
    return torch.optim.AdamW(parameters, lr=lr, betas=betas, weight_decay=0.0)


def warmup_cosine(peak_lr: float, step: int, warmup_steps: int, fraction: float) -> float:
    """Linear warm-up over ``warmup_steps`` steps times a cosine decay over the budget's ``fraction``."""
    warm = min(1.0, (step + 1) / max(warmup_steps, 1))
    return peak_lr * warm * 0.5 * (1.0 + math.cos(math.pi * min(fraction, 1.0)))


def progress_bar(description: str | None, total: int | None, enabled: bool) -> Any:
    """A tqdm bar (hidden when ``enabled`` is false)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, disable=not enabled, unit="step", dynamic_ncols=True)


def run_loop(
    loop: TrainingLoop[BatchT],
    batches: Iterator[BatchT],
    *,
    on_step: Callable[[StepDone], str],
    bar: Any,
    show: Callable[[str], Any] | None = None,
    checkpoint: Callable[[int], None] | None = None,
    checkpoint_every: float = 60.0,
) -> LoopResult:
    """Train until the budget ends or the batches run out.

    Args:
        loop: what to optimise, the budget and the schedule.
        batches: the training batches, pulled one per step (lazily: data written on the fly is
            written only when a step needs it).
        on_step: called after each step (evaluate, keep a history); returns the progress text.
        bar: the progress bar (advanced once per step).
        show: shows the progress text (default: the bar's postfix).
        checkpoint: saves the run, given the step count; called every ``checkpoint_every`` seconds.
        checkpoint_every: seconds between checkpoints.

    Returns:
        The steps taken in all, this run's losses and its training seconds.
    """
    show = show if show is not None else bar.set_postfix_str
    started = last_saved = time.perf_counter()
    time_budget = None if loop.deadline is None else max(loop.deadline - started, 1e-6)
    step_budget = None if loop.max_steps is None else max(loop.max_steps - loop.first_step, 1)
    parameters = [p for group in loop.optimizer.param_groups for p in group["params"]]
    step = loop.first_step
    losses: list[float] = []
    while not _budget_spent(loop, step):
        batch = next(batches, None)
        if batch is None:
            break
        now = time.perf_counter()
        fraction = 0.0 if time_budget is None else (now - started) / time_budget
        if step_budget is not None:
            fraction = max(fraction, (step - loop.first_step) / step_budget)
        at = TrainingStep(step=step, fraction=fraction)
        for group in loop.optimizer.param_groups:
            group["lr"] = loop.lr_at(at)
        outcome = loop.loss_of(batch, at)
        loop.optimizer.zero_grad(set_to_none=True)
        outcome.loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, loop.max_grad_norm)
        loop.optimizer.step()
        step += 1
        losses.append(float(outcome.loss.detach()))
        show(on_step(StepDone(step=step, loss=losses[-1], extra=outcome.extra, losses=losses)))
        bar.update(1)
        if checkpoint is not None and time.perf_counter() - last_saved > checkpoint_every:
            checkpoint(step)
            last_saved = time.perf_counter()
    return LoopResult(steps=step, losses=losses, seconds=time.perf_counter() - started)


def _budget_spent(loop: TrainingLoop[Any], step: int) -> bool:
    """Whether the deadline has passed or ``max_steps`` steps are taken."""
    if loop.max_steps is not None and step >= loop.max_steps:
        return True
    return loop.deadline is not None and time.perf_counter() >= loop.deadline
