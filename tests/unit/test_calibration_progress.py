"""Calibration's progress: a line per phase with its estimate, and lines at a sensible rate off a terminal."""

from __future__ import annotations

import logging
import time

import pytest

from selfspec.calibration.progress import CalibrationProgress, about, progress_mode


def test_estimates_read_as_words() -> None:
    assert about(0.2) == "under a second"
    assert about(19.6) == "~20 s"
    assert about(150) == "~2 min"
    assert about(None) == "" and about(float("inf")) == ""


def test_progress_modes() -> None:
    assert progress_mode(True) == "bar" and progress_mode(False) == "off" and progress_mode("lines") == "lines"
    with pytest.raises(ValueError, match="progress must be"):
        progress_mode("loud")


def test_lines_announce_each_phase_and_report_at_most_once_per_heartbeat(caplog) -> None:
    show = CalibrationProgress("lines", phases=2, heartbeat=0.05)
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        show.phase("draft and verify costs", 19.6)
        started = time.perf_counter()
        ticks = 0
        while time.perf_counter() - started < 0.27:  # ~5 heartbeats
            ticks += 1
            show.advance(ticks, 10**9, "timing rounds")
        show.phase("acceptance when sampling", None)
        show.close()
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "calibrating (1/2): draft and verify costs (~20 s)"
    assert said[-1] == "calibrating (2/2): acceptance when sampling"
    beats = [line for line in said if line.startswith("... draft and verify costs: ")]
    assert 3 <= len(beats) <= 6 < ticks  # the rate is the heartbeat's, not the caller's
    assert " of 1000000000 timing rounds, 0 s" in beats[0]
    assert show.lines == said


def test_off_says_nothing(caplog) -> None:
    show = CalibrationProgress("off", phases=1, heartbeat=0.0)
    with caplog.at_level(logging.DEBUG, logger="selfspec"):
        show.phase("anything", 3.0)
        show.advance(1, 2, "prompts")
        show.close()
    assert not caplog.records and show.lines == []
