"""First-load calibration and a cache that fails: a lock for one model, a full disk, a kept plan.

Tiny models, real calibrations (about half a second each); a full disk is simulated by ``os.write``
failing with ``ENOSPC``, on the real file system otherwise.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.calibration import calibrate, calibration_path, load_calibration
from selfspec.calibration.measure import calibrate_on_first_load
from selfspec.calibration.store import calibration_lock


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("selfspec")]


def _engine(name: str, model=None) -> SpeculativeEngine:
    """An uncalibrated engine of a tiny model named ``name`` (where its calibration is saved)."""
    model = model if model is not None else make_model("llama", agreeing=True, dtype=torch.float32)
    model.config._name_or_path = name
    return SpeculativeEngine(model, calibration={})


def save_tiny_model(folder: Path) -> Path:
    """A tiny Llama and its tokenizer saved as a model folder (no calibration beside it)."""
    tokenizer = make_tokenizer()
    model = make_model("llama", agreeing=True, dtype=torch.float32, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``os.write`` fails as a full disk does (file systems otherwise real)."""

    def write(handle: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


def test_a_second_process_waits_for_the_model_being_measured_and_uses_its_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first measures under the lock (its own file descriptor, as another process would); the second waits."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    name = str(tmp_path / "model")
    model = make_model("llama", agreeing=True, dtype=torch.float32)
    first, second = _engine(name, model), _engine(name, model)
    measuring = threading.Event()

    def measure_first() -> None:
        with calibration_lock(name, "cpu", "float32") as lock:
            assert lock.held and not lock.waited
            measuring.set()
            calibrate(first, max_new_tokens=12, max_draft_tokens=3, progress=False)  # saves

    thread = threading.Thread(target=measure_first)
    thread.start()
    assert measuring.wait(10.0)
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        calibrate_on_first_load(second)
    thread.join()
    lines = _messages(caplog)
    assert any(f"already being measured by pid {os.getpid()}, waiting" in line for line in lines), lines
    assert any(line.startswith(f"using the calibration pid {os.getpid()} measured: ") for line in lines), lines
    assert not any(line.startswith("first load of") for line in lines), lines  # it did not measure in full
    saved = load_calibration(name)
    assert saved is not None and second.config.calibration == saved
    assert second.plan is not None and second.plan.calibrated


def test_a_wait_that_runs_out_measures_here_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("selfspec.calibration.store.CALIBRATION_WAIT", 0.2)
    name = str(tmp_path / "model")
    engine = _engine(name)
    with calibration_lock(name, "cpu", "float32", wait=1.0):  # held, and never saves anything
        with caplog.at_level(logging.WARNING, logger="selfspec"):
            calibrate_on_first_load(engine)
    lines = _messages(caplog)
    assert any("already being measured" in line for line in lines)
    assert any("still measures" in line and "measuring here too" in line for line in lines), lines
    assert engine.plan is not None and engine.plan.calibrated and load_calibration(name) is not None


def test_a_full_disk_keeps_the_previous_calibration_whole_and_the_new_plan_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    name = str(tmp_path / "model")
    calibrate_on_first_load(_engine(name))
    where = calibration_path(name, "cpu", "float32")
    assert where is not None
    before = where.read_bytes()
    assert len(before) > 1000
    again = _engine(name)
    with monkeypatch.context() as full:
        _full_disk(full)
        with caplog.at_level(logging.WARNING, logger="selfspec"):
            calibrate_on_first_load(again)  # a re-measurement (say, a head was trained since) on a full disk
    assert where.read_bytes() == before  # the previous valid file, untouched; never a 0-byte or torn one
    assert sorted(p.name for p in where.parent.iterdir()) == [where.name, where.name + ".lock"]
    failures = [line for line in _messages(caplog) if "could not save" in line]
    assert len(failures) == 1 and str(where) in failures[0] and "[Errno 28]" in failures[0], failures
    assert "kept in memory for this process" in failures[0]
    kept = load_calibration(name)  # this process uses what it measured (stamped as a saved file is)
    assert kept is not None and {key: kept[key] for key in again.config.calibration} == again.config.calibration


def test_a_cache_that_cannot_be_written_keeps_the_first_load_plan_for_the_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``from_pretrained`` twice: one measurement, one warning naming the file; the second load uses the plan."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_model(tmp_path / "tiny")
    _full_disk(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        first = SpeculativeEngine.from_pretrained(folder, calibration_budget=5)
        second = SpeculativeEngine.from_pretrained(folder, calibration_budget=5)
    lines = _messages(caplog)
    where = calibration_path(str(folder), "cpu", "float32")
    assert where is not None and not where.exists()
    assert sum(line.startswith("first load of") for line in lines) == 1, lines
    failures = [line for line in lines if "could not save" in line]
    assert len(failures) == 1 and str(where) in failures[0], lines
    assert first.plan is not None and first.plan.calibrated
    assert second.plan is not None and second.plan.summary() == first.plan.summary()
    prompt = [5, 6, 7, 8]
    assert (
        second.generate_ids(prompt, max_new_tokens=8).token_ids
        == first.generate_ids(prompt, max_new_tokens=8).token_ids
    )


def test_selfspec_calibrate_on_a_full_disk_says_not_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from selfspec.cli.main import main

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    folder = save_tiny_model(tmp_path / "tiny")
    _full_disk(monkeypatch)
    argv = ["calibrate", "--model", str(folder), "--max-new-tokens", "8", "--calibration-budget", "3", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "not saved ([Errno 28] could not save " in out and "kept for this process only" in out, out
    assert "saved to" not in out
