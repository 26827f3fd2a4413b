"""LayerSkip-style training and early-exit evaluation for the demo model.

The loss follows LayerSkip (Elhoushi et al., 2024, "LayerSkip: Enabling Early Exit Inference and
Self-Speculative Decoding", arXiv:2404.16710): the final-layer cross entropy plus a weighted cross
entropy of early exits, each read through the model's *shared* final norm and LM head, optionally
with layer dropout whose rate grows with depth. An exit after layer ``E`` uses the hidden state
output by decoder layer ``E - 1``, i.e. ``outputs.hidden_states[E]``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from demo_model.threads import ThreadGovernor

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Optimisation settings.

    Attributes:
        lr: Peak learning rate.
        min_lr_ratio: Final learning rate as a fraction of the peak (cosine schedule).
        warmup_steps: Linear warmup steps.
        weight_decay: AdamW weight decay (not applied to norms).
        grad_clip: Gradient-norm clip.
        exit_layers: Early exits trained alongside the last layer.
        exit_weight: Weight of each early-exit cross entropy.
        layer_dropout: Skip rate of the last layer (linear in depth, 0 for layer 0).
        max_steps: Stop after this many steps (``None``: no step limit).
        max_seconds: Stop after this much training time (``None``: no time limit).
        log_every: Log every this many steps.
    """

    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    exit_layers: tuple[int, ...] = (2, 4, 8)
    exit_weight: float = 0.2
    layer_dropout: float = 0.0
    max_steps: int | None = None
    max_seconds: float | None = None
    log_every: int = 10


@dataclass
class TrainResult:
    """What a training run did."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_loss: float = math.nan
    last_loss: float = math.nan
    history: list[dict[str, float]] = field(default_factory=list)


def exit_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of an early exit: the shared final norm and LM head applied to ``hidden``."""
    return model.lm_head(model.model.norm(hidden))


def layerskip_loss(
    model: LlamaForCausalLM, window: torch.Tensor, cfg: TrainConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Final cross entropy plus ``exit_weight`` times each early exit's cross entropy.

    Args:
        model: The model.
        window: Token windows of shape ``(batch, seq_len + 1)``.
        cfg: Training settings (exit layers and weight).

    Returns:
        The loss to minimise and its parts as floats (``final``, ``exit2``, ...).
    """
    inputs, labels = window[:, :-1], window[:, 1:].reshape(-1)
    out = model(input_ids=inputs, output_hidden_states=True, use_cache=False)
    vocab = out.logits.shape[-1]
    final = F.cross_entropy(out.logits.reshape(-1, vocab), labels)
    loss, parts = final, {"final": final.item()}
    for e in cfg.exit_layers:
        ce = F.cross_entropy(exit_logits(model, out.hidden_states[e]).reshape(-1, vocab), labels)
        loss = loss + cfg.exit_weight * ce
        parts[f"exit{e}"] = ce.item()
    return loss, parts


def _skip_layer(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """Forward of a dropped decoder layer: the identity on the residual stream."""
    return hidden_states


@contextmanager
def layer_dropout(model: LlamaForCausalLM, max_rate: float, rng: random.Random) -> Iterator[int]:
    """Skip a random subset of decoder layers for one step (rate linear in depth).

    Args:
        model: The model.
        max_rate: Skip probability of the last layer; layer ``l`` uses ``max_rate * l / (L - 1)``.
        rng: Random generator.

    Yields:
        The number of layers skipped.
    """
    layers = model.model.layers
    dropped = [m for i, m in enumerate(layers) if rng.random() < max_rate * i / max(1, len(layers) - 1)]
    for m in dropped:
        m.forward = _skip_layer
    try:
        yield len(dropped)
    finally:
        for m in dropped:
            del m.forward


def make_optimizer(model: LlamaForCausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, progress: float, cfg: TrainConfig) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_lr_ratio``."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _progress(step: int, elapsed: float, cfg: TrainConfig) -> float:
    """Fraction of the step or time budget used (the larger of the two)."""
    by_steps = step / cfg.max_steps if cfg.max_steps else 0.0
    by_time = elapsed / cfg.max_seconds if cfg.max_seconds else 0.0
    return max(by_steps, by_time)


def train(
    model: LlamaForCausalLM,
    batches: Callable[[float], torch.Tensor],
    cfg: TrainConfig,
    seed: int = 0,
    governor: ThreadGovernor | None = None,
) -> TrainResult:
    """Train until the step or time budget is spent.

    Args:
        model: The model (trained in place).
        batches: Returns the next ``(batch, seq_len + 1)`` token windows, given the fraction of
            the budget used so far (which allows a curriculum).
        cfg: Training settings.
        seed: Seed of the layer-dropout generator.
        governor: Optional thread-count governor, consulted every step.

    Returns:
        Steps, tokens, time and the loss history.
    """
    if cfg.max_steps is None and cfg.max_seconds is None:
        raise ValueError("give max_steps or max_seconds")
    model.train()
    opt, rng, res = make_optimizer(model, cfg), random.Random(seed), TrainResult()
    start, window_loss = time.monotonic(), []
    while _progress(res.steps, time.monotonic() - start, cfg) < 1.0:
        progress = _progress(res.steps, time.monotonic() - start, cfg)
        batch = batches(progress)
        if governor is not None:
            governor.update()
        for g in opt.param_groups:
            g["lr"] = cfg.lr * lr_factor(res.steps, progress, cfg)
        with layer_dropout(model, cfg.layer_dropout, rng):
            loss, parts = layerskip_loss(model, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        res.steps, res.tokens = res.steps + 1, res.tokens + batch[:, 1:].numel()
        res.first_loss = parts["final"] if res.steps == 1 else res.first_loss
        window_loss.append(parts["final"])
        if res.steps % cfg.log_every == 0 or res.steps == 1:
            _log_step(res, parts, opt.param_groups[0]["lr"], time.monotonic() - start)
    res.seconds = time.monotonic() - start
    res.last_loss = sum(window_loss[-cfg.log_every :]) / len(window_loss[-cfg.log_every :])
    model.eval()
    return res


def _log_step(res: TrainResult, parts: dict[str, float], lr: float, elapsed: float) -> None:
    """Record and log one step's losses and throughput."""
    entry = {"step": res.steps, "seconds": round(elapsed, 1), "lr": lr, "threads": torch.get_num_threads(), **parts}
    res.history.append(entry)
    exits = " ".join(f"{k}={v:.3f}" for k, v in parts.items() if k != "final")
    logger.info(
        "step %d  %.0fs  lr %.2e  loss %.3f  %s  %.0f tok/s  %d thr",
        res.steps,
        elapsed,
        lr,
        parts["final"],
        exits,
        res.tokens / max(elapsed, 1e-9),
        torch.get_num_threads(),
    )


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: Sequence[Sequence[int]], batch_size: int = 8) -> dict:
    """Greedy agreement of every early exit with the last layer, and cross entropies.

    Args:
        model: The model.
        windows: Token windows (each of length ``seq_len + 1``).
        batch_size: Windows per forward pass.

    Returns:
        ``{"agreement": {E: a}, "loss": {"final": ..., "exitE": ...}, "accuracy": ..., "tokens": n}``
        where ``a`` is the fraction of positions whose exit-``E`` argmax equals the last layer's.
    """
    model.eval()
    num_layers = model.config.num_hidden_layers
    agree, loss = [0] * num_layers, [0.0] * (num_layers + 1)
    correct = count = 0
    for i in range(0, len(windows), batch_size):
        batch = torch.tensor(windows[i : i + batch_size])
        inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
        out = model(input_ids=inputs, output_hidden_states=True, use_cache=False)
        final = out.logits.reshape(labels.numel(), -1).float()
        target = final.argmax(-1)
        correct += int((target == labels).sum())
        loss[num_layers] += float(F.cross_entropy(final, labels, reduction="sum"))
        for e in range(1, num_layers):
            logits = exit_logits(model, out.hidden_states[e]).reshape(labels.numel(), -1).float()
            agree[e] += int((logits.argmax(-1) == target).sum())
            loss[e] += float(F.cross_entropy(logits, labels, reduction="sum"))
        count += labels.numel()
    return {
        "agreement": {str(e): round(agree[e] / count, 4) for e in range(1, num_layers)},
        "loss": {
            "final": round(loss[num_layers] / count, 4),
            **{f"exit{e}": round(loss[e] / count, 4) for e in range(1, num_layers)},
        },
        "accuracy": round(correct / count, 4),
        "tokens": count,
    }


def expected_speedup(a: float, k: int, exit_layer: int, num_layers: int) -> float:
    """Speculative speedup model ``(1 - a^(k+1)) / ((1 - a)(k c + 1))``, ``c = E/L + 0.05``."""
    c = exit_layer / num_layers + 0.05
    accepted = (k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return accepted / (k * c + 1)


def choose_exit(
    agreement: dict[str, float], num_layers: int, max_exit: int = 8, max_drafts: int = 8
) -> tuple[int, int, float]:
    """Pick the exit layer and draft length that maximise :func:`expected_speedup`.

    Args:
        agreement: Greedy agreement per exit layer (string keys).
        num_layers: Number of decoder layers.
        max_exit: Largest exit layer considered.
        max_drafts: Largest number of draft tokens considered.

    Returns:
        ``(exit_layer, num_draft_tokens, expected_speedup)``.
    """
    candidates = (
        (expected_speedup(agreement[str(e)], k, e, num_layers), e, k)
        for e in range(1, max_exit + 1)
        for k in range(1, max_drafts + 1)
    )
    best, e, k = max(candidates)
    return e, k, best
