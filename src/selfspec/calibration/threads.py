"""``threads="auto"``: time the plain decode step at 1..N torch threads, keep the fastest, re-check on load changes.

On a CPU shared with other work, torch's default (one thread per core) can be several times
slower than one thread: a second thread waits for a core another process holds (SmolLM2-135M on
a loaded 2-core CPU: 1.6 tokens/s at 2 threads, 10.6 at 1; issue 45). So the engine measures
instead of guessing:

1. **At load** (:func:`settle_threads`, called by
   :meth:`SpeculativeEngine.from_pretrained <selfspec.SpeculativeEngine.from_pretrained>` before
   first-load calibration, so calibration's costs are measured at the chosen count): the plain
   decode step (one token through every layer with a KV cache, the step plain decoding repeats)
   is timed at each candidate count (:func:`candidate_counts`: every count up to the usable cores,
   ``os.sched_getaffinity``), round-robin so that a change of load hits every count alike, median
   per count (contention is what is measured, so not the fastest run). :func:`choose_thread_count`
   keeps the fastest, and the fewest threads among those within :data:`TIE_TOLERANCE` of it.
   Cost: ``WARMUP_STEPS + ROUNDS * STEPS_PER_ROUND`` steps per count (13), fewer for a count
   :data:`DROP_FACTOR` times slower than the best after a round (it is timed no more): 1 to 2.5 s
   for SmolLM2-135M on a loaded 2-core CPU (load 3.4). Nothing is saved: the choice is measured at
   every load, so it reflects the load of the moment.
2. **While running** (:meth:`AutoThreads.on_request`, at the start of each call): the 1-minute
   load average is read (``os.getloadavg``, a few microseconds) at most every
   :data:`LOOK_SECONDS`; when it differs from the load at the last choice by
   :data:`LOAD_CHANGE` (one core's worth) or more, and the last choice is at least
   :data:`RECHECK_SECONDS` old, the current count and one neighbour (fewer threads when the load
   rose, more when it fell) are timed again, as at load (``ROUNDS * STEPS_PER_ROUND`` steps each,
   other calls waiting meanwhile), and the faster kept. So a re-check costs at most about a
   third of a second per minute on SmolLM2-135M.

``SELFSPEC_THREADS=N`` in the environment makes ``"auto"`` use ``N`` without measuring (the test
suite sets it to 1; a container with a fixed CPU quota may too). An explicit ``threads=N`` sets
``torch.set_num_threads(N)`` and is never changed; ``threads=None`` leaves torch's setting alone.
On CUDA ``"auto"`` leaves torch's setting alone (the GPU does the work).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..modeling.runner import ModelRunner

logger = logging.getLogger(__name__)

#: The environment variable that makes ``threads="auto"`` use a fixed count without measuring.
THREADS_ENV = "SELFSPEC_THREADS"
#: Counts whose median step is within this fraction of the fastest tie; the fewest threads win.
TIE_TOLERANCE = 0.05
#: Untimed steps per count before the timed rounds (caches, thread pool start-up).
WARMUP_STEPS = 1
#: Round-robin rounds over the counts, and timed steps per count in each round.
ROUNDS, STEPS_PER_ROUND = 4, 3
#: A count this many times slower than the best after a round is timed no more.
DROP_FACTOR = 2.0
#: Prompt length of the timed steps (the KV cache they read).
PREFIX_TOKENS = 32
#: At most one look at the load average per this many seconds.
LOOK_SECONDS = 5.0
#: A change of the 1-minute load average by this much (one busy core) calls for a re-check.
LOAD_CHANGE = 1.0
#: At most one re-check per this many seconds.
RECHECK_SECONDS = 60.0


# ----------------------------------------------------------------------------- pure parts
def usable_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where there is none)."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        try:
            return max(1, len(affinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average (``None`` where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def candidate_counts(cores: int) -> list[int]:
    """The thread counts timed on ``cores`` usable cores: every count up to 8, then a few more up to ``cores``."""
    steps = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    return sorted({n for n in steps if n <= cores} | {max(1, cores)})


def choose_thread_count(step_ms: Mapping[int, float], tolerance: float = TIE_TOLERANCE) -> int:
    """The fastest thread count; among counts within ``tolerance`` of the fastest, the fewest threads.

    Fewer threads on a tie: they leave cores to other work and suffer less when it grows.

    Args:
        step_ms: milliseconds per plain decode step at each thread count.
        tolerance: the fraction of the fastest time within which counts tie.

    Raises:
        ValueError: no timings.
    """
    if not step_ms:
        raise ValueError("no thread timings to choose from")
    fastest = min(step_ms.values())
    return min(count for count, ms in step_ms.items() if ms <= fastest * (1 + tolerance))


def recheck_due(chosen_load: float | None, load_now: float | None, age_s: float) -> bool:
    """Whether to time again: the load moved :data:`LOAD_CHANGE` or more since a choice :data:`RECHECK_SECONDS` old."""
    if chosen_load is None or load_now is None or age_s < RECHECK_SECONDS:
        return False
    return abs(load_now - chosen_load) >= LOAD_CHANGE


def recheck_counts(current: int, cores: int, load_rose: bool) -> list[int]:
    """The counts a re-check times: the current one and a neighbour (half when the load rose, twice when it fell)."""
    neighbour = max(1, current // 2) if load_rose else min(cores, current * 2)
    return sorted({current, neighbour})


def threads_from_environment() -> int | None:
    """``$SELFSPEC_THREADS`` as a count (``None``: unset or empty).

    Raises:
        ConfigurationError: a value that is not an int >= 1.
    """
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigurationError(f"${THREADS_ENV} must be an int >= 1, got {text!r}")
    return int(text)


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count an engine runs with, and why.

    Attributes:
        threads: the count (``torch.get_num_threads()`` after the choice).
        how: ``"auto"`` (measured), ``"given"`` (``threads=N``), ``"environment"``
            (``$SELFSPEC_THREADS``), ``"one core"``, or ``"not measured on <device>"``.
        step_ms: milliseconds per plain decode step at each count timed (``"auto"`` only).
        load: the 1-minute load average when it was chosen.
        cores: the usable cores then.
        rechecks: how many times a load change had it timed again.
    """

    threads: int
    how: str
    step_ms: dict[int, float] = field(default_factory=dict)
    load: float | None = None
    cores: int = 1
    rechecks: int = 0

    def summary(self) -> str:
        """One line, e.g. ``threads=1 (auto: 1 thread 9.8 ms/step, 2 threads 31 ms/step, load 3.2)``."""
        load = f", load {self.load:.1f}" if self.load is not None else ""
        if self.how == "given":
            return f"threads={self.threads} (given)"
        if self.how == "environment":
            return f"threads={self.threads} (auto: ${THREADS_ENV}={self.threads})"
        if not self.step_ms:
            return f"threads={self.threads} (auto: {self.how}{load})"
        timed = ", ".join(
            f"{count} thread{'s' if count > 1 else ''} {_ms(ms)} ms/step" for count, ms in sorted(self.step_ms.items())
        )
        again = f", re-checked {self.rechecks}x" if self.rechecks else ""
        return f"threads={self.threads} (auto: {timed}{load}{again})"


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


# ----------------------------------------------------------------------------- measuring
def plain_step(runner: ModelRunner) -> Callable[[], None]:
    """One plain decode step of ``runner``'s model (one token, every layer, a short KV cache), as a function."""
    device = runner.device
    length = min(PREFIX_TOKENS, max(1, (runner.max_positions or 64) // 2))
    cache = runner.new_cache(length + 2)
    ids = torch.arange(length, device=device).remainder(runner.vocab_size).unsqueeze(0)  # [1, length]
    with torch.inference_mode():
        runner.run_layers(runner.embed(ids), 0, runner.num_layers, torch.arange(length, device=device), cache)
    token = ids[:, -1:]  # [1, 1]
    position = torch.tensor([length], device=device)
    argmax_only = runner.argmax_screen and runner.argmax_head is not None

    def step() -> None:
        with torch.inference_mode():
            hidden = runner.run_layers(runner.embed(token), 0, runner.num_layers, position, cache)
            runner.logits(hidden, argmax_only)
            cache.crop_to(length)

    return step


def time_thread_counts(
    step: Callable[[], None], counts: Iterable[int], rounds: int = ROUNDS, steps: int = STEPS_PER_ROUND
) -> dict[int, float]:
    """Median milliseconds of ``step`` at each thread count, timed round-robin (torch left at the last count).

    A count whose median is :data:`DROP_FACTOR` times the best one's after a round is timed no more
    (it cannot win, and its steps are the dear ones: 288 ms against 16 ms on a loaded 2-core CPU).
    """
    counts = list(counts)
    for count in counts:
        torch.set_num_threads(count)
        for _ in range(WARMUP_STEPS):
            step()
    times: dict[int, list[float]] = {count: [] for count in counts}
    timing = list(counts)
    for turn in range(rounds):
        for count in timing[turn % len(timing) :] + timing[: turn % len(timing)]:
            torch.set_num_threads(count)
            for _ in range(steps):
                started = time.perf_counter()
                step()
                times[count].append((time.perf_counter() - started) * 1000)
        best = min(statistics.median(times[count]) for count in timing)
        timing = [count for count in timing if statistics.median(times[count]) <= best * DROP_FACTOR]
    return {count: statistics.median(values) for count, values in times.items()}


def measure_choice(step: Callable[[], None], cores: int) -> ThreadChoice:
    """Time ``step`` at every candidate count and keep the fastest (torch set to it)."""
    load = load_average()
    step_ms = time_thread_counts(step, candidate_counts(cores))
    chosen = choose_thread_count(step_ms)
    torch.set_num_threads(chosen)
    return ThreadChoice(chosen, "auto", step_ms, load, cores)


# ----------------------------------------------------------------------------- the engine's side
class AutoThreads:
    """An engine's thread choice, re-checked when the machine's load changes a lot (``threads="auto"``).

    Args:
        choice: the choice made at load.
        step: the timed plain step (``None``: never re-checked: a given count, the environment's,
            one core, a GPU).
        lock: held while re-timing, so that no round of another call runs meanwhile (the engine's).
    """

    def __init__(self, choice: ThreadChoice, step: Callable[[], None] | None = None, lock: Any = None) -> None:
        self.choice = choice
        self._step = step
        self._lock = lock if lock is not None else threading.RLock()
        self._checking = threading.Lock()
        self._chosen_at = self._looked_at = time.monotonic()

    def on_request(self, now: float | None = None) -> bool:
        """Called as each call starts: set torch to the count; re-time when :func:`recheck_due` says so.

        Setting the count at each call lets engines of different counts share a process (torch's
        count is process-wide: the engine whose call starts last sets it).

        Returns:
            Whether it re-timed.
        """
        if torch.get_num_threads() != self.choice.threads:
            torch.set_num_threads(self.choice.threads)
        if self._step is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._looked_at < LOOK_SECONDS or not self._checking.acquire(blocking=False):
            return False
        try:
            self._looked_at = now
            load = load_average()
            if not recheck_due(self.choice.load, load, now - self._chosen_at):
                return False
            self._recheck(load)
            self._chosen_at = time.monotonic()
            return True
        finally:
            self._checking.release()

    def _recheck(self, load: float | None) -> None:
        assert self._step is not None
        choice = self.choice
        rose = load is not None and choice.load is not None and load > choice.load
        counts = recheck_counts(choice.threads, choice.cores, rose)
        with self._lock:
            step_ms = time_thread_counts(self._step, counts)
            chosen = choose_thread_count(step_ms)
            torch.set_num_threads(chosen)
        self.choice = replace(
            choice, threads=chosen, step_ms={**choice.step_ms, **step_ms}, load=load, rechecks=choice.rechecks + 1
        )
        logger.info("load %.1f -> %s: %s", choice.load or 0.0, f"{load:.1f}" if load else "?", self.choice.summary())


def settle_threads(runner: ModelRunner, requested: int | str | None, lock: Any = None) -> AutoThreads | None:
    """Apply an engine's ``threads`` option (see the module docstring); ``None`` leaves torch alone.

    Args:
        runner: the loaded model's runner (its plain step is what ``"auto"`` times).
        requested: ``"auto"``, an int >= 1, or ``None``.
        lock: the engine's lock, held while a re-check times.

    Returns:
        The choice and its re-checker, or ``None`` for ``requested=None``.
    """
    if requested is None:
        return None
    cores = usable_cores()
    if requested != "auto":
        torch.set_num_threads(int(requested))
        return AutoThreads(ThreadChoice(int(requested), "given", cores=cores))
    fixed = threads_from_environment()
    if fixed is not None:
        torch.set_num_threads(fixed)
        return AutoThreads(ThreadChoice(fixed, "environment", cores=cores))
    if runner.device.type != "cpu":
        return AutoThreads(ThreadChoice(torch.get_num_threads(), f"not measured on {runner.device.type}", cores=cores))
    if cores == 1:
        torch.set_num_threads(1)
        return AutoThreads(ThreadChoice(1, "one core", load=load_average(), cores=1))
    step = plain_step(runner)
    choice = measure_choice(step, cores)
    logger.info("%s", choice.summary())
    return AutoThreads(choice, step, lock)
