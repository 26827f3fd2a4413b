"""Self-distil an exit adapter: the model teaches its own early exit, no dataset needed.

The frozen model writes its own training text: from its beginning-of-text token it samples
continuations (at a few temperatures, so the text covers both the model's likely paths and
its spread). On that text, the adapter between layer ``E`` and the shared norm and head
(:class:`~selfspec.drafting.exit_adapter.adapter.ExitAdapter`) is trained to match the model's last layer::

    loss = KL(softmax(head(norm(h_L))) || softmax(head(norm(adapter(h_E)))))

averaged over every position (knowledge distillation, Hinton et al. 2015; self-distilled
draft heads as in Medusa-2, Cai et al. 2024). Only the adapter learns; the model, its norm and
its head stay frozen, so the target's text never changes. User text (``texts``) is optional
and is mixed in as extra windows.

Usage: ``selfspec train-adapter --model M [--exit-layer E --steps N --out DIR --data FILE]``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import training
from .adapter import ExitAdapter, ExitAdapterConfig

logger = logging.getLogger(__name__)


@dataclass
class AdapterTrainConfig:
    """Settings of one self-distillation run.

    Attributes:
        exit_layer: the drafter's exit layer ``E`` the adapter reads.
        steps: optimisation steps.
        rank: width of the adapter's gated projection.
        sequences: self-generated training sequences (the pool the batches are drawn from).
        eval_sequences: self-generated held-out sequences for the before/after agreement.
        seq_len: tokens per generated sequence (and per window of user text).
        batch_size: sequences per step.
        lr: peak AdamW learning rate (cosine decay after a short warmup).
        temperatures: sampling temperatures of the generated text, cycled over the pool.
        seed: seeds text generation, batch order and the adapter's initialisation.
    """

    exit_layer: int
    steps: int = 400
    rank: int = 64
    sequences: int = 128
    eval_sequences: int = 16
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-3
    temperatures: tuple[float, ...] = (1.0, 0.7)
    seed: int = 0


@dataclass
class AdapterTrainResult:
    """What a run did: the adapter and its numbers."""

    adapter: ExitAdapter
    steps: int
    seconds: float
    kl_first: float
    kl_last: float
    agreement_before: float  # greedy agreement of the plain exit with the last layer (held out)
    agreement_after: float  # the same with the adapter

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers (without the module)."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in vars(self).items() if k != "adapter"}


def _start_token(model: Any) -> int:
    """The token the model's own text starts from: its BOS (else pad, else EOS, else 0)."""
    names = ("bos_token_id", "pad_token_id", "eos_token_id")
    return training.first_token_id(
        *(getattr(source, name, None) for source in (model.generation_config, model.config) for name in names)
    )


@torch.no_grad()
def self_generated_sequences(
    model: Any,
    count: int,
    length: int,
    temperatures: Sequence[float],
    seed: int,
    batch_size: int = 16,
    progress: bool = False,
) -> list[list[int]]:
    """``count`` sequences of ``length`` tokens the model samples from its own start token.

    Args:
        model: the frozen causal LM.
        count: number of sequences.
        length: tokens per sequence (the start token included).
        temperatures: sampling temperatures, one per batch in turn.
        seed: seed of the sampling.
        batch_size: sequences sampled together.
        progress: show a progress bar.
    """
    device = model.get_input_embeddings().weight.device
    start = _start_token(model)
    torch.manual_seed(seed)
    out: list[list[int]] = []
    starts = range(0, count, batch_size)
    for i, first in enumerate(tqdm(starts, desc="sampling the model's own text", disable=not progress)):
        n = min(batch_size, count - first)
        ids = torch.full((n, 1), start, dtype=torch.long, device=device)
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperatures[i % len(temperatures)],
            top_k=0,
            top_p=1.0,
            max_new_tokens=length - 1,
            min_new_tokens=length - 1,  # no early stop: every sequence is a full window
            pad_token_id=start,
        )
        out += [[int(t) for t in row] for row in generated]
    return out


def text_windows(tokenizer: Any, texts: Sequence[str], length: int) -> list[list[int]]:
    """User text as windows of ``length`` token ids (a shorter last piece is dropped)."""
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]


def _student_logits(model: Any, adapter: ExitAdapter, exit_state: torch.Tensor) -> torch.Tensor:
    """Draft logits ``head(norm(adapter(h_E)))`` in float32 (gradients reach only the adapter)."""
    adapted = adapter(exit_state.float()).to(exit_state.dtype)
    return model.lm_head(model.model.norm(adapted)).float()


def distill_loss(model: Any, adapter: ExitAdapter, exit_layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """KL(last layer || adapted exit) over every position of ``ids`` ``[batch, seq]``.

    Returns:
        The loss and the greedy agreement of the adapted exit with the last layer.
    """
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        target_logp = F.log_softmax(out.logits.float(), dim=-1).flatten(0, 1)  # [batch * seq, vocab]
        exit_state = out.hidden_states[exit_layer]  # [batch, seq, hidden]
    draft_logp = F.log_softmax(_student_logits(model, adapter, exit_state), dim=-1).flatten(0, 1)
    loss = F.kl_div(draft_logp, target_logp, log_target=True, reduction="batchmean")
    agreement = float((draft_logp.argmax(-1) == target_logp.argmax(-1)).float().mean())
    return loss, agreement


@torch.no_grad()
def exit_agreement(model: Any, adapter: ExitAdapter | None, exit_layer: int, sequences: list[list[int]]) -> float:
    """Greedy agreement with the last layer of the exit (adapted, or plain when ``adapter`` is None)."""
    device = model.get_input_embeddings().weight.device
    agree = total = 0
    for i in range(0, len(sequences), 8):
        ids = torch.tensor(sequences[i : i + 8], device=device)
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        state = out.hidden_states[exit_layer]
        if adapter is None:
            draft = model.lm_head(model.model.norm(state))
        else:
            draft = _student_logits(model, adapter, state)
        agree += int((draft.argmax(-1) == out.logits.argmax(-1)).sum())
        total += ids.numel()
    return agree / max(1, total)


def _pool_batches(pool: list[list[int]], config: AdapterTrainConfig, device: Any) -> Iterator[torch.Tensor]:
    """Batches of ``[batch_size, seq_len]`` ids from the pool, in a seeded order that reshuffles as it runs out."""
    rng = random.Random(config.seed)
    order: list[int] = []
    while True:
        if len(order) < config.batch_size:
            order += rng.sample(range(len(pool)), len(pool))
        batch, order = order[: config.batch_size], order[config.batch_size :]
        yield torch.tensor([pool[i] for i in batch], device=device)


def train_exit_adapter(
    model: Any,
    config: AdapterTrainConfig,
    *,
    tokenizer: Any = None,
    texts: Sequence[str] = (),
    progress: bool = True,
) -> AdapterTrainResult:
    """Train an exit adapter for ``model`` by self-distillation.

    Args:
        model: a loaded causal LM of a supported architecture (kept frozen and unchanged).
        config: the run's settings.
        tokenizer: needed only with ``texts``.
        texts: optional user text mixed into the self-generated pool.
        progress: show progress bars.

    Returns:
        The trained adapter (float32, on the model's device) and its numbers.
    """
    num_layers = int(model.config.num_hidden_layers)
    if not 1 <= config.exit_layer < num_layers:
        from ...errors import ConfigurationError

        raise ConfigurationError(f"exit_layer must be in [1, {num_layers - 1}], got {config.exit_layer}")
    training.freeze(model, config.seed)
    device = model.get_input_embeddings().weight.device
    adapter = ExitAdapter(
        ExitAdapterConfig(
            exit_layer=config.exit_layer,
            hidden_size=int(model.config.hidden_size),
            rank=config.rank,
            num_layers=num_layers,
            vocab_size=int(model.config.vocab_size),
            model_type=str(model.config.model_type),
            rms_norm_eps=float(getattr(model.config, "rms_norm_eps", 1e-6)),
        )
    ).to(device)
    started = time.monotonic()
    total = config.sequences + config.eval_sequences
    logger.info("sampling %d sequences of %d tokens from the model itself", total, config.seq_len)
    pool = self_generated_sequences(model, total, config.seq_len, config.temperatures, config.seed, progress=progress)
    held_out, pool = pool[: config.eval_sequences], pool[config.eval_sequences :]
    if texts:
        if tokenizer is None:
            raise ValueError("texts need a tokenizer")
        pool += text_windows(tokenizer, texts, config.seq_len)
    before = exit_agreement(model, None, config.exit_layer, held_out)
    warmup = max(1, config.steps // 20)

    def loss_of(ids: torch.Tensor, _at: training.TrainingStep) -> training.StepLoss:
        loss, agreement = distill_loss(model, adapter, config.exit_layer, ids)
        return training.StepLoss(loss, agreement)

    def on_step(done: training.StepDone) -> str:
        recent = done.losses[-20:]
        return f"kl={sum(recent) / len(recent):.3f}, agree={done.extra:.2f}"

    loop = training.TrainingLoop(
        optimizer=training.adamw(adapter.parameters(), config.lr),
        loss_of=loss_of,
        lr_at=lambda at: training.warmup_cosine(config.lr, at.step, warmup, at.fraction),
        max_grad_norm=1.0,
        max_steps=config.steps,
    )
    bar = training.progress_bar(f"exit adapter (layer {config.exit_layer})", config.steps, progress)
    adapter.train()
    done = training.run_loop(loop, _pool_batches(pool, config, device), on_step=on_step, bar=bar)
    bar.close()
    kl_first = done.losses[0] if done.losses else float("nan")
    kl_last = sum(done.losses[-20:]) / len(done.losses[-20:]) if done.losses else float("nan")
    adapter.eval().requires_grad_(False)
    after = exit_agreement(model, adapter, config.exit_layer, held_out)
    result = AdapterTrainResult(adapter, config.steps, time.monotonic() - started, kl_first, kl_last, before, after)
    adapter.config.training = {**asdict(config), **result.summary(), "user_text_windows": len(pool) - config.sequences}
    adapter.config.training["temperatures"] = list(config.temperatures)
    return result
