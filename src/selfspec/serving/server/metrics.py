"""Prometheus metrics under the engine's :class:`~selfspec.decoding.outputs.GenerationStats` names.

Counters sum each finished generation's stats (``selfspec_<field>_total``); the ratio fields
(``mean_accepted_length``, ``acceptance_rate``, ``tokens_per_second``) are gauges computed
over every generation so far, the way one would compute them for one long generation. The
exposition is written by ``prometheus_client`` (the standard client library), from one custom
collector per server that reads these counters under their lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, exposition, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...decoding.outputs import GenerationOutput
from ..requests import TokenUsage

if TYPE_CHECKING:
    from .allocator import IdleTrim

#: The ``Content-Type`` of the exposition format ``generate_latest`` writes (text format 0.0.4).
CONTENT_TYPE: str = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", "text/plain; version=0.0.4; charset=utf-8")


class Metrics:
    """Thread-safe request and generation counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.running = 0
        self.generations: Counter[str] = Counter()  # finish reason -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.target_forwards = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.decoded_tokens = 0.0  # tokens emitted by verify steps (the prefill's token excluded)
        self.verify_steps = 0  # target forwards after the prefills
        self.accepted_length_histogram: list[int] = []
        self.draft_seconds = 0.0
        self.verify_seconds = 0.0
        self.generation_seconds = 0.0
        self.idle_trim: IdleTrim | None = None  # the server's allocator trims, when it trims

    def generation_started(self) -> None:
        """Count a generation in progress."""
        with self._lock:
            self.running += 1

    def request_finished(self, endpoint: str, status: int) -> None:
        """Count an answered request (``status`` as sent; a stream counts when it ends)."""
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation_done(self, output: GenerationOutput, seconds: float, finish_reason: str | None = None) -> None:
        """Add one finished (or cancelled) generation (``finish_reason``: the planner's, e.g. ``repetition``)."""
        stats = output.stats
        with self._lock:
            self.running -= 1
            self.generations[finish_reason or output.finish_reason] += 1
            usage = TokenUsage.of(output)
            self.prompt_tokens += usage.prompt_tokens
            self.completion_tokens += usage.completion_tokens
            self.target_forwards += stats.target_forwards
            self.num_drafted += stats.num_drafted
            self.num_accepted += stats.num_accepted
            steps = max(0, stats.target_forwards - 1)
            self.verify_steps += steps
            self.decoded_tokens += stats.mean_accepted_length * steps
            histogram = self.accepted_length_histogram
            histogram.extend([0] * (len(stats.accepted_length_histogram) - len(histogram)))
            for length, count in enumerate(stats.accepted_length_histogram):
                histogram[length] += count
            self.draft_seconds += stats.draft_seconds
            self.verify_seconds += stats.verify_seconds
            self.generation_seconds += seconds

    def generation_failed(self) -> None:
        """A generation request that ended without output (an error before or while decoding)."""
        with self._lock:
            self.running -= 1
            self.generations["error"] += 1

    def render(self) -> str:
        """The metrics in Prometheus' text exposition format (written by ``prometheus_client``)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry).decode("utf-8")

    def families(self) -> Iterator[Any]:
        """The metric families, read under the lock (one consistent snapshot)."""
        with self._lock:
            steps = self.verify_steps

            def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
                return CounterMetricFamily(f"selfspec_{name}", help_text, value=value)

            requests = CounterMetricFamily(
                "selfspec_requests",
                "HTTP requests answered, by endpoint and status code.",
                labels=["endpoint", "status"],
            )
            for (endpoint, status), count in sorted(self.requests.items()):
                requests.add_metric([endpoint, str(status)], count)
            generations = CounterMetricFamily(
                "selfspec_generations",
                "Generations finished, by finish reason (cancelled: the client went away).",
                labels=["finish_reason"],
            )
            for reason, count in sorted(self.generations.items()):
                generations.add_metric([str(reason)], count)
            histogram = CounterMetricFamily(
                "selfspec_accepted_length_histogram",
                "Verify steps that accepted this many draft tokens.",
                labels=["accepted"],
            )
            for length, count in enumerate(self.accepted_length_histogram):
                histogram.add_metric([str(length)], count)
            families = [
                requests,
                GaugeMetricFamily(
                    "selfspec_requests_running",
                    "Generations in progress (running or waiting for the engine).",
                    value=self.running,
                ),
                generations,
                counter("prompt_tokens", "Prompt tokens processed.", self.prompt_tokens),
                counter("completion_tokens", "New tokens generated.", self.completion_tokens),
                counter(
                    "target_forwards",
                    "Forward passes of the full target model (prefills included).",
                    self.target_forwards,
                ),
                counter("num_drafted", "Draft tokens proposed.", self.num_drafted),
                counter("num_accepted", "Draft tokens the target accepted.", self.num_accepted),
                histogram,
                counter("draft_seconds", "Wall time spent drafting.", self.draft_seconds),
                counter(
                    "verify_seconds", "Wall time spent in target forwards (prefills included).", self.verify_seconds
                ),
                GaugeMetricFamily(
                    "selfspec_mean_accepted_length",
                    "Tokens emitted per verify step after the prefill, over all generations (tau).",
                    value=self.decoded_tokens / steps if steps > 0 else 0.0,
                ),
                GaugeMetricFamily(
                    "selfspec_acceptance_rate",
                    "num_accepted / num_drafted over all generations.",
                    value=self.num_accepted / self.num_drafted if self.num_drafted else 0.0,
                ),
                GaugeMetricFamily(
                    "selfspec_tokens_per_second",
                    "New tokens per second of generation time, over all generations.",
                    value=self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0,
                ),
            ]
        trim = self.idle_trim
        families += [
            counter(
                "malloc_trims",
                "Times the server went idle and returned free memory (malloc_trim).",
                trim.trims if trim else 0,
            ),
            counter("malloc_trim_seconds", "Wall time spent in those trims.", trim.seconds if trim else 0.0),
        ]
        yield from families


class _Collector(Collector):
    """Hands ``prometheus_client`` the families of one :class:`Metrics`."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self.metrics.families()
