"""Every head and training state is saved atomically, and never through a link out of the cache.

Tiny heads (an exit adapter, Medusa heads, an EAGLE head of a tiny model, ``train-eagle``'s state),
saved into a real temporary cache.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import make_model

from selfspec.drafting.eagle import resume
from selfspec.drafting.eagle.head import HEAD_CONFIG, HEAD_WEIGHTS, EagleHead
from selfspec.drafting.exit_adapter.adapter import CONFIG_FILE, WEIGHTS_FILE, ExitAdapter, ExitAdapterConfig
from selfspec.drafting.medusa.drafter import MEDUSA_CONFIG, MEDUSA_SAFETENSORS, MedusaHeads
from selfspec.errors import ArtifactWriteError, UnsafeCachePathError


def _exit_adapter(folder: Path) -> None:
    ExitAdapter(ExitAdapterConfig(exit_layer=1, hidden_size=32, rank=4, num_layers=6, vocab_size=96)).save(folder)


def _medusa(folder: Path) -> None:
    MedusaHeads(2, 32, 96).save(folder)


def _eagle(folder: Path) -> None:
    EagleHead(make_model("llama", dtype=torch.float32)).save(folder)


def _training_state(folder: Path) -> None:
    resume._write(folder, resume.CHECKPOINT, {"weight": torch.ones(3)}, {"step": 1})


#: (saver, its kind's folder in the cache, its weights file, its config file)
SAVERS: dict[str, tuple[Callable[[Path], None], str, str, str]] = {
    "exit_adapter": (_exit_adapter, "exit_adapters", WEIGHTS_FILE, CONFIG_FILE),
    "medusa": (_medusa, "medusa_heads", MEDUSA_SAFETENSORS, MEDUSA_CONFIG),
    "eagle": (_eagle, "eagle_heads", HEAD_WEIGHTS, HEAD_CONFIG),
    "training_state": (_training_state, "eagle_training", "checkpoint.safetensors", "checkpoint.json"),
}


@pytest.mark.parametrize("name", sorted(SAVERS))
def test_a_head_is_saved_whole_and_never_through_a_link_out_of_the_cache(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save, kind, weights, config = SAVERS[name]
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / kind / "m"
    folder.mkdir(parents=True)
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"the user's file")
    (folder / weights).symlink_to(outside)
    with pytest.raises(UnsafeCachePathError, match="outside the selfspec cache"):
        save(folder)
    assert outside.read_bytes() == b"the user's file" and not (folder / config).exists()
    (folder / weights).unlink()
    save(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([weights, config])  # no partial file left
    before = {file: (folder / file).read_bytes() for file in (weights, config)}

    def full_disk(handle: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)  # the config's write fails (the weights are written by safetensors)
    with pytest.raises(ArtifactWriteError, match=config.replace(".", r"\.")) as caught:
        save(folder)
    assert caught.value.errno == errno.ENOSPC
    assert (folder / config).read_bytes() == before[config]  # the old config, whole
    assert sorted(p.name for p in folder.iterdir()) == sorted([weights, config])
