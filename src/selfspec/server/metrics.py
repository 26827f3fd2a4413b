"""Prometheus metrics under the engine's :class:`~selfspec.outputs.GenerationStats` names.

Counters sum each finished generation's stats (``selfspec_<field>_total``); the ratio fields
(``mean_accepted_length``, ``acceptance_rate``, ``tokens_per_second``) are gauges computed
over every generation so far, the way one would compute them for one long generation. Written
by hand in the text exposition format (version 0.0.4): no client library is needed.
"""

from __future__ import annotations

import threading
from collections import Counter

from ..outputs import GenerationOutput

#: The ``Content-Type`` of the exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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

    def generation_started(self) -> None:
        """Count a generation in progress."""
        with self._lock:
            self.running += 1

    def request_finished(self, endpoint: str, status: int) -> None:
        """Count an answered request (``status`` as sent; a stream counts when it ends)."""
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def generation_done(self, output: GenerationOutput, seconds: float) -> None:
        """Add one finished (or cancelled) generation."""
        stats = output.stats
        with self._lock:
            self.running -= 1
            self.generations[output.finish_reason] += 1
            self.prompt_tokens += output.prompt_tokens
            self.completion_tokens += len(output.token_ids)
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
        """The metrics in Prometheus' text exposition format."""
        with self._lock:
            steps = self.verify_steps
            lines: list[str] = []

            def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
                lines.append(f"# HELP selfspec_{name} {help_text}")
                lines.append(f"# TYPE selfspec_{name} {kind}")
                lines.extend(f"selfspec_{name}{labels} {_number(value)}" for labels, value in samples)

            metric(
                "requests_total",
                "counter",
                "HTTP requests answered, by endpoint and status code.",
                [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())],
            )
            metric(
                "requests_running",
                "gauge",
                "Generations in progress (running or waiting for the engine).",
                [("", self.running)],
            )
            metric(
                "generations_total",
                "counter",
                "Generations finished, by finish reason (cancelled: the client went away).",
                [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.generations.items())],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "New tokens generated.", [("", self.completion_tokens)])
            metric(
                "target_forwards_total",
                "counter",
                "Forward passes of the full target model (prefills included).",
                [("", self.target_forwards)],
            )
            metric("num_drafted_total", "counter", "Draft tokens proposed.", [("", self.num_drafted)])
            metric("num_accepted_total", "counter", "Draft tokens the target accepted.", [("", self.num_accepted)])
            metric(
                "accepted_length_histogram_total",
                "counter",
                "Verify steps that accepted this many draft tokens.",
                [(f'{{accepted="{i}"}}', n) for i, n in enumerate(self.accepted_length_histogram)],
            )
            metric("draft_seconds_total", "counter", "Wall time spent drafting.", [("", self.draft_seconds)])
            metric(
                "verify_seconds_total",
                "counter",
                "Wall time spent in target forwards (prefills included).",
                [("", self.verify_seconds)],
            )
            metric(
                "mean_accepted_length",
                "gauge",
                "Tokens emitted per verify step after the prefill, over all generations (tau).",
                [("", self.decoded_tokens / steps if steps > 0 else 0.0)],
            )
            metric(
                "acceptance_rate",
                "gauge",
                "num_accepted / num_drafted over all generations.",
                [("", self.num_accepted / self.num_drafted if self.num_drafted else 0.0)],
            )
            metric(
                "tokens_per_second",
                "gauge",
                "New tokens per second of generation time, over all generations.",
                [("", self.completion_tokens / self.generation_seconds if self.generation_seconds else 0.0)],
            )
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
