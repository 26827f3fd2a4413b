"""Train Medusa-1 heads by self-distillation: the frozen model teaches the heads its own text.

No dataset is needed. Each step the model writes its own prompts (a few tokens sampled
from BOS, or spans of optional user text) and continues them itself (greedy or sampled,
alternating), then one forward of the frozen model gives, at every position ``t``, the
final hidden state ``h_t`` (after the final norm) and the model's next-token distribution.
Head ``i`` learns to predict, from ``h_t``, the model's own distribution at position
``t + i + 1`` (the token ``i + 2`` steps after ``t``): soft-target cross-entropy, weighted
``decay ** i`` as in Medusa (Cai et al. 2024). The model never changes; the heads are saved
in the published Medusa layout (:meth:`selfspec.drafting.medusa.drafter.MedusaHeads.save`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...artifacts import atomic_write_text
from ...errors import ConfigurationError
from .. import training
from .drafter import MedusaHeads

#: Metadata written beside the heads.
METADATA_FILE = "medusa_training.json"


@dataclass
class MedusaTrainConfig:
    """Settings of :func:`train_medusa_heads`.

    Attributes:
        num_heads: heads to train (head ``i`` predicts ``i + 2`` tokens past its state).
        num_layers: residual blocks per head.
        steps: optimizer steps.
        batch_size: sequences the model writes per round of generation (batched writing
            costs little more than one sequence: generation is bound by per-token overhead).
        micro_batch: sequences per optimizer step (a round gives ``batch_size / micro_batch``
            steps).
        seed_tokens: length of self-made prompts (sampled from BOS at temperature 1).
        new_tokens: tokens the model writes after each prompt.
        lr: peak AdamW learning rate (linear warmup, cosine decay).
        warmup_steps: warmup length.
        loss_decay: head ``i``'s loss weight is ``loss_decay ** i``.
        sample_temperature: every other batch is sampled at this temperature (others greedy).
        max_seconds: stop early after this many seconds (``None``: run every step).
        seed: random seed.
    """

    num_heads: int = 4
    num_layers: int = 1
    steps: int = 200
    batch_size: int = 64
    micro_batch: int = 16
    seed_tokens: int = 8
    new_tokens: int = 64
    lr: float = 3e-3
    warmup_steps: int = 10
    loss_decay: float = 0.8
    sample_temperature: float = 0.8
    max_seconds: float | None = None
    seed: int = 0


@dataclass
class MedusaTrainResult:
    """What training did: the heads, steps, time, last losses and held-out head accuracy."""

    heads: MedusaHeads
    steps_done: int
    seconds: float
    losses: list[float] = field(default_factory=list)
    head_accuracy: list[float] = field(default_factory=list)


def make_prompts(
    model: Any,
    cfg: MedusaTrainConfig,
    rng: random.Random,
    generator: torch.Generator,
    user_tokens: list[int] | None,
) -> torch.Tensor:
    """``[batch, seed_tokens]`` prompts: spans of user text, or sampled by the model from BOS."""
    device = model.device
    if user_tokens and len(user_tokens) > cfg.seed_tokens:
        starts = [rng.randrange(len(user_tokens) - cfg.seed_tokens) for _ in range(cfg.batch_size)]
        return torch.tensor([user_tokens[s : s + cfg.seed_tokens] for s in starts], device=device)
    bos = model.config.bos_token_id
    bos = 0 if bos is None else int(bos)
    ids = torch.full((cfg.batch_size, 1), bos, dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(cfg.seed_tokens - 1):
            probs = torch.softmax(model(ids).logits[:, -1].float(), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids


def continue_text(model: Any, prompts: torch.Tensor, cfg: MedusaTrainConfig, sampled: bool) -> torch.Tensor:
    """The model's own continuation of each prompt (no early stop): ``[batch, seed + new]``."""
    kwargs: dict[str, Any] = {"do_sample": False}
    if sampled:
        kwargs = {"do_sample": True, "temperature": cfg.sample_temperature, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():
        return model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=cfg.new_tokens,
            pad_token_id=model.config.pad_token_id,
            **kwargs,
        )


def teacher_outputs(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model's normed final states ``[b, T, hidden]`` and logits ``[b, T, vocab]``, float32."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # after the final norm
        return hidden.float(), model.lm_head(hidden).float()  # the heads train in float32


def medusa_loss(
    heads: MedusaHeads, hidden: torch.Tensor, teacher_logits: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[float]]:
    """Soft-target cross-entropy of every head against the model's own later distributions.

    Head ``i`` at position ``t`` is matched with ``softmax(teacher_logits[:, t + i + 1])``.

    Returns:
        The weighted total loss and each head's loss.
    """
    length = hidden.shape[1]
    total = hidden.new_zeros((), dtype=torch.float32)
    per_head: list[float] = []
    for i, head in enumerate(heads.heads):
        shift = i + 1
        if length <= shift:
            break
        logits = head(hidden[:, : length - shift]).float()  # [b, T - shift, vocab]
        target = torch.softmax(teacher_logits[:, shift:], dim=-1)  # [b, T - shift, vocab]
        loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + decay**i * loss
        per_head.append(float(loss.detach()))
    return total, per_head


def head_accuracy(heads: MedusaHeads, hidden: torch.Tensor, teacher_logits: torch.Tensor) -> list[float]:
    """Per head: how often its top-1 equals the model's own greedy token ``i + 2`` steps on."""
    accuracy = []
    with torch.no_grad():
        for i, head in enumerate(heads.heads):
            shift = i + 1
            guess = head(hidden[:, :-shift]).argmax(-1)
            accuracy.append(float((guess == teacher_logits[:, shift:].argmax(-1)).float().mean()))
    return accuracy


def train_medusa_heads(
    model: Any,
    cfg: MedusaTrainConfig,
    *,
    user_tokens: list[int] | None = None,
    progress: bool = True,
) -> MedusaTrainResult:
    """Self-distil Medusa-1 heads for a frozen causal LM.

    Args:
        model: a loaded ``*ForCausalLM`` (frozen: its weights are not touched).
        cfg: training settings.
        user_tokens: optional token stream of user text; prompts are spans of it.
        progress: show a progress bar.

    Returns:
        The trained heads (float32, on the model's device) and training statistics.
    """
    if cfg.num_heads < 1 or cfg.steps < 1 or cfg.batch_size < 1 or cfg.new_tokens <= cfg.num_heads:
        raise ConfigurationError(
            "train-medusa needs heads >= 1, steps >= 1, batch size >= 1 and new tokens > heads; "
            f"got heads={cfg.num_heads}, steps={cfg.steps}, batch={cfg.batch_size}, new tokens={cfg.new_tokens}"
        )
    if cfg.seed_tokens < 1:
        raise ConfigurationError(f"seed_tokens must be >= 1, got {cfg.seed_tokens}")
    training.freeze(model, cfg.seed)
    rng = random.Random(cfg.seed)
    generator = torch.Generator(device=model.device).manual_seed(cfg.seed)
    config = model.config
    heads = MedusaHeads(
        cfg.num_heads,
        int(config.hidden_size),
        int(config.vocab_size),
        cfg.num_layers,
        str(getattr(config, "_name_or_path", "") or ""),
    ).to(model.device)
    heads.init_from_lm_head(model.lm_head)

    def lr_at(at: training.TrainingStep) -> float:
        if at.step < cfg.warmup_steps:
            return cfg.lr * (at.step + 1) / cfg.warmup_steps
        progress_ = (at.step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress_))))

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor], _at: training.TrainingStep) -> training.StepLoss:
        hidden, teacher_logits = batch
        loss, per_head = medusa_loss(heads, hidden, teacher_logits, cfg.loss_decay)
        return training.StepLoss(loss, per_head)

    def on_step(done: training.StepDone) -> str:
        return f"loss={done.loss:.3f}, heads={' '.join(f'{x:.2f}' for x in done.extra)}"

    # a fixed held-out batch (greedy, self-made prompts) for the accuracy report
    eval_ids = continue_text(model, make_prompts(model, cfg, rng, generator, None)[:16], cfg, sampled=False)
    eval_hidden, eval_logits = teacher_outputs(model, eval_ids)

    started = time.perf_counter()
    loop = training.TrainingLoop(
        optimizer=training.adamw(heads.parameters(), cfg.lr),
        loss_of=loss_of,
        lr_at=lr_at,
        max_grad_norm=1.0,
        max_steps=cfg.steps,
        deadline=None if cfg.max_seconds is None else started + cfg.max_seconds,
    )
    bar = training.progress_bar("train-medusa", cfg.steps, progress)
    done = training.run_loop(loop, _written_batches(model, cfg, rng, generator, user_tokens), on_step=on_step, bar=bar)
    bar.close()
    heads.eval()
    return MedusaTrainResult(
        heads=heads.requires_grad_(False),
        steps_done=done.steps,
        seconds=time.perf_counter() - started,
        losses=done.losses[-10:],
        head_accuracy=head_accuracy(heads, eval_hidden, eval_logits),
    )


def _written_batches(
    model: Any, cfg: MedusaTrainConfig, rng: random.Random, generator: torch.Generator, user_tokens: list[int] | None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The frozen model's states and logits over text it writes round by round, a micro-batch at a time.

    Each round the model writes a batch (user-text prompts 3 rounds in 4, when given; greedy and
    sampled continuations alternate), then the heads learn from it micro-batch by micro-batch.
    """
    micro = max(1, min(cfg.micro_batch, cfg.batch_size))
    for rounds in itertools.count():
        prompts = make_prompts(model, cfg, rng, generator, user_tokens if rounds % 4 != 3 else None)
        ids = continue_text(model, prompts, cfg, sampled=rounds % 2 == 1)
        for chunk in ids.split(micro):
            yield teacher_outputs(model, chunk)


def save_medusa_training(
    result: MedusaTrainResult, cfg: MedusaTrainConfig, out: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> Path:
    """Save the heads (fp16, published layout) and ``medusa_training.json`` metadata in ``out``."""
    path = result.heads.save(out)
    metadata = {
        "config": asdict(cfg),
        "steps_done": result.steps_done,
        "seconds": round(result.seconds, 1),
        "final_losses": [round(x, 4) for x in result.losses],
        "heldout_head_accuracy": [round(x, 4) for x in result.head_accuracy],
        **(extra or {}),
    }
    atomic_write_text(path / METADATA_FILE, json.dumps(metadata, indent=2) + "\n")
    return path
