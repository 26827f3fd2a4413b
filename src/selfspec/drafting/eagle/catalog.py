"""Heads that find themselves: a versioned table of published EAGLE-3 heads for known targets.

``eagle_head="auto"`` (and ``drafter="auto"``, which measures the head ``"auto"`` finds) looks,
after the user's own heads and before the heads selfspec ships, for a published head of the
loaded model in :data:`PUBLISHED_HEADS`: each entry names the target (the verifier's hub id),
the head's hub repository and, where one is known, the commit it is pinned to. A head is used
only after its ``config.json`` has been checked against the loaded model
(:func:`check_head_config`: the verifier it names, the hidden size, the vocabulary, the tapped
layers); a head that does not fit is refused with a :class:`HeadMismatchError` that names the
field and both values. The weights are then read by
:func:`~selfspec.drafting.eagle.published.load_published_head` (SafeAILab / SpecForge EAGLE-3
and vLLM's ``speculators`` layouts), which checks every name and shape again.

Where the head is looked for (:func:`local_copy`):

1. the folder named by ``SELFSPEC_HEAD_HUB``, laid out as ``<root>/<owner>/<name>/`` or as a
   huggingface_hub cache (``<root>/models--<owner>--<name>/snapshots/<commit>/``): a local
   folder that serves as the hub (tests, air-gapped machines);
2. huggingface_hub's own cache (``HF_HUB_CACHE``), read offline;
3. the hub itself, when huggingface_hub is not offline (``HF_HUB_OFFLINE``) and
   ``SELFSPEC_HEAD_FETCH`` is not ``0``: the head's
   ``config.json`` is fetched and checked first, then a size line is logged and the weights are
   fetched with huggingface_hub's progress bar (:func:`fetch_head`).

Where the table has several heads for a model, they are tried in table order: local copies
first, then fetches; a head that does not fit, is gone from the hub or fails to download gives
way to the next, and once the hub cannot be reached no other is asked for.
Offline, or when the hub cannot be reached, nothing is fetched: decoding goes on without the
head, and the plan's advice (:func:`missing_head_advice`) names the head and the exact command
that fetches it (``hf download ...``). ``SELFSPEC_HEAD_CATALOG`` names a JSON file of further
entries (``{"version": 1, "heads": [{"target": ..., "repo_id": ..., ...}]}``), consulted first.

Sources of the table: the speculators README's table of pre-trained EAGLE-3 models (RedHatAI
heads and their verifiers), vLLM's speculators tests (RedHatAI Llama-3.1-8B / Qwen3-8B heads and
their verifiers) and its EAGLE tests (AngelSlim/Qwen3-8B_eagle3 for Qwen/Qwen3-8B), SafeAILab/EAGLE's
list of heads (yuhuili/EAGLE3-*), SGLang's EAGLE-3 scripts (lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B),
code that pairs AngelSlim/Qwen3-*_eagle3 with Qwen/Qwen3-*; research notes in the project's HEADS.md. No entry
is pinned to a commit yet (none was at hand): an unpinned entry resolves the repository's
``main`` and says so.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...artifacts import loose_name
from ...errors import ConfigurationError, ModelNotFoundError, UnsafeCheckpointError

logger = logging.getLogger(__name__)

#: The version of the table's layout (the fields of :class:`PublishedHead`).
CATALOG_VERSION = 1
#: A folder that serves as the hub (``<root>/<owner>/<name>/`` or a huggingface_hub cache layout).
HUB_ENV = "SELFSPEC_HEAD_HUB"
#: A JSON file of further table entries, consulted before :data:`PUBLISHED_HEADS`.
CATALOG_ENV = "SELFSPEC_HEAD_CATALOG"
#: ``0`` / ``false``: never fetch a head from the hub (local copies are still found and checked).
FETCH_ENV = "SELFSPEC_HEAD_FETCH"
#: The files of a head that are fetched (config and safetensors weights; never pickle).
HEAD_FILES = ("*.json", "*.safetensors")
#: The head layouts selfspec reads (:func:`~selfspec.drafting.eagle.published.load_published_head`).
LAYOUTS = ("speculators", "safeailab")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class PublishedHead:
    """One entry of the table: a published EAGLE-3 head for one target.

    Attributes:
        target: the hub id of the model the head drafts for (its verifier).
        repo_id: the head's hub repository.
        revision: the commit (40 hex digits) the entry is pinned to, or ``None``: unpinned (``main``).
        layout: the layout the head is published in (``"speculators"`` or ``"safeailab"``).
        source: where the pairing of head and target is documented.
    """

    target: str
    repo_id: str
    revision: str | None = None
    layout: str = "speculators"
    source: str = ""

    @property
    def pinned(self) -> bool:
        """Whether the entry names the exact commit it was checked at."""
        return self.revision is not None

    @property
    def label(self) -> str:
        """``repo@commit`` (pinned) or ``repo (main, unpinned)``."""
        return f"{self.repo_id}@{self.revision}" if self.revision else f"{self.repo_id} (main, unpinned)"

    def fetch_command(self, hub: Path | None = None) -> str:
        """The shell command that fetches the head where :func:`local_copy` finds it."""
        parts = ["hf", "download", self.repo_id]
        if self.revision:
            parts += ["--revision", self.revision]
        for pattern in HEAD_FILES:
            parts += ["--include", f"'{pattern}'"]
        if hub is not None:
            parts += ["--local-dir", str(hub / self.repo_id)]
        return " ".join(parts)

    def problems(self) -> list[str]:
        """What is malformed in the entry (empty: well-formed)."""
        found = []
        for name in ("target", "repo_id"):
            if not isinstance(getattr(self, name), str) or not _REPO_ID.match(getattr(self, name)):
                found.append(f"{name} {getattr(self, name)!r} is not a hub id (owner/name)")
        if self.revision is not None and (not isinstance(self.revision, str) or not _COMMIT.match(self.revision)):
            found.append(f"revision {self.revision!r} is not a 40-hex commit (None: unpinned)")
        if self.layout not in LAYOUTS:
            found.append(f"layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")
        return found

    @classmethod
    def from_json(cls, data: Any, where: str) -> PublishedHead:
        """An entry from its JSON form (the dataclass's fields), checked.

        Raises:
            ConfigurationError: unknown or missing fields, or a malformed value.
        """
        fields = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or not {"target", "repo_id"} <= set(data) or set(data) - fields:
            raise ConfigurationError(
                f"{where}: a head entry must be an object with target and repo_id (and optionally "
                f"{', '.join(sorted(fields - {'target', 'repo_id'}))}), got {data!r}"
            )
        entry = cls(**data)
        problems = entry.problems()
        if problems:
            raise ConfigurationError(f"{where}: {'; '.join(problems)}")
        return entry


#: The table (version :data:`CATALOG_VERSION`). Revisions: ``None`` everywhere (unpinned), since no
#: commit of these repositories was at hand; pin one by giving its 40-hex commit.
PUBLISHED_HEADS: tuple[PublishedHead, ...] = (
    PublishedHead(
        "meta-llama/Llama-3.1-8B-Instruct",
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
        source="speculators README (pre-trained EAGLE-3 models); vLLM tests/speculators",
    ),
    PublishedHead(
        "meta-llama/Llama-3.1-8B-Instruct",
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        layout="safeailab",
        source="SafeAILab/EAGLE README; vLLM and SGLang EAGLE-3 docs",
    ),
    PublishedHead(
        "meta-llama/Llama-3.1-8B-Instruct",
        "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
        layout="safeailab",
        source="SGLang's EAGLE-3 benchmark scripts and docs (its draft for Llama-3.1-8B-Instruct); SpecForge layout",
    ),
    PublishedHead(
        "meta-llama/Llama-3.3-70B-Instruct",
        "RedHatAI/Llama-3.3-70B-Instruct-speculator.eagle3",
        source="speculators README (pre-trained EAGLE-3 models)",
    ),
    PublishedHead(
        "meta-llama/Llama-3.3-70B-Instruct",
        "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
        layout="safeailab",
        source="SafeAILab/EAGLE README",
    ),
    PublishedHead(
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",
        layout="safeailab",
        source="SafeAILab/EAGLE README",
    ),
    PublishedHead(
        "Qwen/Qwen3-8B",
        "RedHatAI/Qwen3-8B-speculator.eagle3",
        source="speculators README; vLLM tests/speculators",
    ),
    PublishedHead(
        "Qwen/Qwen3-8B",
        "AngelSlim/Qwen3-8B_eagle3",
        layout="safeailab",
        source="vLLM tests/v1/e2e/test_spec_decode.py (eagle3, Qwen/Qwen3-8B); AngelSlim docs (EAGLE-3 benchmarks)",
    ),
    PublishedHead("Qwen/Qwen3-14B", "RedHatAI/Qwen3-14B-speculator.eagle3", source="speculators README"),
    PublishedHead(
        "Qwen/Qwen3-14B",
        "AngelSlim/Qwen3-14B_eagle3",
        layout="safeailab",
        source="AngelSlim docs (EAGLE-3 benchmarks); layout as SafeAILab's (not confirmed)",
    ),
    PublishedHead("Qwen/Qwen3-32B", "RedHatAI/Qwen3-32B-speculator.eagle3", source="speculators README; model card"),
    PublishedHead(
        "Qwen/Qwen3-1.7B",
        "AngelSlim/Qwen3-1.7B_eagle3",
        layout="safeailab",
        source="AngelSlim docs (EAGLE-3 benchmarks); layout as SafeAILab's (not confirmed)",
    ),
    PublishedHead(
        "Qwen/Qwen3-4B",
        "AngelSlim/Qwen3-4B_eagle3",
        layout="safeailab",
        source="AngelSlim docs (EAGLE-3 benchmarks); layout as SafeAILab's (not confirmed)",
    ),
)


class HeadMismatchError(ConfigurationError):
    """A published head does not fit the loaded model (one field, the head's and the model's value).

    Attributes:
        head: the head (its repository, or its folder).
        field: what differs (``"verifier"``, ``"hidden size"``, ``"vocabulary"``, ``"tapped layers"``, ...).
        head_value: the value the head's ``config.json`` gives.
        model_value: the loaded model's value.
    """

    def __init__(self, head: str, field: str, head_value: Any, model_value: Any) -> None:
        self.head, self.field, self.head_value, self.model_value = head, field, head_value, model_value
        super().__init__(
            f"the published EAGLE head {head} does not fit this model: {field} {head_value!r} in the head's "
            f"config.json vs {model_value!r} for the loaded model. Use a head trained for this model, or train "
            "one with `selfspec train-eagle --model M`."
        )


@dataclass
class HeadResolution:
    """What ``eagle_head="auto"`` found in the table for a model.

    Attributes:
        entry: the table entry.
        status: ``"found"`` (a local copy, checked), ``"fetched"`` (fetched now, checked),
            ``"missing"`` (no local copy, and the hub was not reached) or ``"refused"``.
        folder: the head's folder (``found`` / ``fetched``; for ``refused``, the copy that was refused).
        reason: why it is missing or refused (empty otherwise).
        error: the refusal (a :class:`HeadMismatchError`, or the loader's error for unreadable weights).
        hub: the local hub folder (``SELFSPEC_HEAD_HUB``), when one is set.
    """

    entry: PublishedHead
    status: str
    folder: Path | None = None
    reason: str = ""
    error: Exception | None = None
    hub: Path | None = None

    @property
    def usable(self) -> bool:
        """Whether :attr:`folder` is a checked head to load."""
        return self.status in ("found", "fetched") and self.folder is not None

    @property
    def fetch_command(self) -> str:
        """The command that fetches the head where the resolver finds it."""
        return self.entry.fetch_command(self.hub)


# ----------------------------------------------------------------------------- the table
def catalog_entries() -> list[PublishedHead]:
    """The entries of ``SELFSPEC_HEAD_CATALOG`` (when set), then :data:`PUBLISHED_HEADS`.

    Raises:
        ConfigurationError: the extra table is unreadable or malformed.
    """
    extra = os.environ.get(CATALOG_ENV)
    return [*read_catalog(Path(extra).expanduser()), *PUBLISHED_HEADS] if extra else list(PUBLISHED_HEADS)


def read_catalog(path: Path) -> list[PublishedHead]:
    """The entries of a table file (``{"version": 1, "heads": [...]}``).

    Raises:
        ConfigurationError: the file is unreadable, of another version, or an entry is malformed.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"the head table {path} ({CATALOG_ENV}) is not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("version") != CATALOG_VERSION or not isinstance(data.get("heads"), list):
        raise ConfigurationError(
            f'the head table {path} ({CATALOG_ENV}) must be {{"version": {CATALOG_VERSION}, "heads": [...]}}'
        )
    return [PublishedHead.from_json(item, f"{path} heads[{i}]") for i, item in enumerate(data["heads"])]


def model_names(name_or_path: str, model: Any = None) -> set[str]:
    """The loose names (:func:`~selfspec.artifacts.loose_name`) a loaded model goes by.

    Its name or folder, the repository of a huggingface_hub snapshot folder
    (``models--owner--name/snapshots/<commit>``), and its config's ``_name_or_path``.
    """
    candidates = [name_or_path, str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")]
    names = set()
    for candidate in filter(None, candidates):
        names.add(loose_name(candidate))
        snapshot = re.search(r"models--[^/\\]+--([^/\\]+)[/\\]snapshots", candidate)
        if snapshot:
            names.add(snapshot.group(1).lower())
    return names - {""}


def entries_for(name_or_path: str, model: Any = None) -> list[PublishedHead]:
    """The table's entries whose target is the model (its loose names, :func:`model_names`)."""
    names = model_names(name_or_path, model)
    if not names:
        return []
    return [entry for entry in catalog_entries() if loose_name(entry.target) in names]


# ----------------------------------------------------------------------------- where a head is
def hub_folder() -> Path | None:
    """The local hub folder (``SELFSPEC_HEAD_HUB``), when set."""
    root = os.environ.get(HUB_ENV)
    return Path(root).expanduser() if root else None


def hub_offline() -> bool:
    """Whether huggingface_hub is offline (``HF_HUB_OFFLINE``, read now and at its import)."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return flag or bool(constants.HF_HUB_OFFLINE)


def _cached_snapshot(entry: PublishedHead, cache_dir: Path | None) -> Path | None:
    """The head's snapshot in a huggingface_hub cache (read offline), if it holds a ``config.json``."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            entry.repo_id,
            revision=entry.revision,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            local_files_only=True,
            allow_patterns=list(HEAD_FILES),
        )
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError is an OSError), or a bad id
        return None
    path = Path(str(folder))
    return path if (path / "config.json").is_file() else None


def _holds_head(folder: Path) -> bool:
    """A ``config.json`` and weights (a config alone, from an interrupted fetch, is not a copy)."""
    weights = ("*.safetensors", "model.safetensors.index.json", "*.bin")
    return (folder / "config.json").is_file() and any(any(folder.glob(pattern)) for pattern in weights)


def local_copy(entry: PublishedHead, hub: Path | None = None) -> Path | None:
    """The head's folder here (with a ``config.json``): in the local hub, else huggingface_hub's cache.

    The local hub is read in either layout; the plain one (``<hub>/<owner>/<name>/``) holds one
    version, whatever the entry's revision. The weights may be absent (an interrupted fetch).
    """
    if hub is not None:
        plain = hub / entry.repo_id
        if (plain / "config.json").is_file():
            return plain
        cached = _cached_snapshot(entry, hub)
        if cached is not None:
            return cached
    return _cached_snapshot(entry, None)


def held_copy(entry: PublishedHead, hub: Path | None = None) -> Path | None:
    """:func:`local_copy` when it holds the weights too (not yet checked against a model), else ``None``."""
    folder = local_copy(entry, hub)
    return folder if folder is not None and _holds_head(folder) else None


# ----------------------------------------------------------------------------- the check
def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigurationError(f"{path} does not hold a JSON object")
    return data


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _head_facts(raw: dict[str, Any]) -> dict[str, Any]:
    """What a head's ``config.json`` says about its target, in either layout (``None``: not said)."""
    if "speculators_model_type" in raw:
        layer = _object(raw.get("transformer_layer_config"))
        verifier = _object(_object(raw.get("speculators_config")).get("verifier"))
        return {
            "verifier": verifier.get("name_or_path"),
            "verifier architectures": verifier.get("architectures"),
            "hidden size": raw.get("target_hidden_size") or layer.get("hidden_size"),
            "vocabulary": layer.get("vocab_size"),
            "tapped layers": raw.get("eagle_aux_hidden_state_layer_ids"),
            "draft vocabulary": raw.get("draft_vocab_size"),
        }
    nested = _object(raw.get("eagle_config"))
    return {
        "verifier": None,  # SafeAILab / SpecForge configs name no verifier: the table's entry does
        "verifier architectures": None,
        "hidden size": raw.get("target_hidden_size") or raw.get("hidden_size"),
        "vocabulary": raw.get("vocab_size"),
        "tapped layers": raw.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids"),
        "draft vocabulary": raw.get("draft_vocab_size"),
    }


def check_head_config(raw: dict[str, Any], model: Any, head: str, name_or_path: str = "") -> None:
    """Check a published head's ``config.json`` against the loaded model, before any weight is read.

    Checks the verifier the head names (against the model's names, :func:`model_names`) and its
    architectures (``speculators_config.verifier.architectures``: one of them must be the model's),
    the target hidden size, the vocabulary, the tapped layers (each in ``0..L``) and the draft
    vocabulary (at most the model's).

    Args:
        raw: the head's ``config.json``.
        model: the loaded target (a transformers causal LM or its runner: ``model.config`` is read).
        head: the head's name for messages (its repository or folder).
        name_or_path: the model's name or folder.

    Raises:
        HeadMismatchError: the first field that does not fit, with both values.
    """
    config = model.config
    facts = _head_facts(raw)
    names = model_names(name_or_path, model)
    verifier = facts["verifier"]
    if verifier and names and loose_name(str(verifier)) not in names:
        raise HeadMismatchError(head, "verifier", str(verifier), name_or_path or sorted(names)[0])
    head_classes, model_classes = facts["verifier architectures"], list(getattr(config, "architectures", None) or [])
    if isinstance(head_classes, list) and head_classes and model_classes and not set(head_classes) & set(model_classes):
        raise HeadMismatchError(head, "verifier architectures", head_classes, model_classes)
    hidden, vocab, layers = int(config.hidden_size), int(config.vocab_size), int(config.num_hidden_layers)
    for field, theirs in (("hidden size", hidden), ("vocabulary", vocab)):
        if facts[field] is not None and int(facts[field]) != theirs:
            raise HeadMismatchError(head, field, int(facts[field]), theirs)
    tapped = facts["tapped layers"]  # absent: EAGLE-3's default [2, L // 2, L - 3], within any model's
    if tapped is not None and (
        not isinstance(tapped, list) or not tapped or not all(isinstance(i, int) and 0 <= i <= layers for i in tapped)
    ):
        raise HeadMismatchError(head, "tapped layers", tapped, f"layers 0..{layers}")
    draft = facts["draft vocabulary"]
    if draft is not None and not 0 < int(draft) <= vocab:
        raise HeadMismatchError(head, "draft vocabulary", int(draft), f"at most {vocab}")


def check_head_folder(folder: Path, model: Any, head: str, name_or_path: str = "") -> None:
    """:func:`check_head_config` on a folder's ``config.json``, and its weights are safetensors.

    Raises:
        HeadMismatchError: the head does not fit the model.
        UnsafeCheckpointError: the folder holds pickle weights only.
        ModelNotFoundError: no weights in the folder.
        ConfigurationError: the config is unreadable.
    """
    from .files import _weight_files

    check_head_config(_read_json(folder / "config.json"), model, head, name_or_path)
    _weight_files(folder)


# ----------------------------------------------------------------------------- fetching
def _size(num_bytes: int) -> str:
    """``1536`` -> ``"1.5 kB"``; decimal units, as the hub shows sizes."""
    size = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1000
    return f"{size:.2f} GB"


def fetch_head(entry: PublishedHead, model: Any, name_or_path: str, hub: Path | None = None) -> Path:
    """Fetch a head from the hub: its ``config.json`` first (checked), then a size line and the weights.

    The weights come with huggingface_hub's progress bar; they go into huggingface_hub's cache, or
    into ``<hub>/<repo_id>/`` when a local hub folder is set.

    Raises:
        HeadMismatchError: the head's config does not fit the model (nothing more is fetched).
        UnsafeCheckpointError: the repository has no safetensors weights.
        OSError: the hub could not be reached (huggingface_hub's errors are ``OSError``s).
    """
    from huggingface_hub import hf_hub_download, snapshot_download

    target: dict[str, Any] = {"local_dir": str(hub / entry.repo_id)} if hub is not None else {}
    config = hf_hub_download(entry.repo_id, "config.json", revision=entry.revision, **target)
    check_head_config(_read_json(Path(str(config))), model, entry.repo_id, name_or_path)
    planned = snapshot_download(
        entry.repo_id, revision=entry.revision, allow_patterns=list(HEAD_FILES), dry_run=True, **target
    )
    files = [info for info in planned if not isinstance(info, str)]
    if not any(info.filename.endswith(".safetensors") for info in files):
        raise UnsafeCheckpointError(
            f"the published EAGLE head {entry.label} has no safetensors weights; selfspec loads safetensors only"
        )
    pending = [info for info in files if info.will_download]
    logger.warning(
        "fetching the published EAGLE head %s for %s: %d file(s), %s (%s to download) into %s",
        entry.label, entry.target, len(files), _size(sum(info.file_size or 0 for info in files)),
        _size(sum(info.file_size or 0 for info in pending)),
        hub / entry.repo_id if hub is not None else "the huggingface_hub cache",
    )  # fmt: skip
    folder = snapshot_download(entry.repo_id, revision=entry.revision, allow_patterns=list(HEAD_FILES), **target)
    return Path(str(folder))


# ----------------------------------------------------------------------------- resolving
#: Heads whose fetch failed in this process (repository -> why): not asked again until restart.
_UNREACHABLE: dict[str, str] = {}


def connection_errors() -> tuple[type[Exception], ...]:
    """What a fetch raises when the hub itself cannot be reached, or the connection fails partway.

    huggingface_hub's own (offline mode, a connection error or timeout, and ``LocalEntryNotFoundError``:
    a file it could not get from the hub, after its retries, with no cached copy) and the
    ``RequestError`` of its HTTP client (``httpx2`` from 2.0, ``httpx`` in 1.x): a connection that
    drops or stalls in the middle of a file, which is not an ``OSError``. After one of these no
    other head is asked for: the hub is the same. Any other failure (a repository that is gone or
    gated, a storage backend's error) concerns one head only.
    """
    from huggingface_hub.errors import LocalEntryNotFoundError

    errors: list[type[Exception]] = [ConnectionError, TimeoutError, LocalEntryNotFoundError]
    for client in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(client).RequestError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def _checked(
    entry: PublishedHead, folder: Path, model: Any, name_or_path: str, status: str, hub: Path | None
) -> HeadResolution:
    """A resolution of a local folder: ``status`` when it fits the model, else ``"refused"`` with why."""
    if not _holds_head(folder):  # its config alone (an interrupted fetch): checked, then fetched again
        try:
            check_head_config(_read_json(folder / "config.json"), model, entry.label, name_or_path)
        except ConfigurationError as error:
            return HeadResolution(entry, "refused", folder, str(error), error, hub)
        return HeadResolution(entry, "missing", folder, reason="its config is here, its weights are not", hub=hub)
    try:
        check_head_folder(folder, model, entry.label, name_or_path)
    except (ConfigurationError, UnsafeCheckpointError, ModelNotFoundError) as error:
        return HeadResolution(entry, "refused", folder, str(error), error, hub)
    return HeadResolution(entry, status, folder, hub=hub)


def _fetch_blocked(fetch: bool) -> str:
    """Why the hub may not be asked now (empty: it may)."""
    if hub_offline():
        return "offline: no local copy"
    if os.environ.get(FETCH_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return f"no local copy, and {FETCH_ENV}={os.environ[FETCH_ENV]}"
    return "" if fetch else "no local copy"


def _fetched(entry: PublishedHead, model: Any, name_or_path: str, hub: Path | None) -> tuple[HeadResolution, bool]:
    """Fetch one entry (:func:`fetch_head`): its resolution, and whether the hub could be reached at all."""
    try:
        folder = fetch_head(entry, model, name_or_path, hub)
    except (HeadMismatchError, UnsafeCheckpointError) as error:
        return HeadResolution(entry, "refused", None, str(error), error, hub), True
    except connection_errors() as error:  # no network, or it dropped: go on without the head
        _UNREACHABLE[entry.repo_id] = f"the hub was not reached: {error}"
        return HeadResolution(entry, "missing", reason=_UNREACHABLE[entry.repo_id], hub=hub), False
    except Exception as error:  # noqa: BLE001 - gone, gated, a storage backend's error: this head only
        _UNREACHABLE[entry.repo_id] = f"the fetch failed ({type(error).__name__}: {error})"
        return HeadResolution(entry, "missing", reason=_UNREACHABLE[entry.repo_id], hub=hub), True
    return _checked(entry, folder, model, name_or_path, "fetched", hub), True


def resolve_published_head(name_or_path: str, model: Any, *, fetch: bool = True) -> HeadResolution | None:
    """The published head for a model: a checked local copy, else (online, ``fetch``) a fetched one.

    Looks at every matching entry's local copy first (:func:`local_copy`), in table order; when
    none fits, fetches the other entries in table order (:func:`fetch_head`) until one fits,
    unless huggingface_hub is offline or ``fetch`` is false. An entry that is refused (it does
    not fit the model) or cannot be fetched gives way to the next; when the hub cannot be reached
    at all, no further entry is asked for. Each refusal is logged once.

    Args:
        name_or_path: the model's name or folder.
        model: the loaded target (its config is checked).
        fetch: whether the hub may be asked.

    Returns:
        ``None`` when the table has no head for the model; else the head found or fetched, or,
        when none fits: the first entry that could still be fetched (``"missing"``, with why and
        the command that fetches it), else the first refusal.
    """
    entries = entries_for(name_or_path, model)
    if not entries:
        return None
    hub = hub_folder()
    refusals: list[HeadResolution] = []
    candidates: list[PublishedHead] = []  # entries with no fitting local copy that were not refused
    for entry in entries:
        folder = local_copy(entry, hub)
        resolution = _checked(entry, folder, model, name_or_path, "found", hub) if folder is not None else None
        if resolution is not None and resolution.usable:
            return resolution
        if resolution is not None and resolution.status == "refused":
            refusals.append(resolution)
            _say_once(resolution, name_or_path)
        else:
            candidates.append(entry)
    missing: list[HeadResolution] = []
    blocked, down = _fetch_blocked(fetch), ""
    for entry in candidates:
        if down:  # the hub was not reached for an earlier entry: not asked again in this process
            _UNREACHABLE[entry.repo_id] = down
        if entry.repo_id in _UNREACHABLE or blocked:  # asked once already (why it failed), or not to be asked
            missing.append(HeadResolution(entry, "missing", reason=_UNREACHABLE.get(entry.repo_id, blocked), hub=hub))
            continue
        resolution, reached = _fetched(entry, model, name_or_path, hub)
        if resolution.usable:
            return resolution
        if resolution.status == "refused":
            refusals.append(resolution)
            _say_once(resolution, name_or_path)
        else:
            missing.append(resolution)
        down = "" if reached else f"{resolution.reason} (asking for {entry.repo_id})"
    return missing[0] if missing else refusals[0]


_SAID: set[tuple[str, str, str]] = set()


def _say_once(resolution: HeadResolution, name_or_path: str) -> None:
    key = (resolution.entry.repo_id, resolution.status, name_or_path)
    if key in _SAID:
        return
    _SAID.add(key)
    if resolution.status == "missing":
        logger.warning(
            "the published EAGLE head %s for %s is not on this machine (%s); decoding goes on without it. "
            "Fetch it with: %s",
            resolution.entry.label, resolution.entry.target, resolution.reason, resolution.fetch_command,
        )  # fmt: skip
    elif resolution.status == "refused":
        logger.warning("eagle_head='auto' refuses %s: %s", resolution.entry.label, resolution.reason)


def find_published_head(name_or_path: str, model: Any) -> Path | None:
    """The folder of a checked published head for the model (:func:`resolve_published_head`), else ``None``.

    What :func:`~selfspec.drafting.eagle.head.find_eagle_head` asks after the user's own heads;
    a missing or refused head is logged once (with the command that fetches it) and ``None`` is
    returned, so decoding goes on without it.
    """
    if model is None or not name_or_path:
        return None
    resolution = resolve_published_head(name_or_path, model)
    if resolution is None:
        return None
    if resolution.usable:
        return resolution.folder
    _say_once(resolution, name_or_path)
    return None


def explain_missing_head(name_or_path: str, model: Any) -> str:
    """For ``drafter="eagle"`` with no head found: raise the refusal, or say how to fetch the head.

    Raises:
        HeadMismatchError: the table's head for this model was refused (the field and both values).
        ConfigurationError / UnsafeCheckpointError / ModelNotFoundError: its local copy is unreadable.

    Returns:
        One sentence naming the missing head and its fetch command (empty: the table has none).
    """
    resolution = resolve_published_head(name_or_path, model, fetch=False) if name_or_path else None
    if resolution is None or resolution.usable:
        return ""
    if resolution.error is not None:
        raise resolution.error
    return missing_sentence(resolution)


def missing_sentence(resolution: HeadResolution) -> str:
    """``"a published EAGLE head ... fetch it with `hf download ...`"``."""
    return (
        f"a published EAGLE head for {resolution.entry.target} exists, {resolution.entry.label}, but is not on "
        f"this machine ({resolution.reason}): fetch it with `{resolution.fetch_command}`; the next load finds it"
    )


def missing_head_advice(name_or_path: str) -> str:
    """The plan's advice when the table has a head for the model that is not here (empty otherwise).

    Local only (never asks the hub): the head, and the command that fetches it.
    """
    entries = entries_for(name_or_path) if name_or_path else []
    hub = hub_folder()
    if not entries or any(held_copy(entry, hub) is not None for entry in entries):
        return ""
    reason = "offline: no local copy" if hub_offline() else "no local copy"
    return missing_sentence(HeadResolution(entries[0], "missing", reason=reason, hub=hub))
