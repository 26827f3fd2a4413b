"""Train an EAGLE-style head by self-distillation: the frozen model writes its own training text.

No dataset is needed (EAGLE, Li et al. 2024; EAGLE-3's training-time test, Li et al. 2025):

1. **Write.** The model answers a built-in, varied prompt mix
   (:mod:`selfspec.drafting.eagle.prompts`: chat turns, RAG questions over a passage, summaries,
   code, continuations; through its chat template when it has one), batched, alternating greedy
   and sampled answers.
2. **Record.** The same lean decoding loop (the model's decoder and LM head, no per-layer
   states, no stored logits) keeps every position's feature ``f_t`` (the last layer's output
   after the final norm), stored in half precision with the log-normaliser and argmax of the
   model's own next-token distribution, so the model's logits never need recomputing over the
   full vocabulary and no second forward runs.
3. **Train.** The head reads ``(f_t, x_{t+1})`` and predicts ``f_{t+1}``; it is unrolled for
   ``unroll`` steps on its own predictions (step ``s`` at position ``j`` reads step ``s - 1``'s
   prediction from ``j - 1`` and attends to the true entries up to ``j - s`` and to its own chain,
   as in drafting). Loss per step, weighted ``0.8 ** s``: cross-entropy against the model's own
   distribution (soft targets, on the draft vocabulary) plus a SmoothL1 regression onto the true
   next feature (EAGLE-1). Answer positions weigh 1, prompt positions ``prompt_weight``. The
   first ``unroll_after`` of the training time is teacher-forced (one step), then unrolled.

The wall time is bounded (``max_seconds``: a share for writing, the rest for training), the work
is resumable (the recorded data and a checkpoint live in a state folder), and a held-out part of
the prompts gives the live agreement on the progress bar.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...artifacts import atomic_write_text
from ...errors import ConfigurationError
from ...modeling.compat import cache_kwargs
from .. import training
from . import resume
from .head import EagleHead, EagleHeadConfig
from .prompts import Prompt, prompt_mix

#: Training figures and history written beside the head.
RECORD_FILE = "eagle_training.json"
#: Draft steps the held-out agreement is measured for (at least; more when training unrolls more).
EVAL_STEPS = 3


@dataclass
class EagleTrainConfig:
    """Settings of :func:`train_eagle_head`.

    Attributes:
        max_seconds: wall-time budget for writing and training together.
        write_share: the part of the budget spent writing data (the rest trains).
        new_tokens: tokens the model writes per prompt.
        batch_size: prompts written together (a decoding step's cost grows slowly with the batch).
        max_samples: the most prompts answered (``None``: as many as the budget allows).
        sample_temperature: every other batch is sampled at this temperature (others greedy).
        draft_vocab_size: the reduced draft vocabulary (most frequent tokens of the written
            text); ``0`` keeps the full vocabulary.
        unroll: training-time-test steps (``1``: teacher forcing only, EAGLE-1).
        unroll_after: the share of the training time spent teacher-forced (one step) before
            unrolling: the first draft step learns several times faster alone, the unrolled steps
            then teach the later draft steps to read the head's own predictions.
        micro_batch: sequences per optimizer step.
        lr: peak AdamW learning rate (warmup, then cosine decay over the training time).
        warmup_steps: warmup length.
        regression_weight: weight of the SmoothL1 feature regression (the cross-entropy has 1).
        feature_noise: half-width of the uniform noise added to the target's features the head
            reads while training (EAGLE-1's regulariser: drafting reads the head's own, imperfect
            features after the first step); ``0`` adds none.
        step_decay: weight of unrolled step ``s`` is ``step_decay ** s``.
        prompt_weight: loss weight of prompt positions (answers weigh 1): the model's own
            distribution is a valid target there too, and prompt tokens cost as much to write.
        heldout_share: part of the written samples held out for the live agreement.
        max_steps: stop after this many optimizer steps (``None``: train until the budget ends).
        eval_every: evaluate on the held-out samples every this many steps.
        seed: random seed.
        threads: torch threads (``None``: leave as is).
        init_from_last_layer: start the head's layer from a copy of the target's last layer
            (``False``: the layer class's own random initialisation).
        head_format: ``"selfspec"`` (EAGLE-1-style: the last layer's features, the target's norm
            and LM head) or ``"eagle3"`` (EAGLE-3: fused taps of ``feature_layers``, its own norm
            and LM head; saved in vLLM's ``speculators`` layout, which ``vllm serve`` runs).
    """

    max_seconds: float = 1200.0
    write_share: float = 0.5
    new_tokens: int = 128
    batch_size: int = 64
    max_samples: int | None = None
    sample_temperature: float = 0.7
    draft_vocab_size: int = 8192
    unroll: int = 3
    unroll_after: float = 0.4
    micro_batch: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    regression_weight: float = 1.0
    feature_noise: float = 0.0
    step_decay: float = 0.8
    prompt_weight: float = 0.5
    heldout_share: float = 0.04
    max_steps: int | None = None
    eval_every: int = 50
    seed: int = 0
    threads: int | None = None
    init_from_last_layer: bool = False
    head_format: str = "selfspec"
    #: ``head_format="eagle3"``: the target layers tapped (``None``: EAGLE-3's default ``2, L // 2, L - 3``).
    feature_layers: tuple[int, ...] | None = None


#: Head formats :func:`train_eagle_head` trains: selfspec's own (EAGLE-1-style, last-layer features)
#: and EAGLE-3 (fused taps of three layers; exports to vLLM's speculators layout).
HEAD_FORMATS = ("selfspec", "eagle3")


@dataclass
class Sample:
    """One answered prompt: tokens, where the answer starts, and what the model computed there."""

    ids: torch.Tensor  # [T] int64: prompt + answer
    answer_start: int  # first answer position
    features: torch.Tensor  # [T, H] float16: last-layer features after the final norm
    log_norm: torch.Tensor  # [T] float32: logsumexp of the model's logits at each position
    argmax: torch.Tensor  # [T] int64: the model's greedy next token at each position
    kind: str = ""
    taps: torch.Tensor | None = None  # [T, n * H] float16: EAGLE-3 format, the states entering the tapped layers


@dataclass
class EagleTrainResult:
    """What training did: the head, its data, steps, time and held-out agreement."""

    head: EagleHead
    figures: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template, when the tokenizer has one.

    A list of ints is taken as token ids already (``tokenizer`` may then be ``None``).
    """
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return [int(token) for token in prompt]  # type: ignore[arg-type]
    if isinstance(prompt, list):
        messages: list[Any] = list(prompt)
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages) + "\nAssistant:"
        return list(tokenizer(text)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _pad_id(model: Any, tokenizer: Any) -> int:
    """The padding token: the tokenizer's pad (else EOS), else the model's, else 0."""
    given = (tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()
    return training.first_token_id(*given, model.config.pad_token_id, model.config.eos_token_id)


@torch.no_grad()
def write_batch(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    kinds: list[str],
    cfg: EagleTrainConfig,
    sampled: bool,
    seed: int,
    feature_layers: tuple[int, ...] | None = None,
) -> list[Sample]:
    """The model's own answers to a batch of prompts, with what it computed along the way.

    A lean left-padded batched decoding loop over the model's decoder (``model.model``) and LM
    head: each step keeps only the features it computes anyway (the last layer's output after
    the final norm, ``[B, q, H]``) and, from the next-token logits, their log-normaliser and
    argmax. No per-layer hidden states, no stored full-vocabulary logits, no second forward.
    The prompt positions' logits (the prefill keeps only the last one) come from their features
    and the frozen LM head. An answer ends at the first end-of-sequence token (finished rows
    idle until every row is done); the last written token has no feature yet and is dropped.
    With ``feature_layers`` (EAGLE-3 heads), forward hooks also keep the states entering those
    layers, computed by the same forwards.
    """
    from transformers import DynamicCache

    device = model.device
    pad = _pad_id(model, tokenizer)
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    eos_list = sorted(set(eos if isinstance(eos, list) else [eos])) if eos is not None else []
    eos_ids = torch.tensor(eos_list, dtype=torch.long, device=device)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    generator = torch.Generator(device=device).manual_seed(seed) if sampled else None
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, width), pad, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=device)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    step_features, step_log_norm, step_argmax, written = [], [], [], []
    tapped: dict[int, list[torch.Tensor]] = {}
    hooks = _tap_hooks(model, feature_layers, tapped) if feature_layers else []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    inputs = ids
    for _ in range(cfg.new_tokens):
        hidden = model.model(
            input_ids=inputs,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs(model.model, cache),
        ).last_hidden_state  # [B, q, H]: features after the final norm
        step_features.append(hidden)
        logits = model.lm_head(hidden[:, -1]).float()  # [B, vocab]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        step_log_norm.append(torch.logsumexp(logits, dim=-1))
        greedy = logits.argmax(-1)
        step_argmax.append(greedy)
        if sampled:
            probs = torch.softmax(logits / cfg.sample_temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            token = greedy
        token = torch.where(finished, torch.full_like(token, pad), token)
        written.append(token)
        if eos_ids.numel():
            finished |= torch.isin(token, eos_ids)
        if bool(finished.all()):
            break
        inputs = token[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    for hook in hooks:
        hook.remove()
    features = torch.cat(step_features, dim=1)  # [B, width + steps - 1, H]
    taps = torch.cat([torch.cat(tapped[i], dim=1) for i in feature_layers], dim=-1) if feature_layers else None
    log_norm = torch.stack(step_log_norm, dim=1).cpu()  # [B, steps]: at position width - 1 + i
    argmax = torch.stack(step_argmax, dim=1).cpu()
    tokens = torch.stack(written, dim=1).tolist()  # [B, steps]
    eos_set = set(eos_list)
    samples = []
    for row, prompt in enumerate(prompts):
        answer = tokens[row]
        for i, token in enumerate(answer):
            if token in eos_set:
                answer = answer[: i + 1]
                break
        if len(answer) < 2:
            continue
        kept = len(prompt) + len(answer) - 1  # positions with a feature
        first = width - len(prompt)
        row_features = features[row, first : first + kept]
        row_log_norm = torch.zeros(kept)
        row_argmax = torch.full((kept,), -1, dtype=torch.long)
        row_log_norm[len(prompt) - 1 :] = log_norm[row, : len(answer)]
        row_argmax[len(prompt) - 1 :] = argmax[row, : len(answer)]
        if len(prompt) > 1:  # the prompt positions' own distributions (the loop scored only the last)
            prompt_logits = model.lm_head(row_features[: len(prompt) - 1]).float()
            if softcap is not None:
                prompt_logits = torch.tanh(prompt_logits / softcap) * softcap
            row_log_norm[: len(prompt) - 1] = torch.logsumexp(prompt_logits, dim=-1).cpu()
            row_argmax[: len(prompt) - 1] = prompt_logits.argmax(-1).cpu()
        samples.append(
            Sample(
                ids=torch.tensor([*prompt, *answer[:-1]], dtype=torch.long),
                answer_start=len(prompt),
                features=row_features.to(torch.float16).cpu(),
                log_norm=row_log_norm,
                argmax=row_argmax,
                kind=kinds[row],
                taps=None if taps is None else taps[row, first : first + kept].to(torch.float16).cpu(),
            )
        )
    return samples


def _tap_hooks(model: Any, feature_layers: tuple[int, ...], tapped: dict[int, list[torch.Tensor]]) -> list[Any]:
    """Forward hooks that append the state entering each tapped layer (``L``: the last output) per step."""
    layers = model.model.layers
    for i in feature_layers:
        tapped[i] = []

    def before(index: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tapped[index].append(args[0] if args else kwargs["hidden_states"])

        return hook

    def after(_module: Any, _args: Any, out: Any) -> None:
        tapped[len(layers)].append(out if torch.is_tensor(out) else out[0])

    hooks = [
        layers[i].register_forward_pre_hook(before(i), with_kwargs=True) for i in set(feature_layers) if i < len(layers)
    ]
    if len(layers) in feature_layers:
        hooks.append(layers[-1].register_forward_hook(after))
    return hooks


def choose_draft_vocab(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor | None:
    """The ``size`` most frequent tokens of the written text and of the model's greedy choices (sorted)."""
    if size <= 0 or size >= vocab_size:
        return None
    counts: Counter[int] = Counter()
    for sample in samples:
        counts.update(sample.ids.tolist())
        counts.update(sample.argmax[sample.answer_start - 1 :].tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    if len(chosen) < size:  # fill up with the lowest ids not seen
        seen = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


class _UnrollCache:
    """Keys and values of every unrolled step so far, concatenated (gradients flow through them)."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=-2)
        self.values = value if self.values is None else torch.cat([self.values, value], dim=-2)
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]


def unroll_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """``[length, (step + 1) * length]``: what step ``step``'s entry at ``j`` sees.

    The true entries (step 0) up to ``j - step``, and step ``r``'s entry at ``j - step + r``
    (``1 <= r <= step``): the chain a draft of ``step + 1`` tokens started after ``j - step`` builds.
    """
    j = torch.arange(length, device=device)[:, None]
    p = torch.arange(length, device=device)[None, :]
    blocks = [p <= j - step] + [p == j - step + r for r in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


@dataclass
class _Batch:
    ids: torch.Tensor  # [B, T]
    features: torch.Tensor  # [B, T, H] float32
    log_norm: torch.Tensor  # [B, T]
    argmax: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T - 1]: entry j is trained on (it has a target)
    answer: torch.Tensor  # [B, T - 1]: entry j's target x_{j+2} is an answer token
    taps: torch.Tensor | None = None  # [B, T, n * H] float32: EAGLE-3 taps


def collate(samples: list[Sample], device: torch.device) -> _Batch:
    """Right-pad samples into one batch."""
    width = max(int(s.ids.shape[0]) for s in samples)
    hidden = samples[0].features.shape[-1]
    b = len(samples)
    ids = torch.zeros(b, width, dtype=torch.long)
    features = torch.zeros(b, width, hidden)
    log_norm = torch.zeros(b, width)
    argmax = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width - 1, dtype=torch.bool)
    answer = torch.zeros(b, width - 1, dtype=torch.bool)
    taps = torch.zeros(b, width, samples[0].taps.shape[-1]) if samples[0].taps is not None else None
    for row, s in enumerate(samples):
        n = int(s.ids.shape[0])
        if taps is not None and s.taps is not None:
            taps[row, :n] = s.taps.float()
        ids[row, :n], features[row, :n], log_norm[row, :n], argmax[row, :n] = (
            s.ids,
            s.features.float(),
            s.log_norm,
            s.argmax,
        )
        valid[row, : n - 1] = True
        answer[row, max(0, s.answer_start - 2) : n - 1] = True
    return _Batch(
        ids.to(device),
        features.to(device),
        log_norm.to(device),
        argmax.to(device),
        valid.to(device),
        answer.to(device),
        None if taps is None else taps.to(device),
    )


def unrolled_forward(head: EagleHead, batch: _Batch, steps: int, noise: float = 0.0) -> list[torch.Tensor]:
    """The head's predicted features ``[B, T - 1, H]`` at each unrolled step (entry ``j`` predicts ``f_{j+1}``).

    ``noise`` adds uniform noise in ``[-noise, noise]`` to the target features the first step reads.
    """
    b, width = batch.ids.shape
    n = width - 1
    device = batch.ids.device
    positions = torch.arange(n, device=device)[None].expand(b, -1)
    next_tokens = batch.ids[:, 1:]
    cache = _UnrollCache()
    if head.capture_layers is not None:  # EAGLE-3: the fused taps
        assert batch.taps is not None
        features = head.target_features(batch.taps[:, :n])
    else:
        features = batch.features[:, :n].to(head.fc.weight.dtype)
    if noise > 0:
        features = features + (torch.rand_like(features) * 2 - 1) * noise
    predictions = []
    for step in range(steps):
        allowed = unroll_mask(n, step, device)[None].expand(b, -1, -1)
        predicted = head(features, next_tokens, positions, cache, allowed=allowed)
        predictions.append(predicted)
        features = torch.cat([torch.zeros_like(predicted[:, :1]), predicted[:, :-1]], dim=1)  # f̂ read at j from j - 1
    return predictions


def loss_and_agreement(
    head: EagleHead, batch: _Batch, cfg: EagleTrainConfig, steps: int
) -> tuple[torch.Tensor, list[float]]:
    """The training loss and, per unrolled step, the top-1 agreement with the model's greedy token."""
    predictions = unrolled_forward(head, batch, steps, cfg.feature_noise if head.training else 0.0)
    target_features = batch.features[:, 1:]  # [B, n, H]: f_{j+1}
    draft_weight = head.draft_weight().float()
    # the model's own distribution at j + 1 over the draft vocabulary: exp(logit - logsumexp over all)
    target_logits = torch.nn.functional.linear(target_features, draft_weight)  # [B, n, V_d]
    target_probs = torch.exp(target_logits - batch.log_norm[:, 1:, None])
    greedy = batch.argmax[:, 1:]  # [B, n]
    draft_ids = head.draft_token_ids
    total = target_features.new_zeros(())
    agreement = []
    for step, predicted in enumerate(predictions):
        answer = batch.answer.clone()
        answer[:, :step] = False
        valid = batch.valid.clone()
        valid[:, :step] = False
        weight = answer.float() + cfg.prompt_weight * (valid & ~answer).float()
        count = weight.sum().clamp_min(1.0)
        log_q = torch.log_softmax(head.draft_logits(predicted), dim=-1)  # [B, n, V_d]
        ce = -(target_probs * log_q).sum(-1)
        if head.capture_layers is None:  # EAGLE-1: the predicted feature lives in the target's feature space
            regression = torch.nn.functional.smooth_l1_loss(predicted.float(), target_features, reduction="none")
            ce = ce + cfg.regression_weight * regression.mean(-1)
        step_loss = (ce * weight).sum() / count
        total = total + cfg.step_decay**step * step_loss
        guess = log_q.argmax(-1)
        if draft_ids is not None:
            guess = draft_ids[guess]
        answered = answer.float()
        agreement.append(float(((guess == greedy).float() * answered).sum() / answered.sum().clamp_min(1.0)))
    return total, agreement


@torch.no_grad()
def evaluate(head: EagleHead, samples: list[Sample], cfg: EagleTrainConfig, device: torch.device) -> list[float]:
    """Held-out top-1 agreement with the model's greedy token at each unrolled step (answer positions)."""
    if not samples:
        return []
    head.eval()
    steps = max(cfg.unroll, EVAL_STEPS)
    sums = [0.0] * steps
    for i in range(0, len(samples), cfg.micro_batch):
        batch = collate(samples[i : i + cfg.micro_batch], device)
        _, agreement = loss_and_agreement(head, batch, cfg, steps)
        weight = float(batch.answer.sum())
        sums = [s + a * weight for s, a in zip(sums, agreement, strict=True)]
    total = sum(float(collate([s], device).answer.sum()) for s in samples)
    head.train()
    return [s / max(total, 1.0) for s in sums]


def expected_chain_tokens(agreement: list[float]) -> float:
    """A rough tokens-per-round estimate from per-step agreements: ``1 + a0 + a0 a1 + ...``."""
    total, running = 1.0, 1.0
    for a in agreement:
        running *= a
        total += running
    return total


def write_data(
    model: Any,
    tokenizer: Any,
    prompts: list[tuple[str, Prompt]],
    cfg: EagleTrainConfig,
    deadline: float,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Sample], dict[str, Any]]:
    """Answer prompts batch by batch until ``deadline`` (or the prompts run out), recording each answer."""
    rendered = [(kind, render_prompt(tokenizer, prompt)) for kind, prompt in prompts]
    if cfg.max_samples is not None:
        rendered = rendered[: cfg.max_samples]
    # prompts of similar length share a batch (less padding): sorted in windows of four batches, whose
    # batches are then taken in a shuffled order (a budget that ends mid-window keeps the mix of kinds)
    window = 4 * cfg.batch_size
    rng = random.Random(cfg.seed)
    chunks: list[list[tuple[str, list[int]]]] = []
    for start in range(0, len(rendered), window):
        ordered = sorted(rendered[start : start + window], key=lambda kind_ids: len(kind_ids[1]))
        batches = [ordered[i : i + cfg.batch_size] for i in range(0, len(ordered), cfg.batch_size)]
        rng.shuffle(batches)
        chunks += batches
    samples: list[Sample] = []
    started = time.perf_counter()
    for index, chunk in enumerate(chunks):
        if time.perf_counter() >= deadline and samples:
            break
        sampled = index % 2 == 1
        samples += write_batch(
            model,
            tokenizer,
            [ids for _, ids in chunk],
            [kind for kind, _ in chunk],
            cfg,
            sampled,
            cfg.seed + index,
            feature_layers=tap_layers(model, cfg),
        )
        if progress is not None:
            tokens = sum(int(s.ids.shape[0]) - s.answer_start for s in samples)
            rate = tokens / max(time.perf_counter() - started, 1e-6) * 60
            progress(f"writing: {len(samples)} answers, {tokens} answer tokens ({rate:.0f}/min)")
    answer_tokens = sum(int(s.ids.shape[0]) - s.answer_start for s in samples)
    figures = {
        "samples": len(samples),
        "answer_tokens": answer_tokens,
        "total_tokens": sum(int(s.ids.shape[0]) for s in samples),
        "write_seconds": round(time.perf_counter() - started, 1),
        "answer_tokens_per_minute": round(answer_tokens / max(time.perf_counter() - started, 1e-6) * 60),
        "kinds": dict(Counter(s.kind for s in samples)),
    }
    return samples, figures


def train_eagle_head(
    model: Any,
    tokenizer: Any,
    cfg: EagleTrainConfig,
    *,
    target_name: str = "",
    prompts: list[tuple[str, Prompt]] | None = None,
    state_dir: str | Path | None = None,
    progress: bool = True,
) -> EagleTrainResult:
    """Self-distil an EAGLE-style head for a frozen causal LM, within ``cfg.max_seconds``.

    Args:
        model: a loaded ``*ForCausalLM`` of the Llama layout (frozen: its weights are not touched).
        tokenizer: its tokenizer (the chat template renders chat prompts).
        cfg: training settings.
        target_name: the model's name, saved in the head's config.
        prompts: the prompts the model answers (default: :func:`~selfspec.drafting.eagle.prompts.prompt_mix`).
        state_dir: where the written data and a checkpoint are kept; a later call with the same
            folder reuses the data and continues from the checkpoint.
        progress: show a progress bar.

    Returns:
        The trained head (float32) with its training figures and held-out agreement history.

    Raises:
        ConfigurationError: a setting is out of range (``max_seconds <= 0``, ...).
    """
    if not cfg.max_seconds > 0:
        raise ConfigurationError(
            f"the training budget must be positive, got {cfg.max_seconds} seconds: pass --minutes N with N > 0"
        )
    if cfg.unroll < 1 or cfg.micro_batch < 1 or cfg.batch_size < 1 or cfg.new_tokens < 2:
        raise ConfigurationError("train-eagle needs unroll >= 1, micro_batch >= 1, batch_size >= 1, new_tokens >= 2")
    if not 0.0 < cfg.write_share < 1.0:
        raise ConfigurationError(f"write_share must be in (0, 1), got {cfg.write_share}")
    if cfg.head_format not in HEAD_FORMATS:
        raise ConfigurationError(f"head format {cfg.head_format!r} is not one of {', '.join(HEAD_FORMATS)}")
    started = time.perf_counter()
    end = started + cfg.max_seconds
    training.freeze(model, cfg.seed, cfg.threads)
    device = model.device
    state_path = Path(state_dir) if state_dir is not None else None
    bar = training.progress_bar(None, None, progress)

    # 1-2. write and record (or reuse what an earlier run wrote)
    kept = resume.load_data(state_path, Sample) if state_path is not None else None
    if kept is not None:
        samples, write_figures = kept
        bar.set_description(f"reusing {len(samples)} written answers")
    else:
        mix = prompts if prompts is not None else prompt_mix(cfg.seed)
        write_deadline = started + cfg.max_seconds * cfg.write_share
        samples, write_figures = write_data(model, tokenizer, mix, cfg, write_deadline, bar.set_description)
        if state_path is not None:
            resume.save_data(state_path, samples, write_figures)
    if len(samples) < 2:
        raise ConfigurationError("the model wrote fewer than two answers in the budget: raise --minutes")
    if cfg.head_format == "eagle3" and any(s.taps is None for s in samples):
        raise ConfigurationError("the saved training data has no EAGLE-3 taps (another head format): use --restart")
    rng = random.Random(cfg.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    heldout_count = max(1, int(len(samples) * cfg.heldout_share))
    heldout = [samples[i] for i in order[:heldout_count]]
    train = [samples[i] for i in order[heldout_count:]]

    # 3. train
    draft_ids = choose_draft_vocab(train, cfg.draft_vocab_size, int(model.config.vocab_size))
    head: EagleHead
    if cfg.head_format == "eagle3":
        from .eagle3 import new_eagle3_head

        head = new_eagle3_head(model, tap_layers(model, cfg) or (), draft_ids, target_name)
    else:
        config = EagleHeadConfig.for_target(model, target_name)
        head = EagleHead(model, config, draft_token_ids=draft_ids, init_from_last_layer=cfg.init_from_last_layer)
    head = head.float().train()
    optimizer = training.adamw(head.parameters(), cfg.lr, betas=(0.9, 0.95))
    step, trained_seconds = 0, 0.0
    history: list[dict[str, Any]] = []
    restored = resume.load_checkpoint(state_path, head, optimizer) if state_path is not None else None
    if restored is not None:
        step, trained_seconds, history = restored
    resumed_at = step
    train_started = time.perf_counter()
    agreement = evaluate(head, heldout, cfg, device) if step == 0 else (history[-1]["heldout"] if history else [])

    def lr_at(at: training.TrainingStep) -> float:
        # warm-up (not again when resuming), then cosine decay over the time budget (or over
        # max_steps when that ends training first)
        return training.warmup_cosine(cfg.lr, at.step, cfg.warmup_steps if resumed_at == 0 else 0, at.fraction)

    def loss_of(batch: list[Sample], at: training.TrainingStep) -> training.StepLoss:
        steps = 1 if at.fraction < cfg.unroll_after else cfg.unroll  # teacher-forced first, then unrolled
        loss, _ = loss_and_agreement(head, collate(batch, device), cfg, steps)
        return training.StepLoss(loss)

    def on_step(done: training.StepDone) -> str:
        nonlocal agreement
        if done.step % cfg.eval_every == 0:
            agreement = evaluate(head, heldout, cfg, device)
            recent = done.losses[-cfg.eval_every :]
            history.append(
                {
                    "step": done.step,
                    "seconds": round(trained_seconds + time.perf_counter() - train_started, 1),
                    "loss": round(sum(recent) / len(recent), 4),
                    "heldout": [round(a, 4) for a in agreement],
                }
            )
        shown = " ".join(f"{a:.2f}" for a in agreement)
        return f"train loss {done.loss:.3f} | held-out agreement per step {shown}"

    def checkpoint(steps_done: int) -> None:
        assert state_path is not None
        seconds_so_far = trained_seconds + time.perf_counter() - train_started
        resume.save_checkpoint(state_path, head, optimizer, steps_done, seconds_so_far, history)

    loop = training.TrainingLoop(
        optimizer=optimizer,
        loss_of=loss_of,
        lr_at=lr_at,
        max_grad_norm=0.5,
        max_steps=cfg.max_steps,
        deadline=end,
        first_step=step,
    )
    done = training.run_loop(
        loop,
        _epochs(train, cfg.micro_batch, rng),
        on_step=on_step,
        bar=bar,
        show=bar.set_description,
        checkpoint=checkpoint if state_path is not None else None,
    )
    step, losses = done.steps, done.losses
    agreement = evaluate(head, heldout, cfg, device)
    seconds_trained = trained_seconds + time.perf_counter() - train_started
    history.append({"step": step, "seconds": round(seconds_trained, 1), "heldout": [round(a, 4) for a in agreement]})
    if state_path is not None:
        resume.save_checkpoint(state_path, head, optimizer, step, seconds_trained, history)
    bar.close()
    figures = {
        **write_figures,
        "heldout_samples": len(heldout),
        "train_samples": len(train),
        "steps": step,
        "train_seconds": round(seconds_trained, 1),
        "wall_seconds_this_run": round(time.perf_counter() - started, 1),
        "heldout_agreement_per_step": [round(a, 4) for a in agreement],
        "heldout_expected_chain_tokens": round(expected_chain_tokens(agreement), 3),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "config": asdict(cfg),
        "parameters": head.num_parameters(),
    }
    head.head_config.training = {k: v for k, v in figures.items() if k != "config"}
    head.eval().requires_grad_(False)
    return EagleTrainResult(head=head, figures=figures, history=history)


def _epochs(train: list[Sample], micro_batch: int, rng: random.Random) -> Iterator[list[Sample]]:
    """Micro-batches of the training samples, epoch after epoch, each epoch in a new shuffled order."""
    while True:
        rng.shuffle(train)
        batches = [train[i : i + micro_batch] for i in range(0, len(train), micro_batch)]
        yield from reversed(batches)


def tap_layers(model: Any, cfg: EagleTrainConfig) -> tuple[int, ...] | None:
    """The target layers an EAGLE-3 head taps (``None`` for selfspec's own format)."""
    if cfg.head_format != "eagle3":
        return None
    if cfg.feature_layers:
        return tuple(int(i) for i in cfg.feature_layers)
    from .eagle3 import default_feature_layers

    return tuple(default_feature_layers(int(model.config.num_hidden_layers)))


def save_trained_head(result: EagleTrainResult, out: str | Path) -> Path:
    """Save the head (fp16) and :data:`RECORD_FILE` (figures and held-out history) into ``out``.

    An EAGLE-3 head is written in vLLM's ``speculators`` layout (its verifier: the head's target name).
    """
    from .eagle3 import Eagle3Head

    head = result.head
    if isinstance(head, Eagle3Head):
        from .speculators import save_speculators_eagle3

        path = save_speculators_eagle3(
            head,
            out,
            verifier=head.spec.verifier or head.head_config.target,
            verifier_architectures=head.spec.extra.get("verifier_architectures"),
        )
    else:
        path = head.save(out)
    record = {"figures": result.figures, "history": result.history}
    atomic_write_text(path / RECORD_FILE, json.dumps(record, indent=2) + "\n")
    return path
