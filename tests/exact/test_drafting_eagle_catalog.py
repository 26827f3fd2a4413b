"""``eagle_head="auto"`` finds a published head in the table, checks it, loads it from a local hub folder.

A tiny float32 Llama is saved under a hub-like name; a random EAGLE-3 head for it, in vLLM's
``speculators`` layout, is written into a local folder that serves as the hub
(``SELFSPEC_HEAD_HUB``), laid out either as ``<root>/<owner>/<name>/`` or as huggingface_hub's
own cache (``models--owner--name/refs/main`` + ``snapshots/<commit>/``, read by huggingface_hub
offline); an extra table (``SELFSPEC_HEAD_CATALOG``) names the pairing. Then:
``from_pretrained(..., eagle_head="auto")`` loads that head and decodes greedily token for token
as transformers' ``generate`` in float32; ``drafter="auto"`` measures it; a head whose config
does not fit (verifier name or class, hidden size, vocabulary, tapped layers) is refused with the field
and both values; with no copy and the hub offline, decoding goes on and the plan names the head
and the command that fetches it. Online, huggingface_hub's real client fetches the head from a
stand-in for the hub on localhost (``tests/fake_hub.py``): the config first (a head that does not
fit is refused before its weights are asked for), then a size line and the weights.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_hub import FakeHub
from test_drafting_eagle_eagle3 import LAYERS, draft_vocab, random_eagle3, speculators_config, write
from tiny_models import make_model, reference_greedy

from selfspec import SpeculativeEngine
from selfspec.drafting.eagle import catalog
from selfspec.drafting.eagle.catalog import CATALOG_ENV, HUB_ENV, HeadMismatchError
from selfspec.drafting.eagle.eagle3 import Eagle3Head
from selfspec.errors import ConfigurationError

TARGET = "selfspec-tests/tiny-llama-hubtest"
HEAD_REPO = "selfspec-tests/tiny-llama-hubtest-speculator.eagle3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ([5, 9, 3, 17, 4, 8], [60, 61, 7])


@pytest.fixture(scope="module")
def tiny() -> Any:
    """The tiny Llama (hidden 32, 6 layers, vocab 96) in float32, as the user loads it."""
    return make_model("llama", agreeing=True, dtype=torch.float32)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny) -> Path:
    folder = tmp_path_factory.mktemp("models") / TARGET.split("/")[1]
    tiny.save_pretrained(folder)
    return folder


def head_config(tiny: Any, **changes: Any) -> dict[str, Any]:
    """The head's speculators config.json, naming the tiny model as its verifier."""
    config = speculators_config(tiny, LAYERS, 64, False)
    config["speculators_config"]["verifier"]["name_or_path"] = TARGET
    return {**config, **changes}


def write_hub(root: Path, tiny: Any, layout: str, config: dict[str, Any], repo_id: str = HEAD_REPO) -> Path:
    """The head in a local hub folder: ``<root>/<repo>/`` (plain) or a huggingface_hub cache (hf-cache)."""
    weights = random_eagle3(tiny, LAYERS, draft_vocab(tiny, 64))
    if layout == "plain":
        return write(root / repo_id, weights, config)
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT, encoding="utf-8")
    return write(repo / "snapshots" / COMMIT, weights, config)


@pytest.fixture
def table(tmp_path, monkeypatch) -> Path:
    """An extra table naming the pairing, and an empty local hub; both through their variables."""
    path = tmp_path / "heads.json"
    path.write_text(json.dumps({"version": 1, "heads": [{"target": TARGET, "repo_id": HEAD_REPO}]}), encoding="utf-8")
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv(CATALOG_ENV, str(path))
    monkeypatch.setenv(HUB_ENV, str(hub))
    monkeypatch.setattr(catalog, "_SAID", set())  # each test sees its own warnings
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # not this machine's cache
    return hub


@pytest.mark.parametrize("layout", ["plain", "hf-cache"])
def test_auto_finds_checks_and_loads_the_published_head(table, tiny, model_folder, layout) -> None:
    folder = write_hub(table, tiny, layout, head_config(tiny))
    resolution = catalog.resolve_published_head(str(model_folder), tiny)
    assert resolution is not None and resolution.status == "found" and resolution.folder == folder
    engine = SpeculativeEngine.from_pretrained(
        str(model_folder), drafter="eagle", eagle_head="auto", dtype=torch.float32, num_draft_tokens=3
    )
    head = engine.drafter.head  # type: ignore[attr-defined]
    assert isinstance(head, Eagle3Head) and Path(head.source) == folder
    for prompt in PROMPTS:
        out = engine.generate_ids(prompt, max_new_tokens=24)
        assert out.token_ids == reference_greedy(tiny, prompt, 24)
        assert out.stats.num_drafted > 0  # the found head drafted


def test_a_pinned_entry_takes_only_its_own_commit(table, tiny, model_folder) -> None:
    """In a huggingface_hub cache layout, an entry pinned to a commit finds that snapshot, never another."""
    folder = write_hub(table, tiny, "hf-cache", head_config(tiny))  # snapshots/COMMIT, refs/main -> COMMIT
    (table / f"models--{HEAD_REPO.replace('/', '--')}" / "refs" / "main").unlink()  # only the commit names it
    extra = Path(os.environ[CATALOG_ENV])
    other = "f" * 40
    for revision, status in ((COMMIT, "found"), (other, "missing")):
        entry = {"target": TARGET, "repo_id": HEAD_REPO, "revision": revision}
        extra.write_text(json.dumps({"version": 1, "heads": [entry]}), encoding="utf-8")
        resolution = catalog.resolve_published_head(str(model_folder), tiny)
        assert resolution is not None and resolution.status == status, resolution
        assert resolution.folder == (folder if status == "found" else None)
        assert f"--revision {revision}" in resolution.fetch_command
        assert resolution.entry.label == f"{HEAD_REPO}@{revision}"


def test_drafter_auto_measures_the_found_head(table, tiny, model_folder) -> None:
    """``drafter="auto"`` considers the found head like the shipped one: calibration measures it."""
    folder = write_hub(table, tiny, "plain", head_config(tiny))
    engine = SpeculativeEngine.from_pretrained(
        str(model_folder), eagle_head="auto", dtype=torch.float32, calibration_budget=60
    )
    assert engine.calibration["eagle"]["head"] == str(folder)
    assert engine.calibration["eagle"]["accepted_per_round"]
    out = engine.generate_ids(PROMPTS[0], max_new_tokens=16)
    assert out.token_ids == reference_greedy(tiny, PROMPTS[0], 16)


MISMATCHES = {
    "verifier": ({"speculators_config": {"verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}}},
                 "meta-llama/Llama-3.1-8B-Instruct"),
    "verifier architectures": ({"speculators_config": {"verifier": {"name_or_path": TARGET,
                                                                     "architectures": ["Qwen3ForCausalLM"]}}},
                               ["Qwen3ForCausalLM"]),
    "hidden size": ({"target_hidden_size": 64}, 64),
    "vocabulary": ({"transformer_layer_config": {"vocab_size": 128}}, 128),
    "tapped layers": ({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, [1, 3, 9]),
}  # fmt: skip


@pytest.mark.parametrize("field", list(MISMATCHES))
def test_a_mismatched_head_is_refused_with_the_field_and_both_values(table, tiny, model_folder, field, caplog) -> None:
    changes, head_value = MISMATCHES[field]
    config = head_config(tiny)
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    write_hub(table, tiny, "plain", config)
    with pytest.raises(HeadMismatchError) as refused:
        SpeculativeEngine.from_pretrained(str(model_folder), drafter="eagle", eagle_head="auto", dtype=torch.float32)
    error = refused.value
    model_value = {"verifier": str(model_folder), "verifier architectures": ["LlamaForCausalLM"], "hidden size": 32,
                   "vocabulary": 96, "tapped layers": "layers 0..6"}  # fmt: skip
    assert (error.field, error.head_value, error.model_value) == (field, head_value, model_value[field])
    assert isinstance(error, ConfigurationError) and f"{field} {head_value!r}" in str(error) and HEAD_REPO in str(error)
    # drafter="auto" goes on without it (and says why, once)
    with caplog.at_level(logging.WARNING, logger="selfspec"):
        engine = SpeculativeEngine.from_pretrained(str(model_folder), dtype=torch.float32, calibrate=False)
        assert catalog.find_published_head(str(model_folder), engine.runner.model) is None
    assert any("refuses" in r.getMessage() and field in r.getMessage() for r in caplog.records)
    assert engine.generate_ids(PROMPTS[0], max_new_tokens=12).token_ids == reference_greedy(tiny, PROMPTS[0], 12)


def test_offline_without_a_copy_the_plan_names_the_head_and_its_fetch_command(table, tiny, model_folder) -> None:
    assert catalog.hub_offline()  # the test session is offline (conftest)
    (table / HEAD_REPO).mkdir(parents=True)  # what an interrupted fetch leaves: the config, no weights
    (table / HEAD_REPO / "config.json").write_text(json.dumps(head_config(tiny)), encoding="utf-8")
    resolution = catalog.resolve_published_head(str(model_folder), tiny)
    assert resolution is not None and resolution.status == "missing" and resolution.folder is None
    command = f"hf download {HEAD_REPO} --include '*.json' --include '*.safetensors' --local-dir {table / HEAD_REPO}"
    assert resolution.fetch_command == command
    engine = SpeculativeEngine.from_pretrained(
        str(model_folder), eagle_head="auto", dtype=torch.float32, calibrate=False
    )
    assert engine.plan is not None
    advice = engine.plan.advice(engine.name_or_path, has_head=False)
    assert HEAD_REPO in advice and command in advice and "offline" in advice
    assert engine.generate_ids(PROMPTS[1], max_new_tokens=12).token_ids == reference_greedy(tiny, PROMPTS[1], 12)
    with pytest.raises(ConfigurationError, match="fetch it with `hf download"):
        SpeculativeEngine.from_pretrained(str(model_folder), drafter="eagle", eagle_head="auto", dtype=torch.float32)
    # the command's folder is where the resolver looks: a copy put there is found
    (table / HEAD_REPO / "config.json").unlink()
    write_hub(table, tiny, "plain", head_config(tiny))
    found = catalog.resolve_published_head(str(model_folder), tiny)
    assert found is not None and found.status == "found" and found.folder == table / HEAD_REPO


def test_a_hub_that_cannot_be_reached_leaves_the_head_missing(table, tiny, model_folder, monkeypatch) -> None:
    """Fetching when the hub cannot be reached (huggingface_hub's own offline refusal stands in for no
    network: the fetch runs its real calls) leaves the head missing, with why, and asks once per process;
    the table's next head for the model is then not asked for (the hub is the same)."""
    monkeypatch.setattr(catalog, "hub_offline", lambda: False)
    monkeypatch.setattr(catalog, "_UNREACHABLE", {})
    second = f"{HEAD_REPO}-second"
    entries = [{"target": TARGET, "repo_id": repo} for repo in (HEAD_REPO, second)]
    Path(os.environ[CATALOG_ENV]).write_text(json.dumps({"version": 1, "heads": entries}), encoding="utf-8")
    resolution = catalog.resolve_published_head(str(model_folder), tiny)
    assert resolution is not None and resolution.status == "missing", resolution
    assert resolution.entry.repo_id == HEAD_REPO and resolution.reason.startswith("the hub was not reached")
    skipped = f"{resolution.reason} (asking for {HEAD_REPO})"  # the second was not asked for: the first's why
    assert catalog._UNREACHABLE == {HEAD_REPO: resolution.reason, second: skipped}
    again = catalog.resolve_published_head(str(model_folder), tiny)
    assert again is not None and again.status == "missing" and again.reason == resolution.reason
    assert not (table / HEAD_REPO / "model.safetensors").exists()


#: Loads the model with eagle_head="auto" in a fresh, online process (huggingface_hub reads
#: HF_HUB_OFFLINE and HF_ENDPOINT at import) and prints the head it used and the greedy ids.
FETCHING = r"""
import json, logging, sys, torch
torch.set_num_threads(1)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
from selfspec import SpeculativeEngine
folder, prompt = sys.argv[1], json.loads(sys.argv[2])
try:
    engine = SpeculativeEngine.from_pretrained(folder, drafter="eagle", eagle_head="auto", dtype=torch.float32)
except Exception as error:
    print("RESULT " + json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    ids = engine.generate_ids(prompt, max_new_tokens=16).token_ids
    print("RESULT " + json.dumps({"source": engine.drafter.head.source, "ids": ids}))
"""


def fetch_in_a_fresh_process(
    tmp_path: Path,
    tiny: Any,
    model_folder: Path,
    heads: dict[str, dict[str, Any] | None],
    dropped: frozenset[str] = frozenset(),
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], list[str], dict[str, dict[str, bytes]]]:
    """Run :data:`FETCHING` online against a :class:`FakeHub`: the run, its result, the requests, the files served.

    ``heads``: the table's entries for the tiny model in order, repo id -> its config.json
    (``None``: listed, but not on the hub).
    """
    served = {}
    for repo_id, config in heads.items():
        if config is not None:
            folder = write_hub(tmp_path / "written", tiny, "plain", config, repo_id)
            served[repo_id] = {name: (folder / name).read_bytes() for name in ("config.json", "model.safetensors")}
            served[repo_id]["README.md"] = b"a model card (not fetched)"
    table = tmp_path / "heads.json"
    entries = [{"target": TARGET, "repo_id": repo_id} for repo_id in heads]
    table.write_text(json.dumps({"version": 1, "heads": entries}), encoding="utf-8")
    first, *others = served
    with FakeHub(first, COMMIT, served[first], dropped=dropped, more={r: served[r] for r in others}) as hub:
        env = {k: v for k, v in os.environ.items() if k != HUB_ENV}
        env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
        env.update(HF_HUB_CACHE=str(tmp_path / "hf-cache"), **{CATALOG_ENV: str(table)})
        run = subprocess.run(
            [sys.executable, "-c", FETCHING, str(model_folder), json.dumps(PROMPTS[0])],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run, json.loads(run.stdout.split("RESULT ", 1)[1]), hub.requests, served


@pytest.mark.slow
@pytest.mark.parametrize("fits", [True, False], ids=["fits", "mismatch"])
def test_online_the_head_is_fetched_config_first(tmp_path, tiny, model_folder, fits) -> None:
    config = head_config(tiny, **({} if fits else {"target_hidden_size": 64}))
    run, result, requests, served = fetch_in_a_fresh_process(tmp_path, tiny, model_folder, {HEAD_REPO: config})
    files = served[HEAD_REPO]
    weights = f"GET /{HEAD_REPO}/resolve/{COMMIT}/model.safetensors"
    assert f"GET /{HEAD_REPO}/resolve/main/config.json" in requests  # the config first
    assert not any("README.md" in r for r in requests)  # only the head's files
    if not fits:
        assert result["error"] == "HeadMismatchError" and "hidden size 64" in result["message"], result
        assert weights not in requests  # refused before its weights were asked for
        return
    snapshot = tmp_path / "hf-cache" / f"models--{HEAD_REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert Path(result["source"]) == snapshot and weights in requests
    assert result["ids"] == reference_greedy(tiny, PROMPTS[0], 16)
    size = sum(len(body) for name, body in files.items() if name != "README.md")
    assert f"fetching the published EAGLE head {HEAD_REPO} (main, unpinned) for {TARGET}: 2 file(s)" in run.stdout
    assert catalog._size(size) in run.stdout


@pytest.mark.slow
def test_a_connection_dropped_mid_weights_leaves_the_head_missing(tmp_path, tiny, model_folder) -> None:
    """The hub's connection closes halfway through the weights (huggingface_hub gives up with
    httpx's error, not an OSError): the load is not broken by it; the head is missing, the error
    names the command that fetches it, and the half-written weights are not taken for a head."""
    run, result, requests, _ = fetch_in_a_fresh_process(
        tmp_path, tiny, model_folder, {HEAD_REPO: head_config(tiny)}, dropped=frozenset({"model.safetensors"})
    )
    assert f"GET /{HEAD_REPO}/resolve/{COMMIT}/model.safetensors" in requests  # the weights were asked for
    assert result["error"] == "ConfigurationError", result  # drafter="eagle": no head, with how to get it
    assert f"fetch it with `hf download {HEAD_REPO} --include" in result["message"]
    assert "(the hub was not reached: peer closed connection" in result["message"]  # why, not "offline"
    assert "peer closed connection" in run.stdout  # the log said why as it went on without the head


@pytest.mark.slow
def test_online_a_head_that_is_gone_or_does_not_fit_gives_way_to_the_next(tmp_path, tiny, model_folder) -> None:
    """The table's first head is not on the hub, the second does not fit (refused from its config
    alone): the third is fetched and used, and each of the others is named in the log."""
    gone, unfit, fits = (f"{HEAD_REPO}-{name}" for name in ("gone", "unfit", "fits"))
    heads = {gone: None, unfit: head_config(tiny, target_hidden_size=64), fits: head_config(tiny)}
    run, result, requests, _ = fetch_in_a_fresh_process(tmp_path, tiny, model_folder, heads)
    snapshot = tmp_path / "hf-cache" / f"models--{fits.replace('/', '--')}" / "snapshots" / COMMIT
    assert Path(result.get("source", "")) == snapshot, result
    assert result["ids"] == reference_greedy(tiny, PROMPTS[0], 16)
    assert any(r.startswith(f"HEAD /{gone}/resolve/main/config.json") for r in requests)  # asked, not there
    assert f"GET /{unfit}/resolve/main/config.json" in requests  # its config only
    assert not any(f"/{unfit}/" in r and r.endswith("model.safetensors") for r in requests)
    assert f"eagle_head='auto' refuses {unfit} (main, unpinned): " in run.stdout and "hidden size 64" in run.stdout
