"""A hostile or broken model config is refused before a module is built (issue 44).

``selfspec generate --model <copy of the demo model with a bad config.json>`` exits with status 2 and
one ``selfspec: error: <file>: <field>=<value> is invalid; it must be ...`` line. The config bomb
(``num_hidden_layers: 1000000``, which made transformers build layers until memory ran out) is
refused in under 5 s with under 200 MB of extra memory, measured in a fresh process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from selfspec import ModelConfigError, SpeculativeEngine, demo_model_path
from selfspec.cli import main

PROMPT = "Hello"


def bad_demo_copy(folder: Path, **changes: Any) -> Path:
    """A copy of the demo model whose config.json has ``changes`` (``None`` drops the field)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in demo_model_path().iterdir():
        if path.is_file() and path.name != "selfspec.json":  # not its calibration, not medusa/
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param(
            {"num_hidden_layers": 0}, r"num_hidden_layers=0 is invalid; it must be an int in \[1, 1024\]", id="layers=0"
        ),
        pytest.param({"num_hidden_layers": -3}, r"num_hidden_layers=-3 is invalid", id="layers=-3"),
        pytest.param(
            {"num_hidden_layers": 12},
            r"num_hidden_layers=12 is invalid; it must be 16: model\.safetensors "
            "holds 16 layers",
            id="layers-not-the-weights",
        ),
        pytest.param({"num_attention_heads": 0}, r"num_attention_heads=0 is invalid", id="heads=0"),
        pytest.param(
            {"num_attention_heads": "3"}, r"num_attention_heads='3' is invalid; it must be an int", id="heads-a-string"
        ),
        pytest.param({"max_position_embeddings": -1}, r"max_position_embeddings=-1 is invalid", id="context=-1"),
        pytest.param(
            {"hidden_size": 190, "head_dim": None},
            r"hidden_size=190 is invalid; it must be a multiple of "
            r"num_attention_heads \(3\)",
            id="hidden-not-divisible",
        ),
        pytest.param(
            {"vocab_size": 4000},
            r"vocab_size=4000 is invalid; it must be 4096: model\.safetensors's "
            r"embedding is \[4096, 192\]",
            id="vocab-not-the-weights",
        ),
        pytest.param({"hidden_size": 384}, r"hidden_size=384 is invalid; it must be 192", id="hidden-not-the-weights"),
        pytest.param(
            {"rms_norm_eps": "small"},
            r"rms_norm_eps='small' is invalid; it must be what transformers "
            "accepts",
            id="eps-a-string",
        ),
    ],
)
def test_generate_refuses_a_bad_config_naming_the_file_and_field(capsys, tmp_path, changes, message) -> None:
    folder = bad_demo_copy(tmp_path / "model", **changes)
    code = main(["generate", "--model", str(folder), "--no-calibrate", PROMPT])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    assert err.startswith(f"selfspec: error: {folder / 'config.json'}: ") and re.search(message, err), err


def test_the_engine_raises_the_typed_error(tmp_path) -> None:
    folder = bad_demo_copy(tmp_path / "model", num_attention_heads=0)
    with pytest.raises(ModelConfigError) as caught:
        SpeculativeEngine.from_pretrained(str(folder), calibrate=False)
    assert caught.value.field == "num_attention_heads" and caught.value.file == str(folder / "config.json")


#: Runs in a fresh process: imports first, then the refused command, timed, its resident memory sampled every 5 ms.
_BOMB = """
import json, resource, sys, threading, time
import torch, transformers
from selfspec.cli import main

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()

rss_before, peak, done = rss(), [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.005)

sampler = threading.Thread(target=sample)
sampler.start()
start = time.perf_counter()
code = main(["generate", "--model", sys.argv[1], "--no-calibrate", "Hello"])
seconds = time.perf_counter() - start
done.set()
sampler.join()
peak[0] = max(peak[0], rss())
print(json.dumps({"code": code, "seconds": seconds, "added_bytes": peak[0] - rss_before, "rss_before": rss_before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_layer_bomb_is_refused_at_once_in_bounded_memory(tmp_path) -> None:
    folder = bad_demo_copy(tmp_path / "model", num_hidden_layers=1_000_000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _BOMB, str(folder)], capture_output=True, text=True, timeout=120, env=env
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, done.stderr
    assert "num_hidden_layers=1000000 is invalid; it must be an int in [1, 1024]" in done.stderr
    assert result["seconds"] < 5, result  # before: no end, RSS growing ~17 MB/s
    assert result["added_bytes"] < 200 * 2**20, result
