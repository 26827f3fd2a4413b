"""``selfspec.artifacts``: one rule for every artifact's location (no model is loaded).

Written: ``model_cache(model, kind) = cache_dir() / kind / model_key(model)``. Read: there first, then
(read only) beside a local model folder, then where earlier versions wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from selfspec.artifacts import (
    BUNDLED_MODELS,
    CALIBRATIONS,
    DEQUANTIZED,
    EAGLE_HEADS,
    EAGLE_TRAINING,
    EXIT_ADAPTERS,
    MEDUSA_HEADS,
    artifact_places,
    cache_dir,
    find_artifact,
    loose_name,
    model_cache,
    model_key,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh user cache for one test."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A local model folder (its contents do not matter to the rule)."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")
    return folder


def test_cache_dir_prefers_selfspec_cache_then_xdg_then_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_CACHE", "/tmp/a")
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/x")
    assert cache_dir() == Path("/tmp/a")
    monkeypatch.delenv("SELFSPEC_CACHE")
    assert cache_dir() == Path("/tmp/x/selfspec")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG spec: a relative value is ignored
    assert cache_dir() == Path.home() / ".cache" / "selfspec"


def test_model_keys(model_folder: Path) -> None:
    assert model_key("org/model") == "org--model"
    assert model_key(BUNDLED_MODELS / "selfspec-demo") == "selfspec-demo"
    local = model_key(model_folder)
    assert local.startswith("my-model-") and len(local) == len("my-model-") + 10
    other = model_folder.parent / "elsewhere" / "my-model"
    other.mkdir(parents=True)
    assert model_key(other) != local  # two folders of one name differ
    assert loose_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == loose_name("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_every_kind_is_written_under_model_cache(cache: Path, model_folder: Path) -> None:
    from selfspec.calibration.store import calibration_path
    from selfspec.drafting.eagle.head import head_folder_for
    from selfspec.drafting.exit_adapter.adapter import exit_adapter_path
    from selfspec.drafting.medusa.drafter import medusa_heads_folder
    from selfspec.modeling.realmodels import models_dir

    for model in ("org/model", str(model_folder)):
        key = model_key(model)
        assert calibration_path(model, "cuda:1", "bfloat16") == cache / CALIBRATIONS / key / "cuda-bfloat16.json"
        assert exit_adapter_path(model) == cache / EXIT_ADAPTERS / key
        assert head_folder_for(model) == cache / EAGLE_HEADS / key
        assert medusa_heads_folder(model) == cache / MEDUSA_HEADS / key
        assert model_cache(model, EAGLE_TRAINING) == cache / EAGLE_TRAINING / key
        assert not str(head_folder_for(model)).startswith(str(model_folder))  # never inside the model's folder
    assert exit_adapter_path(None) is None and calibration_path(None) is None
    assert models_dir() == cache / "models"


def test_places_are_the_cache_then_beside_the_model_then_former_places(cache: Path, model_folder: Path) -> None:
    assert artifact_places(str(model_folder), MEDUSA_HEADS, beside=("medusa", "")) == [
        cache / MEDUSA_HEADS / model_key(model_folder),
        model_folder / "medusa",
        model_folder,
    ]
    assert artifact_places("org/model", EXIT_ADAPTERS, beside=("exit_adapter",)) == [
        cache / EXIT_ADAPTERS / "org--model",
        cache / "org--model" / "exit_adapter",  # where earlier versions wrote a hub model's adapter
    ]
    assert artifact_places("org/Model.Q4_K_M.gguf", EAGLE_HEADS)[1] == cache / "eagle" / "model" / "eagle_head"
    assert find_artifact(None, EAGLE_HEADS, Path.is_dir) is None
    assert find_artifact("org/model", EAGLE_HEADS, Path.is_dir) is None


def _exit_adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}", encoding="utf-8")
    return folder


def test_exit_adapters_are_found_in_order(cache: Path, model_folder: Path) -> None:
    from selfspec.drafting.exit_adapter.adapter import exit_adapter_path, find_exit_adapter

    assert find_exit_adapter(str(model_folder)) is None
    beside = _exit_adapter(model_folder / "exit_adapter")  # shipped or published beside the model: read only
    assert find_exit_adapter(str(model_folder)) == beside
    written = _exit_adapter(exit_adapter_path(str(model_folder)))  # type: ignore[arg-type]
    assert find_exit_adapter(str(model_folder)) == written  # what train-adapter wrote comes first
    former = _exit_adapter(cache / "org--model" / "exit_adapter")
    assert find_exit_adapter("org/model") == former  # an existing user cache keeps working
    assert find_exit_adapter(BUNDLED_MODELS / "selfspec-demo-draft") == BUNDLED_MODELS / "selfspec-demo-draft" / (
        "exit_adapter"
    )


def _eagle_head(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}", encoding="utf-8")  # a published head layout
    return folder


def test_eagle_heads_are_found_in_order(cache: Path, model_folder: Path) -> None:
    from selfspec.drafting.eagle.head import SHIPPED_HEADS, find_eagle_head, head_folder_for

    assert find_eagle_head(str(model_folder)) is None
    beside = _eagle_head(model_folder / "eagle_head")
    assert find_eagle_head(str(model_folder)) == beside
    written = _eagle_head(head_folder_for(str(model_folder)))
    assert find_eagle_head(str(model_folder)) == written
    former = _eagle_head(cache / "eagle" / "model" / "eagle_head")
    assert find_eagle_head("org/Model.Q4_K_M.gguf") == former
    # the heads shipped in the package are found by name, last
    assert find_eagle_head("/nowhere/SmolLM2-135M-Instruct.Q4_1.gguf") == SHIPPED_HEADS / "smollm2-135m-instruct"


def _medusa_heads(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "medusa_lm_head.safetensors").write_bytes(b"")
    return folder


def test_medusa_heads_are_found_in_order(cache: Path, model_folder: Path) -> None:
    from selfspec.drafting.medusa.drafter import find_medusa_heads, medusa_heads_folder

    assert find_medusa_heads(str(model_folder)) is None and find_medusa_heads("org/model") is None
    assert find_medusa_heads(str(_medusa_heads(model_folder))) == model_folder  # a published Medusa repository
    beside = _medusa_heads(model_folder / "medusa")
    assert find_medusa_heads(str(model_folder)) == beside
    written = _medusa_heads(medusa_heads_folder(str(model_folder)))
    assert find_medusa_heads(str(model_folder)) == written
    assert find_medusa_heads(BUNDLED_MODELS / "selfspec-demo") == BUNDLED_MODELS / "selfspec-demo" / "medusa"


def test_dequantized_copies_follow_the_file_and_keep_former_copies(cache: Path, tmp_path: Path) -> None:
    from selfspec.modeling.loading import dequantized_folder

    gguf = tmp_path / "Tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    first = dequantized_folder(str(tmp_path), gguf.name)
    assert first.parent == model_cache(gguf, DEQUANTIZED) == cache / DEQUANTIZED / model_key(gguf)
    gguf.write_bytes(b"GGUF" + bytes(61))  # an edited file gets a new copy
    os.utime(gguf, ns=(1, 1))
    second = dequantized_folder(str(tmp_path), gguf.name)
    assert second.parent == first.parent and second != first
    hub = dequantized_folder("org/repo", "model.gguf")
    assert hub == cache / DEQUANTIZED / "org--repo--model.gguf" / "hub"
    # a copy an earlier version made (<cache>/gguf/<stem>-<hash>) is used rather than converted again
    import hashlib

    info = gguf.resolve().stat()
    ident = f"{gguf.resolve()}|{info.st_size}|{info.st_mtime_ns}"
    former = cache / DEQUANTIZED / f"Tiny.Q4_0-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    former.mkdir(parents=True)
    (former / "config.json").write_text(json.dumps({}), encoding="utf-8")
    (former / "model.safetensors").write_bytes(b"")
    assert dequantized_folder(str(tmp_path), gguf.name) == former


def test_the_suite_writes_into_a_temporary_cache() -> None:
    """tests/conftest.py: what tests write stays out of the user's cache; fetched checkpoints are linked in."""
    import tempfile

    assert Path(tempfile.gettempdir()) in cache_dir().parents
    assert (cache_dir() / "models").is_symlink()
