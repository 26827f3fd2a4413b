"""``selfspec.artifacts``' saving rules: atomic files and folders, no link out of the cache, one lock holder.

No model is loaded; the file systems are real (only a full disk is simulated, by ``os.write``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from selfspec.artifacts import (
    artifact_lock,
    atomic_folder,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    make_folder,
    writable_path,
)
from selfspec.errors import ArtifactWriteError, UnsafeCachePathError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh user cache for one test."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


def _leftovers(folder: Path) -> list[str]:
    """Temporary files a save left behind."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".partial", ".old")))


def full_disk_after(monkeypatch: pytest.MonkeyPatch, written: int) -> None:
    """``os.write`` writes ``written`` bytes in all, then fails as a full disk does (``ENOSPC``)."""
    real_write = os.write
    left = [written]

    def write(handle: int, data: bytes | memoryview) -> int:
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done = real_write(handle, bytes(data[: left[0]]))
        left[0] -= done
        return done

    monkeypatch.setattr(os, "write", write)


# ----------------------------------------------------------------------------- atomic files
def test_a_save_writes_the_file_whole_and_leaves_nothing_beside_it(cache: Path) -> None:
    target = cache / "calibrations" / "m" / "cpu-float32.json"
    assert atomic_write_text(target, "{}\n") == target
    assert target.read_text() == "{}\n"
    atomic_write_bytes(target, b"[1]\n")  # over an existing file
    assert target.read_bytes() == b"[1]\n" and _leftovers(target.parent) == []
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes, not owner-only


def _save_while_reading(save: Callable[[int], object], read: Callable[[], None], seconds: float = 1.0) -> int:
    """Call ``save(n)`` for n = 0, 1, ... for ``seconds`` while a thread calls ``read()`` in a tight loop; the saves."""
    stop = threading.Event()

    def reading() -> None:
        while not stop.is_set():
            read()

    reader = threading.Thread(target=reading)
    reader.start()
    saves = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            save(saves)
            saves += 1
    finally:
        stop.set()
        reader.join()
    return saves


def test_a_reader_during_repeated_saves_sees_only_whole_old_or_new_files(cache: Path) -> None:
    """A tight-loop reader against a writer alternating two 256 KB files for about a second."""
    target = cache / "calibrations" / "m" / "cpu-float32.json"
    versions = [b"a" * (1 << 18), b"b" * ((1 << 18) + 4096)]
    atomic_write_bytes(target, versions[0])
    seen: dict[bytes, int] = {}
    torn: list[int] = []

    def read() -> None:
        data = target.read_bytes()  # never FileNotFoundError: the name always holds a file
        if data in versions:
            seen[data[:1]] = seen.get(data[:1], 0) + 1
        else:
            torn.append(len(data))

    saves = _save_while_reading(lambda n: atomic_write_bytes(target, versions[n % 2]), read)
    assert torn == [], f"{len(torn)} torn reads (sizes {sorted(set(torn))[:5]}) in {sum(seen.values())} reads"
    assert saves > 20 and sum(seen.values()) > 20 and set(seen) == {b"a", b"b"}, (saves, seen)
    assert _leftovers(target.parent) == []


def test_a_full_disk_keeps_the_previous_file_and_names_the_file(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = cache / "calibrations" / "m" / "cpu-float32.json"
    atomic_write_text(target, '{"valid": true}\n')
    full_disk_after(monkeypatch, written=4096)
    with pytest.raises(ArtifactWriteError) as caught:
        atomic_write_bytes(target, b"x" * 100_000)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(target)
    assert str(target) in str(caught.value) and "No space left" in str(caught.value)
    assert isinstance(caught.value, OSError)  # callers catching OSError still do
    assert target.read_text() == '{"valid": true}\n' and _leftovers(target.parent) == []
    monkeypatch.undo()
    new = cache / "calibrations" / "m" / "cuda-bfloat16.json"
    full_disk_after(monkeypatch, written=0)
    with pytest.raises(ArtifactWriteError):
        atomic_write_text(new, "{}")
    assert not new.exists() and _leftovers(new.parent) == []  # never a 0-byte file


def test_a_failing_writer_leaves_the_old_file(cache: Path) -> None:
    target = cache / "eagle_heads" / "m" / "model.safetensors"
    atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="serializer"), atomic_path(target) as partial:
        partial.write_bytes(b"half")
        raise RuntimeError("the serializer failed")
    with pytest.raises(ArtifactWriteError, match=r"model\.safetensors"), atomic_path(target) as partial:
        raise OSError(errno.EIO, "Input/output error")  # an OSError of the writer names the file
    assert target.read_bytes() == b"old" and _leftovers(target.parent) == []


def test_an_unwritable_folder_is_a_typed_error_naming_the_file(cache: Path) -> None:
    (cache / "calibrations").write_text("a file where a folder belongs")  # ENOTDIR, even as root
    with pytest.raises(ArtifactWriteError, match=r"could not save .*cpu-float32\.json") as caught:
        atomic_write_text(cache / "calibrations" / "m" / "cpu-float32.json", "{}")
    assert caught.value.errno in (errno.ENOTDIR, errno.EEXIST)
    with pytest.raises(ArtifactWriteError):
        make_folder(cache / "calibrations" / "m")


def test_a_folder_is_swapped_in_whole_and_a_failure_keeps_the_old_one(cache: Path) -> None:
    target = cache / "gguf" / "m" / "abc123"
    with atomic_folder(target) as partial:
        (partial / "config.json").write_text("{}")
        (partial / "model.safetensors").write_bytes(b"v1")
        assert not target.exists()  # nothing is visible before the block ends
    assert (target / "model.safetensors").read_bytes() == b"v1"
    with pytest.raises(RuntimeError), atomic_folder(target) as partial:
        (partial / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("conversion failed")
    assert (target / "model.safetensors").read_bytes() == b"v1"
    with atomic_folder(target) as partial:  # over an existing (say half-written) copy
        (partial / "model.safetensors").write_bytes(b"v2")
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"v2" and _leftovers(target.parent) == []


def test_two_writers_swapping_in_one_folder_both_succeed_and_leave_one_whole_copy(cache: Path) -> None:
    """Two processes converting one GGUF file at once: each swap succeeds, the last copy stands whole."""
    target = cache / "gguf" / "m" / "abc123"
    failures: list[BaseException] = []

    def convert(mark: str) -> None:
        try:
            for _ in range(30):
                with atomic_folder(target) as partial:
                    (partial / "config.json").write_text(mark)
                    (partial / "model.safetensors").write_text(mark)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            failures.append(error)

    writers = [threading.Thread(target=convert, args=(mark,)) for mark in "ab"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert failures == []
    assert (target / "config.json").read_text() == (target / "model.safetensors").read_text()
    assert _leftovers(target.parent) == []


# ----------------------------------------------------------------------------- links
def test_a_link_to_a_file_outside_the_cache_is_refused_and_the_file_untouched(cache: Path, tmp_path: Path) -> None:
    outside = tmp_path / "bashrc"
    outside.write_text("the user's own file\n")
    folder = cache / "calibrations" / "m"
    folder.mkdir(parents=True)
    (folder / "cpu-float32.json").symlink_to(outside)
    with pytest.raises(UnsafeCachePathError, match=r"symbolic link to .*bashrc, outside the selfspec cache"):
        atomic_write_text(folder / "cpu-float32.json", "{}")
    assert outside.read_text() == "the user's own file\n"
    assert (folder / "cpu-float32.json").is_symlink() and _leftovers(folder) == []


def test_a_link_to_a_folder_outside_the_cache_is_refused(cache: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text("theirs")
    (cache / "eagle_heads").mkdir()
    (cache / "eagle_heads" / "m").symlink_to(project, target_is_directory=True)
    for write in (
        lambda: atomic_write_text(cache / "eagle_heads" / "m" / "config.json", "{}"),
        lambda: make_folder(cache / "eagle_heads" / "m" / "sub"),
        lambda: atomic_folder(cache / "eagle_heads" / "m" / "copy").__enter__(),
    ):
        with pytest.raises(UnsafeCachePathError):
            write()
    assert sorted(p.name for p in project.iterdir()) == ["config.json"]
    assert (project / "config.json").read_text() == "theirs"


def test_links_inside_the_cache_or_to_the_same_place_of_another_cache_are_followed(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How the test suite's cache shares the real cache's checkpoints (``models``, ``gguf/<model>``)."""
    other = tmp_path / "real-cache"
    (other / "models").mkdir(parents=True)
    (other / "gguf" / "m").mkdir(parents=True)
    (cache / "models").symlink_to(other / "models", target_is_directory=True)
    (cache / "gguf").mkdir()
    (cache / "gguf" / "m").symlink_to(other / "gguf" / "m", target_is_directory=True)
    assert atomic_write_text(cache / "models" / "x.gguf", "w") == other / "models" / "x.gguf"
    assert atomic_write_text(cache / "gguf" / "m" / "SOURCE", "s") == other / "gguf" / "m" / "SOURCE"
    (cache / "calibrations").mkdir()
    (cache / "calibrations" / "alias").symlink_to(cache / "gguf", target_is_directory=True)  # inside: fine
    assert writable_path(cache / "calibrations" / "alias" / "f") == cache.resolve() / "gguf" / "f"
    (cache / "calibrations" / "n").symlink_to(other / "gguf" / "m", target_is_directory=True)  # another place
    with pytest.raises(UnsafeCachePathError):
        writable_path(cache / "calibrations" / "n" / "f")
    linked_root = tmp_path / "root-link"  # the cache root itself may be a link (a cache on another disk)
    linked_root.symlink_to(cache, target_is_directory=True)
    monkeypatch.setenv("SELFSPEC_CACHE", str(linked_root))
    assert atomic_write_text(linked_root / "medusa_heads" / "m" / "config.json", "{}").is_file()
    assert (cache / "medusa_heads" / "m" / "config.json").read_text() == "{}"


def test_outside_the_cache_a_link_at_the_name_is_replaced_not_written_through(cache: Path, tmp_path: Path) -> None:
    """A path the caller chose (``--output``) is written as given: the name gets the file."""
    outside = tmp_path / "elsewhere.json"
    outside.write_text("kept")
    link = tmp_path / "out" / "bench.json"
    link.parent.mkdir()
    link.symlink_to(outside)
    atomic_write_text(link, "new")
    assert not link.is_symlink() and link.read_text() == "new" and outside.read_text() == "kept"


# ----------------------------------------------------------------------------- the lock
def test_a_second_holder_waits_for_the_first_and_learns_its_pid(cache: Path) -> None:
    lock_file = cache / "calibrations" / "m" / "cpu-float32.json.lock"
    held = threading.Event()
    release = threading.Event()

    def first() -> None:
        with artifact_lock(lock_file, wait=5.0) as lock:
            assert lock.held and not lock.waited
            held.set()
            release.wait(5.0)

    holder = threading.Thread(target=first)
    holder.start()
    assert held.wait(5.0)
    told: list[int | None] = []
    threading.Timer(0.2, release.set).start()
    start = time.monotonic()
    with artifact_lock(lock_file, wait=5.0, on_wait=told.append) as lock:  # another fd: flock excludes it
        waited_for = time.monotonic() - start
        assert lock.held and lock.waited and lock.holder_pid == os.getpid() and not lock.timed_out
    holder.join()
    assert told == [os.getpid()] and 0.15 < waited_for < 3.0
    with artifact_lock(lock_file, wait=0.0) as lock:  # free again: taken at once
        assert lock.held and not lock.waited


def test_the_wait_is_bounded(cache: Path) -> None:
    lock_file = cache / "m.lock"
    with artifact_lock(lock_file, wait=5.0) as first:
        start = time.monotonic()
        with artifact_lock(lock_file, wait=0.2) as second:
            assert first.held and not second.held and second.timed_out and second.holder_pid == os.getpid()
        assert 0.15 < time.monotonic() - start < 2.0


def test_a_lock_that_cannot_be_created_runs_unlocked(cache: Path) -> None:
    (cache / "calibrations").write_text("not a folder")
    with artifact_lock(cache / "calibrations" / "m" / "x.lock", wait=5.0) as lock:
        assert not lock.held and not lock.waited


# ----------------------------------------------------------------------------- calibrations
def test_loading_a_calibration_during_repeated_saves_never_finds_it_unreadable(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: a tight-loop ``load_calibration`` against ``save_calibration`` (was 12,985 of 13,415 lost)."""
    from selfspec.calibration.store import load_calibration, save_calibration

    model = str(cache / "no-such-model")
    versions = [{"exit_layer": layer, "notes": ["x" * 40_000] * layer} for layer in (1, 2)]
    save_calibration(model, versions[0])
    loaded: list[int] = []

    def read() -> None:
        data = load_calibration(model, check_machine=False)
        loaded.append(-1 if data is None else data["exit_layer"])

    saves = _save_while_reading(lambda n: save_calibration(model, versions[n % 2]), read)
    assert loaded.count(-1) == 0, f"{loaded.count(-1)} of {len(loaded)} loads found no usable calibration"
    assert saves > 10 and len(loaded) > 10 and set(loaded) == {1, 2}, (saves, len(loaded), set(loaded))
    assert not [r for r in caplog.records if "unreadable" in r.getMessage()]
