"""``selfspec.drafting.training`` and ``selfspec.drafting.commands``: the trainers' shared loop and plumbing."""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass

import pytest
import torch

from selfspec.drafting import training
from selfspec.drafting.commands import add_command, add_model_arguments, settings_from_args


class _Bar:
    """Records what the loop shows (a stand-in for tqdm: the loop only calls these two)."""

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.updates = 0

    def set_postfix_str(self, text: str) -> None:
        self.shown.append(text)

    def update(self, count: int) -> None:
        self.updates += count


def _loop(
    weight: torch.nn.Parameter, lrs: list[float], fractions: list[float], **budget: object
) -> training.TrainingLoop:
    """Fit ``weight`` to 3.0 by squared error; record the learning rates and budget fractions asked for."""

    def loss_of(target: torch.Tensor, at: training.TrainingStep) -> training.StepLoss:
        fractions.append(at.fraction)
        return training.StepLoss(((weight - target) ** 2).sum(), extra=at.step)

    def lr_at(at: training.TrainingStep) -> float:
        lrs.append(0.1)
        return 0.1

    return training.TrainingLoop(
        optimizer=training.adamw([weight], 0.1),
        loss_of=loss_of,
        lr_at=lr_at,
        max_grad_norm=1.0,
        **budget,  # type: ignore[arg-type]
    )


def test_the_loop_runs_to_max_steps_and_learns() -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    lrs: list[float] = []
    fractions: list[float] = []
    bar = _Bar()
    done_steps: list[int] = []

    def on_step(done: training.StepDone) -> str:
        done_steps.append(done.step)
        assert done.losses[-1] == done.loss and done.extra == done.step - 1
        return f"loss {done.loss:.2f}"

    result = training.run_loop(
        _loop(weight, lrs, fractions, max_steps=40), itertools.repeat(torch.tensor([3.0])), on_step=on_step, bar=bar
    )
    assert result.steps == 40 and len(result.losses) == 40 and done_steps == list(range(1, 41))
    assert result.losses[-1] < result.losses[0] / 10  # it learned
    assert bar.updates == 40 and bar.shown[-1] == f"loss {result.losses[-1]:.2f}"
    assert fractions == pytest.approx([i / 40 for i in range(40)])  # the share of the step budget used
    assert weight.grad is not None


def test_the_loop_stops_at_the_deadline_and_when_batches_run_out() -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    past = _loop(weight, [], [], deadline=time.perf_counter() - 1.0)
    assert training.run_loop(past, itertools.repeat(torch.tensor([3.0])), on_step=str, bar=_Bar()).steps == 0
    few = _loop(weight, [], [], max_steps=100)
    assert training.run_loop(few, iter([torch.tensor([3.0])] * 3), on_step=str, bar=_Bar()).steps == 3


def test_a_resumed_loop_counts_on_and_checkpoints() -> None:
    weight = torch.nn.Parameter(torch.zeros(1))
    fractions: list[float] = []
    saved: list[int] = []
    loop = _loop(weight, [], fractions, max_steps=10, first_step=6)
    result = training.run_loop(
        loop,
        itertools.repeat(torch.tensor([3.0])),
        on_step=str,
        bar=_Bar(),
        checkpoint=saved.append,
        checkpoint_every=0,
    )
    assert result.steps == 10 and len(result.losses) == 4
    assert saved == [7, 8, 9, 10]  # every step, with the steps taken in all
    assert fractions == pytest.approx([0.0, 0.25, 0.5, 0.75])  # counted from where this run started


def test_warmup_cosine_and_first_token_id() -> None:
    assert training.warmup_cosine(1.0, 0, 10, 0.0) == pytest.approx(0.1)
    assert training.warmup_cosine(1.0, 9, 10, 0.0) == pytest.approx(1.0)
    assert training.warmup_cosine(1.0, 50, 10, 0.5) == pytest.approx(0.5)
    assert training.warmup_cosine(1.0, 50, 10, 2.0) == pytest.approx(0.0)  # past the budget: no negative rate
    assert training.warmup_cosine(2.0, 0, 0, 0.25) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert training.first_token_id(None, [], [7, 8], 3) == 7
    assert training.first_token_id(None, None) == 0
    assert training.first_token_id(0, 5) == 0  # 0 is a token id, not "unset"


@dataclass
class _Settings:
    exit_layer: int
    steps: int = 400
    num_heads: int = 4
    lr: float = 3e-3


def test_commands_build_settings_from_flags() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    command = add_command(sub, "train-x", summary="train x", func=lambda args: 0)
    add_model_arguments(command, model_help="a model", dtype="float32", trust_remote_code=True)
    command.add_argument("--steps", type=int, default=400)
    command.add_argument("--heads", type=int, default=4)
    args = parser.parse_args(["train-x", "-m", "m", "--steps", "7", "--heads", "2"])
    assert (args.model, args.dtype, args.device, args.trust_remote_code) == ("m", "float32", "auto", False)
    assert args.func(args) == 0
    settings = settings_from_args(_Settings, args, {"num_heads": "heads"}, exit_layer=3)
    assert settings == _Settings(exit_layer=3, steps=7, num_heads=2)  # lr: no flag, the default
