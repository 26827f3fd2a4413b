"""What calibration is doing and how long it will take: a line per phase, a bar or periodic lines.

Calibration runs in phases (:data:`PHASES`: continuations, acceptance, costs, the drafters' own
measurements, sampled acceptance, precision, trees), each announced with its estimate, e.g.
``calibrating (3/6): draft and verify costs (~20 s)``. Within a phase it reports how far it is:

- ``"bar"``: a ``tqdm`` bar of the phases, the current one and its estimate beside it (a terminal);
- ``"lines"``: each phase's line, then a line at most every :data:`HEARTBEAT_SECONDS` while a
  phase runs (``... draft and verify costs: 12 of 40 timing rounds, 9 s``), as ``WARNING``
  records of the ``selfspec`` logger, which Python prints by default: what a log file, a CI job
  or ``make demo`` piped through ``tee`` shows, at a rate that does not flood it;
- ``"off"``: nothing.

Estimates come from the plain step's seconds (:attr:`CalibrationProgress.step_seconds`, timed
before the first phase) and what each phase will run; a phase bounded by a calibration budget
announces the smaller of its estimate and its share of the budget.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: How often ``"lines"`` progress says that a phase is still running (seconds).
HEARTBEAT_SECONDS = 10.0

ProgressMode = Literal["bar", "lines", "off"]


def progress_mode(progress: bool | str) -> ProgressMode:
    """``True`` -> ``"bar"``, ``False`` -> ``"off"``, a mode name -> itself (anything else is an error)."""
    if progress is True:
        return "bar"
    if progress is False:
        return "off"
    if progress in ("bar", "lines", "off"):
        return progress  # type: ignore[return-value]
    raise ValueError(f"progress must be a bool, 'bar', 'lines' or 'off', got {progress!r}")


def about(seconds: float | None) -> str:
    """An estimate in words: ``"~20 s"``, ``"~2 min"``, ``"under a second"``; empty when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"~{seconds:.0f} s"
    return f"~{seconds / 60:.0f} min"


class CalibrationProgress:
    """Announces calibration's phases with their estimates and reports how far each is.

    Args:
        mode: ``"bar"``, ``"lines"`` or ``"off"`` (:func:`progress_mode`).
        phases: how many phases will be announced (the bar's length and the ``(i/n)`` of each line).
        heartbeat: seconds between ``"lines"`` progress lines within a phase.
    """

    def __init__(self, mode: ProgressMode, phases: int, heartbeat: float = HEARTBEAT_SECONDS) -> None:
        self.mode = mode
        self.phases = phases
        self.heartbeat = heartbeat
        self.step_seconds = 0.0
        self.lines: list[str] = []  # every line said (``"lines"``) or shown beside the bar (``"bar"``)
        self._index = 0
        self._what = ""
        self._estimate = ""
        self._phase_started = time.perf_counter()
        self._last_line = self._phase_started
        self._bar: Any = tqdm(total=phases, desc="calibrating", leave=False) if mode == "bar" else None

    def phase(self, what: str, estimate: float | None = None) -> None:
        """Start the next phase: say what it measures and about how long it will take."""
        if self._index and self._bar is not None:
            self._bar.update()
        self._index += 1
        self._what = what
        self._estimate = about(estimate)
        self._phase_started = self._last_line = time.perf_counter()
        line = f"calibrating ({self._index}/{self.phases}): {what}" + (f" ({self._estimate})" if self._estimate else "")
        self._say(line, f"{what}" + (f" ({self._estimate})" if self._estimate else ""))

    def advance(self, done: int, total: int, unit: str) -> None:
        """Within a phase: ``done`` of ``total`` ``unit`` are measured (a line at most every ``heartbeat`` s)."""
        now = time.perf_counter()
        elapsed = now - self._phase_started
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._what}: {done}/{total} {unit}, {elapsed:.0f} s", refresh=True)
            return
        if self.mode == "lines" and now - self._last_line >= self.heartbeat:
            self._last_line = now
            self._say(f"... {self._what}: {done} of {total} {unit}, {elapsed:.0f} s", "")

    def close(self) -> None:
        """End the bar (the last phase is done)."""
        if self._bar is not None:
            self._bar.update(self.phases - self._bar.n)
            self._bar.close()
            self._bar = None

    def _say(self, line: str, postfix: str) -> None:
        if self.mode == "off":
            return
        self.lines.append(line)
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=True)
        else:
            logger.warning("%s", line)
