"""``learn_online=True``: an EAGLE head that keeps learning from the text it serves.

Every verify already computes what training a feature head needs: the target's last-layer
features at each committed position and the token that follows it (the target's own output, or
the prompt). The EAGLE drafter hands those to :meth:`OnlineLearner.observe` at each round's
catch-up; a background thread trains a *copy* of the head on them with the trainer's own loss
(:func:`~selfspec.drafting.eagle.train.loss_and_agreement`) and publishes a new head every
:attr:`OnlineSettings.steps_per_swap` steps. Online Speculative Decoding (Liu et al. 2024,
arXiv 2310.07177) distils a draft model the same way; verification keeps the text exact whatever
the head learns.

Bounds (:class:`OnlineSettings`):

- **Memory.** :class:`FeatureBuffer` holds at most ``buffer_positions`` positions (a float16
  feature, a float32 log-normaliser and two ids each: ``2 H + 20`` bytes, 19 MB at the default
  16384 positions of a 576-wide model), dropping the oldest generation first. The learner keeps
  three more copies of the head's weights (the trained copy and AdamW's two moments) and one
  published copy.
- **The request thread** only appends a round's features to the buffer (a list append under a
  lock the learner holds for a list copy), counts the round's tokens for the guard, and at a
  generation's first round takes the newest head (a reference). No request waits for a
  training step. A generation keeps the head it started with, so a swap never lands mid-round.
- **The learner** runs in one daemon thread with one torch thread
  (``torch.set_num_threads`` is per thread under OpenMP) and sleeps ``step_interval`` seconds
  after each step: at most ``1 / step_interval`` steps per second, one core busy at most for
  a step's length (``micro_batch x window`` positions, ~0.3 s on SmolLM2-135M on a CPU core).
  It never changes the process's niceness.

The frozen head (the one loaded) is the fallback: new heads serve only after it has served
``judge_rounds`` rounds (its tokens per round measured as an EMA); a learned head whose EMA falls
below the frozen head's by more than ``margin`` (relative) after ``judge_rounds`` rounds is rolled
back, and the learner starts again from the frozen head's weights.

The trained copy is saved (atomically, :meth:`~selfspec.drafting.eagle.head.EagleHead.save`) to
the user cache per model (:func:`online_head_folder`) every ``save_every`` seconds and on
:meth:`OnlineLearner.close`; the next engine with ``learn_online=True`` resumes from it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...artifacts import EAGLE_ONLINE, model_cache
from ...core.memory import release_free_memory
from ...errors import ConfigurationError, ModelNotFoundError
from .. import training
from .head import EagleHead, load_eagle_head
from .train import EagleTrainConfig, Sample, collate, loss_and_agreement

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnlineSettings:
    """How the online learner trains, swaps, judges and saves.

    Attributes:
        buffer_positions: the most positions the buffer holds (oldest generations dropped first).
        sequence_positions: the most positions kept of one generation (a longer one stops growing).
        window: positions per training window (a slice of one generation).
        micro_batch: windows per step.
        lr: AdamW learning rate (constant: the head already trained).
        unroll: training-time-test steps (as the trainer's ``unroll``).
        step_interval: seconds the learner sleeps after each step (at most ``1 / step_interval`` steps/s).
        steps_per_swap: steps between published heads.
        min_positions: positions the buffer must hold before the first step.
        judge_rounds: rounds the frozen head serves before any swap, and a learned head serves before
            it is judged.
        margin: a learned head whose tokens per round fall below ``(1 - margin)`` times the frozen
            head's is rolled back.
        ema_decay: weight of the past in the tokens-per-round EMAs.
        save_every: seconds between saves of the trained copy (``0``: only at :meth:`OnlineLearner.close`).
        threads: torch threads of the learner thread.
        background: run the learner thread (``False``: the caller drives :meth:`OnlineLearner.train_steps`).
        save: save the trained copy to the user cache and resume from it (``False``: start from the loaded
            head every time, write nothing).
        release_memory: hand the memory a training step freed back to the system after the step
            (:func:`~selfspec.core.memory.release_free_memory`, glibc's ``malloc_trim``: about 20 ms
            on SmolLM2, in the learner thread): without it glibc keeps the steps' high-water mark in
            every arena, and the process's resident memory grows with the stream (measured:
            ``docs/online_learning.md``).
        seed: seeds the windows' choice.
    """

    buffer_positions: int = 16384
    sequence_positions: int = 2048
    window: int = 128
    micro_batch: int = 4
    lr: float = 3e-4
    unroll: int = 2
    step_interval: float = 0.5
    steps_per_swap: int = 20
    min_positions: int = 256
    judge_rounds: int = 64
    margin: float = 0.05
    ema_decay: float = 0.98
    save_every: float = 300.0
    threads: int = 1
    background: bool = True
    save: bool = True
    release_memory: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("buffer_positions", "sequence_positions", "micro_batch", "unroll", "steps_per_swap", "threads"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"online learning: {name} must be >= 1, got {getattr(self, name)}")
        if self.window < 2:
            raise ConfigurationError(f"online learning: window must be >= 2, got {self.window}")
        if not 0.0 <= self.margin < 1.0 or not 0.0 <= self.ema_decay < 1.0:
            raise ConfigurationError("online learning: margin and ema_decay must be in [0, 1)")
        if self.step_interval < 0 or self.save_every < 0 or self.lr <= 0:
            raise ConfigurationError("online learning: step_interval and save_every must be >= 0, lr > 0")


def online_head_folder(name_or_path: str) -> Path:
    """Where a model's online-trained head is saved: ``<cache>/eagle_online/<model key>/``."""
    return model_cache(name_or_path, EAGLE_ONLINE)


# ----------------------------------------------------------------------------- the buffer
@dataclass
class OnlineSequence:
    """One generation's verified text: features ``f_t`` and tokens ``x_t`` from its first observed position.

    ``tokens`` holds one id more than ``chunks`` holds features (entry ``t`` pairs ``f_t`` with ``x_{t+1}``).
    The learner's own fields (``log_norm``, ``argmax``, ``merged``) are filled in the learner thread.
    """

    prompt_length: int = 0  # positions of the first chunk (the prompt's): they weigh less in the loss
    positions: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)  # [m, H] float16 last-layer states (before the norm)
    tokens: list[int] = field(default_factory=list)
    merged: torch.Tensor | None = None  # learner: the chunks concatenated [positions, H]
    log_norm: torch.Tensor | None = None  # learner: the target's logsumexp per position
    argmax: torch.Tensor | None = None  # learner: the target's greedy token per position


@dataclass
class Snapshot:
    """What the learner reads of a sequence: its chunks and tokens at one moment."""

    sequence: OnlineSequence
    chunks: list[torch.Tensor]
    tokens: list[int]


class FeatureBuffer:
    """A bounded buffer of (features, next tokens) of served generations, oldest dropped first.

    Args:
        max_positions: the most positions held in all.
        sequence_positions: the most positions kept of one generation.
    """

    def __init__(self, max_positions: int, sequence_positions: int) -> None:
        self.max_positions = max_positions
        self.sequence_positions = min(sequence_positions, max_positions)
        self.sequences: deque[OnlineSequence] = deque()
        self.positions = 0
        self.dropped = 0  # positions dropped to stay within the bound
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FeatureBuffer(positions={self.positions}/{self.max_positions}, sequences={len(self.sequences)})"

    def append(self, sequence: OnlineSequence, states: torch.Tensor, tokens: list[int]) -> None:
        """Add the states ``[m, H]`` at positions ``t .. t + m - 1`` and the tokens ``x_t .. x_{t+m}`` there.

        The states are stored as float16 (a float32 model's) on their device. A sequence at
        :attr:`sequence_positions` takes no more.
        """
        room = self.sequence_positions - sequence.positions
        if room <= 0 or states.shape[0] == 0:
            return
        fresh = sequence.positions == 0
        count = min(int(states.shape[0]), room)
        stored = states[:count].detach()
        if stored.dtype == torch.float32:
            stored = stored.to(torch.float16)
        with self._lock:
            sequence.chunks.append(stored)
            sequence.tokens.extend(tokens[: count + 1] if fresh else tokens[1 : count + 1])  # x_t is there already
            if fresh:
                sequence.prompt_length = count
                self.sequences.append(sequence)
            sequence.positions += count
            self.positions += count
            while self.positions > self.max_positions and len(self.sequences) > 1:
                oldest = self.sequences.popleft()
                self.positions -= oldest.positions
                self.dropped += oldest.positions

    def snapshot(self) -> list[Snapshot]:
        """The sequences with at least two positions, as they are now (copies of the lists, not of the tensors)."""
        with self._lock:
            return [Snapshot(s, list(s.chunks), list(s.tokens)) for s in self.sequences if s.positions >= 2]


# ----------------------------------------------------------------------------- the guard
@dataclass
class AcceptanceGuard:
    """Measured tokens per round of the frozen head and of the learned one serving; when to swap and roll back.

    Attributes:
        judge_rounds: rounds measured before a swap (frozen) or a judgement (learned).
        margin: relative shortfall that rolls a learned head back.
        ema_decay: weight of the past in each EMA.
        frozen_tau: the frozen head's tokens per round (EMA), ``None`` before any round.
        frozen_rounds: rounds the frozen head served.
        learned_tau: the serving learned head's tokens per round (EMA since its swap).
        learned_rounds: rounds it served.
        rollbacks: learned heads rolled back so far.
    """

    judge_rounds: int = 64
    margin: float = 0.05
    ema_decay: float = 0.98
    frozen_tau: float | None = None
    frozen_rounds: int = 0
    learned_tau: float | None = None
    learned_rounds: int = 0
    rollbacks: int = 0

    def _ema(self, old: float | None, tokens: float) -> float:
        return tokens if old is None else self.ema_decay * old + (1.0 - self.ema_decay) * tokens

    def record(self, tokens: int, learned: bool) -> None:
        """Count a round that committed ``tokens`` tokens (accepted drafts + 1), by a learned head or the frozen one."""
        if learned:
            self.learned_tau, self.learned_rounds = self._ema(self.learned_tau, tokens), self.learned_rounds + 1
        else:
            self.frozen_tau, self.frozen_rounds = self._ema(self.frozen_tau, tokens), self.frozen_rounds + 1

    def may_swap(self) -> bool:
        """Whether the frozen head has been measured long enough for a learned head to be compared with it."""
        return self.frozen_rounds >= self.judge_rounds

    def swapped(self) -> None:
        """A new learned head serves: its figure starts afresh."""
        self.learned_tau, self.learned_rounds = None, 0

    def falls_short(self) -> bool:
        """Whether the serving learned head, judged, draws fewer tokens per round than the frozen one by the margin."""
        if self.learned_rounds < self.judge_rounds or self.learned_tau is None or self.frozen_tau is None:
            return False
        return self.learned_tau < (1.0 - self.margin) * self.frozen_tau

    def rolled_back(self) -> None:
        """The frozen head serves again."""
        self.rollbacks += 1
        self.swapped()


# ----------------------------------------------------------------------------- the learner
def check_trainable(head: EagleHead) -> None:
    """Refuse a head the online learner cannot train (EAGLE-3 heads read other layers' states)."""
    if type(head) is not EagleHead or head.capture_layers is not None:
        raise ConfigurationError(
            "learn_online trains selfspec's EAGLE heads (last-layer features); this head "
            f"({type(head).__name__}) is not one"
        )


def freeze_shared_modules(head: EagleHead) -> None:
    """The target's modules a head reads (embedding, final norm, LM head) take no gradients.

    The head shares them with the target rather than copying them, so without this every training
    step would backpropagate into the target's embedding: a dense gradient of the whole vocabulary
    (108 MB on SmolLM2-135M, tied to the LM head) computed each step and kept in the target's
    ``.grad`` for good. Serving runs without gradients, so the model decodes as before; this is
    what ``train-eagle`` does to the whole model (:func:`~selfspec.drafting.training.freeze`).
    """
    target = head.target
    for module in (target.embed_tokens, target.norm, target.lm_head):
        module.requires_grad_(False)


def clone_head(head: EagleHead) -> EagleHead:
    """A copy of ``head``'s own weights sharing the same target modules (never the target's weights).

    The copy also shares the head's cached rows of the LM head (:meth:`EagleHead.draft_weight`, a
    detached tensor no one writes), so the published heads share the trained copy's. Rows cached under
    ``torch.inference_mode`` (the frozen head's, cached while it served) are not shared: autograd
    refuses inference tensors, so the trained copy caches its own.
    """
    check_trainable(head)
    twin = EagleHead(
        head.target, copy.deepcopy(head.head_config), draft_token_ids=head.draft_token_ids, init_from_last_layer=False
    )
    twin.load_state_dict(head.state_dict())
    rows = head._draft_weight
    if rows is not None and not rows.is_inference():  # rows cached while serving cannot take part in training
        twin._draft_weight = rows  # the LM head's draft rows (19 MB on SmolLM2): read-only, shared
    return twin


class OnlineLearner:
    """Trains a copy of an EAGLE head on served text and decides which head new generations get.

    Args:
        head: the loaded head: the frozen fallback, never trained.
        settings: the bounds and rates (:class:`OnlineSettings`).
        save_folder: where the trained copy is saved and resumed from (``None``: not saved).
    """

    def __init__(self, head: EagleHead, settings: OnlineSettings | None = None, save_folder: Path | None = None):
        self.frozen = head
        self.settings = settings = settings or OnlineSettings()
        self.save_folder = save_folder if settings.save else None
        self.buffer = FeatureBuffer(settings.buffer_positions, settings.sequence_positions)
        self.guard = AcceptanceGuard(settings.judge_rounds, settings.margin, settings.ema_decay)
        self.train_config = EagleTrainConfig(unroll=settings.unroll, feature_noise=0.0)
        self.steps = 0
        self.swaps = 0
        self.trims = 0  # times the freed memory went back to the system
        self.trim_seconds = 0.0  # and the time that took
        self.losses: deque[float] = deque(maxlen=50)
        self._trainee: EagleHead | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._published: EagleHead | None = None  # the newest learned head, not serving yet
        self._serving: EagleHead = head  # the head the next generation gets
        self._restart = False  # a rollback asks the learner to start again from the frozen head
        self._rng = random.Random(settings.seed)
        self._last_save = time.monotonic()
        self._step_lock = threading.Lock()  # one training step at a time (the thread, or train_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        check_trainable(head)  # before any request
        freeze_shared_modules(head)

    def __repr__(self) -> str:
        return (
            f"OnlineLearner(steps={self.steps}, swaps={self.swaps}, rollbacks={self.guard.rollbacks}, "
            f"serving={'learned' if self.serving_learned else 'frozen'}, {self.buffer!r})"
        )

    # ------------------------------------------------------------ the request thread (O(1) each)
    @property
    def serving_learned(self) -> bool:
        """Whether new generations get a learned head (not the frozen one)."""
        return self._serving is not self.frozen

    def head_for_generation(self) -> EagleHead:
        """The head a new generation drafts with: the newest published one once the frozen head is measured."""
        published = self._published
        if published is not None and self.guard.may_swap():
            self._published = None
            self._serving = published
            self.guard.swapped()
            self.swaps += 1
        return self._serving

    def record_round(self, head: EagleHead, tokens: int) -> None:
        """Count a round of ``head``'s that committed ``tokens`` tokens; roll back a learned head that falls short."""
        learned = head is not self.frozen
        if learned and head is not self._serving:
            return  # an older head still finishing a generation: not judged
        self.guard.record(tokens, learned)
        if learned and self.guard.falls_short():
            logger.info(
                "online EAGLE head rolled back: %.2f tokens/round vs the frozen head's %.2f",
                self.guard.learned_tau or 0.0,
                self.guard.frozen_tau or 0.0,
            )
            self._serving, self._published = self.frozen, None
            self.guard.rolled_back()
            self._restart = True

    def observe(self, sequence: OnlineSequence, states: torch.Tensor, tokens: list[int]) -> None:
        """Buffer a round's committed states ``[m, H]`` (before the final norm) and their tokens."""
        self.buffer.append(sequence, states, tokens)

    # ------------------------------------------------------------ the learner thread
    def start(self) -> None:
        """Start the learner thread (with :attr:`OnlineSettings.background`)."""
        if self.settings.background and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="selfspec-online-learner", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self.settings.threads)  # this thread only (OpenMP's setting is per thread)
        while not self._stop.is_set():
            try:
                stepped = self.train_steps(1) > 0
            except Exception:  # a failed step must never reach a request: stop learning, keep serving
                logger.exception("online EAGLE learning stopped")
                return
            if self.settings.save_every and time.monotonic() - self._last_save >= self.settings.save_every:
                self.save()
            self._stop.wait(self.settings.step_interval if stepped else max(self.settings.step_interval, 0.05))

    def train_steps(self, count: int) -> int:
        """Run up to ``count`` training steps now (publishing every ``steps_per_swap``); return the steps run."""
        done = 0
        for _ in range(count):
            with self._step_lock:
                if not self._step():
                    break
            done += 1
        return done

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No training step runs inside this block (one in progress finishes first)."""
        with self._step_lock:
            yield

    def _ensure_trainee(self) -> EagleHead:
        if self._trainee is None or self._restart:
            self._restart = False
            self._trainee = self._resumed() if self._trainee is None else None
            if self._trainee is None:
                self._trainee = clone_head(self.frozen)
            self._trainee.float().train().requires_grad_(True)
            self._optimizer = training.adamw(self._trainee.parameters(), self.settings.lr, betas=(0.9, 0.95))
        return self._trainee

    def _resumed(self) -> EagleHead | None:
        """The head saved by an earlier learner for this model, when it has the frozen head's draft vocabulary."""
        folder = self.save_folder
        if folder is None or not folder.is_dir():
            return None
        try:
            saved = load_eagle_head(folder, self.frozen.target)
        except (ConfigurationError, ModelNotFoundError) as error:
            logger.warning("online EAGLE head in %s not resumed: %s", folder, error)
            return None
        mine, theirs = self.frozen.draft_token_ids, saved.draft_token_ids
        same_vocab = (mine is None and theirs is None) or (
            mine is not None and theirs is not None and torch.equal(mine.cpu(), theirs.cpu())
        )
        if not same_vocab:
            logger.warning("online EAGLE head in %s not resumed: another draft vocabulary", folder)
            return None
        twin = clone_head(self.frozen)
        twin.load_state_dict(saved.state_dict())
        return twin

    def _samples(self) -> list[Sample]:
        """``micro_batch`` windows drawn from the buffer (by position), with the target's normaliser and argmax."""
        snapshots = self.buffer.snapshot()
        total = sum(s.sequence.positions for s in snapshots)
        if total < max(self.settings.min_positions, 2):
            return []
        weights = [s.sequence.positions for s in snapshots]
        samples = []
        for snapshot in self._rng.choices(snapshots, weights=weights, k=self.settings.micro_batch):
            states, log_norm, argmax = self._materialize(snapshot)
            count = states.shape[0]
            length = min(self.settings.window, count)
            start = self._rng.randrange(0, count - length + 1)
            end = start + length
            ids = torch.tensor(snapshot.tokens[start:end], dtype=torch.long)
            samples.append(
                Sample(
                    ids=ids,
                    answer_start=max(0, snapshot.sequence.prompt_length - start),
                    features=states[start:end],
                    log_norm=log_norm[start:end],
                    argmax=argmax[start:end],
                )
            )
        return samples

    @torch.no_grad()
    def _materialize(self, snapshot: Snapshot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequence's features (after the final norm), logsumexp and argmax, computed once per new chunk."""
        sequence = snapshot.sequence
        merged = sequence.merged
        have = 0 if merged is None else merged.shape[0]
        count = sum(int(c.shape[0]) for c in snapshot.chunks)
        count = min(count, len(snapshot.tokens))  # features need their tokens
        if have < count:
            fresh = torch.cat(snapshot.chunks, dim=0)[have:count]
            head = self.frozen
            features = head.target_features(fresh.to(head.target.dtype)).float()  # [m, H] after the norm
            logits = head.target_logits(features.to(head.target.dtype))  # [m, vocab]
            parts = [(features.half(), torch.logsumexp(logits, dim=-1), logits.argmax(-1))]
            if merged is not None and sequence.log_norm is not None and sequence.argmax is not None:
                parts.insert(0, (merged, sequence.log_norm, sequence.argmax))
            sequence.merged = torch.cat([p[0] for p in parts])
            sequence.log_norm = torch.cat([p[1] for p in parts])
            sequence.argmax = torch.cat([p[2] for p in parts])
        assert sequence.merged is not None and sequence.log_norm is not None and sequence.argmax is not None
        return sequence.merged[:count], sequence.log_norm[:count], sequence.argmax[:count]

    def _step(self) -> bool:
        """One AdamW step of the trained copy on the buffer; ``False`` when the buffer is too small."""
        samples = self._samples()
        if not samples:
            return False
        trainee = self._ensure_trainee()
        assert self._optimizer is not None
        device = trainee.fc.weight.device
        loss, _ = loss_and_agreement(trainee, collate(samples, device), self.train_config, self.settings.unroll)
        self._optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainee.parameters(), 1.0)
        self._optimizer.step()
        self.steps += 1
        self.losses.append(float(loss.detach()))
        del loss, samples
        if self.steps % self.settings.steps_per_swap == 0:
            self._publish(trainee)
        if self.settings.release_memory:  # the step's activations are free now: give their pages back
            started = time.perf_counter()
            release_free_memory()
            self.trims += 1
            self.trim_seconds += time.perf_counter() - started
        return True

    def _publish(self, trainee: EagleHead) -> None:
        """A served copy of the trained head (the frozen head's dtype, no gradients), ready for the next generation."""
        twin = clone_head(trainee)
        twin.to(dtype=self.frozen.fc.weight.dtype).eval().requires_grad_(False)
        self._published = twin  # one reference assignment: the request thread reads it whole

    def save(self) -> Path | None:
        """Write the trained copy to :attr:`save_folder` (atomic files); ``None`` when there is nothing to save."""
        self._last_save = time.monotonic()
        trainee, folder = self._trainee, self.save_folder
        if trainee is None or folder is None or self.steps == 0:
            return None
        with self._step_lock:
            twin = clone_head(trainee)
        twin.head_config.training = {
            **twin.head_config.training,
            "online": {"steps": self.steps, "swaps": self.swaps, "rollbacks": self.guard.rollbacks},
        }
        return twin.save(folder, dtype=torch.float32)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the learner thread and save the trained copy."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        try:
            self.save()
        except OSError as error:  # a full or read-only cache must not fail a shutdown
            logger.warning("online EAGLE head not saved: %s", error)
