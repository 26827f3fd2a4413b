"""``train-adapter`` without ``--exit-layer``: the calibrated exit layer, else ``L // 4`` (passed in by ``cli``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.calibration.store import save_calibration
from selfspec.cli.main import build_parser, calibrated_exit_layer


def test_the_default_exit_layer_is_the_calibrated_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model = str(tmp_path / "some-model")
    assert calibrated_exit_layer(model, 16) == 4  # no calibration: L // 4
    assert calibrated_exit_layer(model, 2) == 1  # never layer 0
    save_calibration(model, {"exit_layer": 7})
    assert calibrated_exit_layer(model, 16) == 7
    assert calibrated_exit_layer(str(tmp_path / "another-model"), 16) == 4


def test_the_registered_command_reads_the_calibration() -> None:
    args = build_parser().parse_args(["train-adapter", "--model", "m"])
    assert args.exit_layer is None and args.func.keywords == {"default_exit_layer": calibrated_exit_layer}
