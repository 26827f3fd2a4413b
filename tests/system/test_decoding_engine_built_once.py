"""``from_pretrained`` builds an engine's parts once per plan (issue 42, item 2), first-load calibration included.

Before, the constructor built the drafter, controller, scheduler and static round, and first-load
calibration built them all again for the plan it chose; now the settings are resolved first and the
parts are built once, for the plan that runs. ``parts_built`` counts the builds of the real engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_model
from tiny_tokenizer import make_tokenizer

from selfspec import SpeculativeEngine
from selfspec.errors import ConfigurationError


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))  # no saved calibration: first load measures
    tokenizer = make_tokenizer()
    model = make_model("llama", dtype=torch.float32, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_first_load_calibration_builds_the_parts_once(model_dir: Path) -> None:
    engine = SpeculativeEngine.from_pretrained(model_dir, threads=1)  # drafter="auto": measures on first load
    assert engine.calibration and engine.plan is not None
    assert engine.parts_built == 1
    out = engine.generate("It is a truth", max_new_tokens=8)
    assert out.token_ids and engine.parts_built == 1
    again = SpeculativeEngine.from_pretrained(model_dir, threads=1)  # the saved plan: nothing measured
    assert again.plan.summary() == engine.plan.summary() and again.parts_built == 1


def test_the_constructor_and_configure_build_once_each(model_dir: Path) -> None:
    loaded = SpeculativeEngine.from_pretrained(model_dir, drafter="none", threads=1)
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer, drafter="early_exit", exit_layer=2, calibration={})
    assert engine.parts_built == 1
    engine.configure({"exit_layer": 3})
    assert engine.parts_built == 2 and engine.drafter.exit_layer == 2  # the explicit layer wins over a plan's


def test_a_bad_drafter_setting_still_fails_inside_from_pretrained(model_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="medusa"):
        SpeculativeEngine.from_pretrained(model_dir, drafter="medusa", threads=1)
