"""The table of published heads: well-formed entries, the extra table, names, the config check, the fetch command."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfspec.artifacts import loose_name
from selfspec.drafting.auto import Plan
from selfspec.drafting.eagle import catalog
from selfspec.drafting.eagle.catalog import (
    CATALOG_ENV,
    CATALOG_VERSION,
    HUB_ENV,
    PUBLISHED_HEADS,
    HeadMismatchError,
    PublishedHead,
    check_head_config,
    entries_for,
    model_names,
    read_catalog,
)
from selfspec.drafting.eagle.head import SHIPPED_HEADS, find_eagle_head
from selfspec.errors import ConfigurationError

#: A Llama-3.1-8B-shaped target (the facts of its config.json that the check reads).
LLAMA_8B = SimpleNamespace(
    config=SimpleNamespace(
        hidden_size=4096, vocab_size=128256, num_hidden_layers=32, _name_or_path="", architectures=["LlamaForCausalLM"]
    )
)


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch) -> None:
    """huggingface_hub's own cache is an empty folder: what this machine holds does not change a test."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))


def speculators_head(**changes: object) -> dict[str, object]:
    return {
        "speculators_model_type": "eagle3",
        "speculators_config": {"verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}},
        "transformer_layer_config": {"hidden_size": 4096, "vocab_size": 128256},
        "draft_vocab_size": 32000,
        "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
        **changes,
    }


def test_table_entries_are_well_formed() -> None:
    assert CATALOG_VERSION == 1 and PUBLISHED_HEADS
    for entry in PUBLISHED_HEADS:
        assert entry.problems() == [], entry
        assert entry.source, entry  # every pairing says where it is documented
        assert entry.pinned == (entry.revision is not None)
        assert entry.label.startswith(entry.repo_id)
    pairs = [(e.target, e.repo_id) for e in PUBLISHED_HEADS]
    assert len(pairs) == len(set(pairs))
    assert not any(loose_name(e.target) == "smollm2-135m-instruct" for e in PUBLISHED_HEADS)


def test_malformed_entries_are_named() -> None:
    bad = PublishedHead("not a hub id", "RedHatAI/x", revision="main", layout="medusa")
    problems = " ".join(bad.problems())
    assert "target 'not a hub id'" in problems and "revision 'main'" in problems and "layout 'medusa'" in problems
    with pytest.raises(ConfigurationError, match="target and repo_id"):
        PublishedHead.from_json({"repo_id": "a/b"}, "here")
    with pytest.raises(ConfigurationError, match="revision"):
        PublishedHead.from_json({"target": "a/b", "repo_id": "c/d", "revision": "abc"}, "here")


def test_the_extra_table_comes_first_and_is_checked(tmp_path, monkeypatch) -> None:
    path = tmp_path / "heads.json"
    commit = "a" * 40
    path.write_text(json.dumps({"version": 1, "heads": [{"target": "me/my-model", "repo_id": "me/head",
                                                          "revision": commit}]}), encoding="utf-8")  # fmt: skip
    monkeypatch.setenv(CATALOG_ENV, str(path))
    entries = catalog.catalog_entries()
    assert entries[0] == PublishedHead("me/my-model", "me/head", revision=commit)
    assert entries[1:] == list(PUBLISHED_HEADS)
    assert entries_for("/models/my-model") == [entries[0]]
    path.write_text(json.dumps({"version": 2, "heads": []}), encoding="utf-8")
    with pytest.raises(ConfigurationError, match="version"):
        read_catalog(path)
    path.write_text("{", encoding="utf-8")
    with pytest.raises(ConfigurationError, match="not readable JSON"):
        catalog.catalog_entries()


def test_model_names_and_matching() -> None:
    snapshot = "/cache/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/" + "b" * 40
    assert "llama-3.1-8b-instruct" in model_names(snapshot)
    assert [e.repo_id for e in entries_for("meta-llama/Llama-3.1-8B-Instruct")] == [
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
    ]
    assert entries_for(snapshot) == entries_for("meta-llama/Llama-3.1-8B-Instruct")
    assert entries_for("meta-llama/Llama-3.1-8B-Instruct-abliterated") == []  # names match whole, not in part
    assert entries_for("HuggingFaceTB/SmolLM2-135M-Instruct") == []


def test_the_shipped_head_is_found_unchanged_when_no_published_head_matches() -> None:
    found = find_eagle_head("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert found is not None and found.parent == SHIPPED_HEADS


def test_check_head_config_names_the_field_and_both_values() -> None:
    name = "meta-llama/Llama-3.1-8B-Instruct"
    check_head_config(speculators_head(), LLAMA_8B, "h", name)  # fits
    listed = {"verifier": {"name_or_path": name, "architectures": ["LlamaForCausalLM"]}}
    check_head_config(speculators_head(speculators_config=listed), LLAMA_8B, "h", name)  # its verifier's class: fits
    no_classes = SimpleNamespace(config=SimpleNamespace(**{**vars(LLAMA_8B.config), "architectures": None}))
    check_head_config(speculators_head(speculators_config=listed), no_classes, "h", name)  # the model names none
    qwen_class = {"verifier": {"name_or_path": name, "architectures": ["Qwen3ForCausalLM"]}}
    safeailab = {"hidden_size": 4096, "vocab_size": 128256, "draft_vocab_size": 32000}
    check_head_config(safeailab, LLAMA_8B, "h", name)  # no verifier named: the table's pairing stands
    cases = {
        "verifier": (speculators_head(speculators_config={"verifier": {"name_or_path": "Qwen/Qwen3-8B"}}),
                     "Qwen/Qwen3-8B", name),
        "verifier architectures": (speculators_head(speculators_config=qwen_class),
                                   ["Qwen3ForCausalLM"], ["LlamaForCausalLM"]),
        "hidden size": (speculators_head(target_hidden_size=5120), 5120, 4096),
        "vocabulary": ({**safeailab, "vocab_size": 151936}, 151936, 128256),
        "tapped layers": (speculators_head(eagle_aux_hidden_state_layer_ids=[2, 16, 40]), [2, 16, 40], "layers 0..32"),
        "draft vocabulary": (speculators_head(draft_vocab_size=200000), 200000, "at most 128256"),
    }  # fmt: skip
    for field, (config, head_value, model_value) in cases.items():
        with pytest.raises(HeadMismatchError) as refused:
            check_head_config(config, LLAMA_8B, "RedHatAI/h", name)
        assert (refused.value.field, refused.value.head_value, refused.value.model_value) == (
            field,
            head_value,
            model_value,
        )
        assert "RedHatAI/h" in str(refused.value) and repr(head_value) in str(refused.value)


def test_fetch_command_and_advice(tmp_path, monkeypatch) -> None:
    entry = PUBLISHED_HEADS[0]
    assert entry.fetch_command() == f"hf download {entry.repo_id} --include '*.json' --include '*.safetensors'"
    pinned = PublishedHead("a/b", "c/d", revision="c" * 40)
    assert pinned.fetch_command(Path("/hub")) == (
        f"hf download c/d --revision {'c' * 40} --include '*.json' --include '*.safetensors' --local-dir /hub/c/d"
    )
    monkeypatch.setenv(HUB_ENV, str(tmp_path))  # an empty local hub; offline (conftest): nothing here
    advice = Plan(method="prompt_lookup").advice("meta-llama/Llama-3.1-8B-Instruct", has_head=False)
    assert entry.repo_id in advice and entry.fetch_command(tmp_path) in advice
    assert Plan(method="early_exit").advice("meta-llama/Llama-3.1-8B-Instruct", has_head=False) == advice
    assert Plan(method="prompt_lookup").advice("meta-llama/Llama-3.1-8B-Instruct", has_head=True) == ""
    assert "train-eagle" in Plan(method="prompt_lookup").advice("HuggingFaceTB/SmolLM2-135M-Instruct", has_head=False)
    assert catalog._size(1_520_000_000) == "1.52 GB" and catalog._size(999) == "999 B"


def test_with_no_copy_the_resolution_is_missing_and_names_the_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(HUB_ENV, str(tmp_path))  # an empty local hub
    name = "meta-llama/Llama-3.1-8B-Instruct"
    missing = catalog.resolve_published_head(name, LLAMA_8B)  # offline (conftest)
    assert missing is not None and missing.status == "missing" and not missing.usable
    assert missing.entry == PUBLISHED_HEADS[0] and missing.reason == "offline: no local copy"
    assert missing.fetch_command == PUBLISHED_HEADS[0].fetch_command(tmp_path)
    monkeypatch.setattr(catalog, "hub_offline", lambda: False)  # online, but fetching is turned off
    monkeypatch.setenv(catalog.FETCH_ENV, "0")
    off = catalog.resolve_published_head(name, LLAMA_8B)
    assert off is not None and off.status == "missing" and "SELFSPEC_HEAD_FETCH=0" in off.reason
    monkeypatch.delenv(catalog.FETCH_ENV)
    unasked = catalog.resolve_published_head(name, LLAMA_8B, fetch=False)  # online, the hub not asked: not "offline"
    assert unasked is not None and unasked.status == "missing" and unasked.reason == "no local copy"
    assert catalog.resolve_published_head("HuggingFaceTB/SmolLM2-135M-Instruct", LLAMA_8B) is None


def test_the_eagle_heads_command_lists_the_table_and_what_is_here(tmp_path, monkeypatch, capsys) -> None:
    from selfspec.cli.main import main

    hub = tmp_path / "hub"
    held, partial = (
        hub / repo for repo in ("RedHatAI/Qwen3-8B-speculator.eagle3", "RedHatAI/Qwen3-14B-speculator.eagle3")
    )
    for folder in (held, partial):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(speculators_head()), encoding="utf-8")
    (held / "model.safetensors").write_bytes(b"weights")  # partial holds its config only: an interrupted fetch
    monkeypatch.setenv(HUB_ENV, str(hub))
    assert main(["eagle-heads"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"published EAGLE heads (table version {CATALOG_VERSION}; local hub {hub} (SELFSPEC_HEAD_HUB)):"
    assert all(lines.count(entry.target) == 1 for entry in PUBLISHED_HEADS)  # each target once, on its own line
    by_head = {line.split(" layout: ")[0].rsplit(", ", 1)[0].strip(): line for line in lines if line.startswith("  ")}
    assert set(by_head) == {entry.label for entry in PUBLISHED_HEADS}
    for entry in PUBLISHED_HEADS:
        where = f"here: {held}" if entry.repo_id == "RedHatAI/Qwen3-8B-speculator.eagle3" else "not here"
        assert f"{entry.layout} layout: {where}" in by_head[entry.label]
        if where == "not here":
            assert by_head[entry.label].endswith(f"fetch: {entry.fetch_command(hub)}")
    assert main(["eagle-heads", "--model", "Qwen/Qwen3-8B"]) == 0
    qwen3_8b = [entry for entry in PUBLISHED_HEADS if entry.target == "Qwen/Qwen3-8B"]
    assert capsys.readouterr().out.splitlines()[1:] == [
        "Qwen/Qwen3-8B",
        *(by_head[entry.label] for entry in qwen3_8b),  # only its heads, as in the whole table
    ]
    assert main(["eagle-heads", "-m", "HuggingFaceTB/SmolLM2-135M-Instruct"]) == 1
    assert (
        "no published EAGLE head in selfspec's table for HuggingFaceTB/SmolLM2-135M-Instruct" in capsys.readouterr().out
    )
