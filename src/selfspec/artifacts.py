"""Where selfspec keeps what it writes for the user, and what it ships: one leaf module, one rule.

**Written.** Everything selfspec writes lives under :func:`cache_dir` (``$SELFSPEC_CACHE``, else
``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``), a model's artifacts of one kind in
:func:`model_cache` ``= cache_dir() / kind / model_key(model)``: calibrations, exit adapters,
EAGLE heads and their training state, Medusa heads, dequantized GGUF copies (one folder per
version of the file inside). Fetched real checkpoints live in ``cache_dir() / "models"``.
Nothing is written inside a model's folder or inside the package.

**Read.** :func:`find_artifact` looks where selfspec writes first, then, read only, in the
places published and shipped artifacts sit: sub-folders of a local model folder (``beside``:
``<model>/eagle_head``, ``<model>/exit_adapter``, ``<model>/medusa``, the folder itself for a
published Medusa repository), and the places earlier selfspec versions wrote to (so an existing
user cache keeps working). What the package ships (the demo models, their heads, the heads
trained for real models) lives under :data:`BUNDLED_MODELS`, never written to.

**Saved.** Every artifact is saved through this module, never in place: :func:`atomic_path`,
:func:`atomic_write_bytes` and :func:`atomic_write_text` write a temporary file beside the target
(``.<name>.<random>.partial``), flush it to disk and rename it over the target, so a reader sees
the old file or the new one, whole, and a failed save (a read-only folder, a full disk) leaves the
old file as it was and raises :class:`~selfspec.errors.ArtifactWriteError` naming the file;
:func:`atomic_folder` does the same for a folder (a dequantized copy). :func:`writable_path`
refuses (:class:`~selfspec.errors.UnsafeCachePathError`) a symbolic link inside the cache that leads
out of it, and :func:`artifact_lock` lets one process at a time produce an artifact.

This module imports only :mod:`selfspec.errors`, so any module may use it without forming an import cycle.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ArtifactWriteError, UnsafeCachePathError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: What the package ships: the demo models (``selfspec-demo``, ``selfspec-demo-draft``) and heads.
BUNDLED_MODELS = Path(__file__).parent / "models"

# The kinds of artifact: each a folder of the user cache, with one folder per model inside.
#: Measured calibrations (``<device>-<dtype>.json``).
CALIBRATIONS = "calibrations"
#: Exit adapters written by ``selfspec train-adapter``.
EXIT_ADAPTERS = "exit_adapters"
#: EAGLE heads written by ``selfspec train-eagle``.
EAGLE_HEADS = "eagle_heads"
#: ``train-eagle``'s resumable state (the written data and a checkpoint), one folder per head format.
EAGLE_TRAINING = "eagle_training"
#: EAGLE heads trained online from served text (``learn_online=True``), resumed by the next engine.
EAGLE_ONLINE = "eagle_online"
#: Medusa heads written by ``selfspec train-medusa``.
MEDUSA_HEADS = "medusa_heads"
#: Dequantized copies of GGUF checkpoints (safetensors, config and tokenizer), one folder per file version.
DEQUANTIZED = "gguf"
#: Fetched real checkpoints (``models/<short name>/<file>``; keyed by short name, not by model).
MODELS = "models"


def cache_dir() -> Path:
    """The user cache folder: ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``."""
    root = os.environ.get("SELFSPEC_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative value is invalid and ignored
        return Path(xdg) / "selfspec"
    return Path.home() / ".cache" / "selfspec"


def model_key(name_or_path: str | os.PathLike[str]) -> str:
    """A file-system-safe name for a model.

    A hub id with ``--`` for ``/``; a bundled model's name; a local folder or file as its name plus a
    short hash of its absolute path (two folders named ``model`` differ).
    """
    text = os.fspath(name_or_path)
    path = Path(text)
    try:
        local = path.exists()
    except OSError:
        local = False
    if not local:
        return text.replace("/", "--")
    resolved = path.resolve()
    if BUNDLED_MODELS.resolve() in resolved.parents:
        return resolved.name
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:10]
    return f"{resolved.name}-{digest}"


def loose_name(name: str | os.PathLike[str]) -> str:
    """A model name reduced for matching: the last path part, lower case, without ``.gguf`` and quant tags.

    ``"/models/SmolLM2-135M-Instruct.Q4_1.gguf"`` and ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` both give
    ``"smollm2-135m-instruct"``: how shipped EAGLE heads are matched to a model.
    """
    stem = Path(os.fspath(name).rstrip("/")).name.lower()
    stem = re.sub(r"\.gguf$", "", stem)
    return re.sub(r"[.-](q\d\w*|f16|f32|bf16)(-[0-9a-f]{12})?$", "", stem)


def model_cache(name_or_path: str | os.PathLike[str], kind: str) -> Path:
    """Where selfspec writes artifacts of one kind for a model: ``cache_dir() / kind / model_key(model)``."""
    return cache_dir() / kind / model_key(name_or_path)


def local_folder(name_or_path: str | os.PathLike[str] | None) -> Path | None:
    """The model's own folder when it is given as a local folder (``None`` for a hub id or a file)."""
    if not name_or_path:
        return None
    path = Path(os.fspath(name_or_path)).expanduser()
    try:
        return path if path.is_dir() else None
    except OSError:
        return None


def artifact_places(name_or_path: str | os.PathLike[str], kind: str, *, beside: Sequence[str] = ()) -> list[Path]:
    """Where a model's artifact of one kind is looked for, in order.

    1. :func:`model_cache` (where selfspec writes it);
    2. read only: each of ``beside`` inside a local model folder (``""``: the folder itself), where
       published or shipped artifacts sit;
    3. read only: where earlier selfspec versions wrote it in the user cache.
    """
    places = [model_cache(name_or_path, kind)]
    folder = local_folder(name_or_path)
    if folder is not None:
        places += [folder / sub if sub else folder for sub in beside]
    places += _former_places(name_or_path, kind)
    return places


def find_artifact(
    name_or_path: str | os.PathLike[str] | None,
    kind: str,
    holds: Callable[[Path], bool],
    *,
    beside: Sequence[str] = (),
) -> Path | None:
    """The first of :func:`artifact_places` that ``holds`` the artifact, or ``None`` (also for no model name)."""
    if not name_or_path:
        return None
    for place in artifact_places(name_or_path, kind, beside=beside):
        if holds(place):
            return place
    return None


def dequantized_places(folder: str, gguf_file: str) -> list[Path]:
    """Where the dequantized copy of a GGUF checkpoint is written (first), then where it was written before.

    ``model_cache(file, DEQUANTIZED) / <version>``: the version a hash of the file's size and
    modification time (``hub`` for a file in a hub repository), so an edited file gets a new copy.
    """
    local = Path(folder) / gguf_file
    if local.is_file():
        resolved = local.resolve()
        info = resolved.stat()
        version = hashlib.sha256(f"{info.st_size}|{info.st_mtime_ns}".encode()).hexdigest()[:12]
        former_ident = f"{resolved}|{info.st_size}|{info.st_mtime_ns}"
        current = model_cache(resolved, DEQUANTIZED) / version
    else:
        former_ident = f"hub:{folder}/{gguf_file}"
        current = model_cache(f"{folder}/{gguf_file}", DEQUANTIZED) / "hub"
    former = hashlib.sha256(former_ident.encode()).hexdigest()[:12]
    return [current, cache_dir() / DEQUANTIZED / f"{Path(gguf_file).stem}-{former}"]


def _former_places(name_or_path: str | os.PathLike[str], kind: str) -> list[Path]:
    """Where selfspec up to 0.x (before one rule) wrote a model's artifact in the user cache: read only."""
    if local_folder(name_or_path) is not None:
        return []  # those were written beside the model: artifact_places' ``beside`` looks there
    name = os.fspath(name_or_path)
    if kind == EXIT_ADAPTERS:
        return [cache_dir() / name.replace("/", "--") / "exit_adapter"]
    if kind == EAGLE_HEADS:
        return [cache_dir() / "eagle" / loose_name(name) / "eagle_head"]
    return []


# ------------------------------------------------------------------------------- writing
def writable_path(path: str | os.PathLike[str]) -> Path:
    """Where writing ``path`` lands, once no symbolic link inside the cache leads out of it.

    Outside :func:`cache_dir` the path is the caller's and is returned as given. Inside it, each
    link on the way from the cache root to the file is followed only when it stays inside the
    cache or leads to the same place of another selfspec cache (``<kind>/<model>`` to
    ``.../<kind>/<model>``, ``models`` to ``.../models``: how a test cache shares the fetched
    checkpoints of the real one); any other link (``calibrations/m/cpu-float32.json ->
    ~/.bashrc``, ``eagle_heads/m -> ~/project``) is refused. The cache root itself may be a link.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it; nothing was written.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    root = Path(os.path.abspath(cache_dir()))
    real_root = root.resolve()
    relative = _inside(target, root) or _inside(target, real_root)
    if relative is None:
        return target
    here = real_root
    for index, part in enumerate(relative.parts):
        step = here / part
        if not step.is_symlink():
            here = step
            continue
        points_to = step.resolve()
        shared = relative.parts[: index + 1]
        if _inside(points_to, real_root) is None and points_to.parts[-len(shared) :] != shared:
            raise UnsafeCachePathError(
                f"refusing to write {target}: {step} is a symbolic link to {points_to}, outside the selfspec "
                f"cache {real_root}; remove the link (or point SELFSPEC_CACHE at the folder you want written)"
            )
        here = points_to
    return here


def _inside(path: Path, root: Path) -> Path | None:
    """``path`` relative to ``root`` when it lies inside it, else ``None``."""
    try:
        return path.relative_to(root)
    except ValueError:
        return None


def make_folder(path: str | os.PathLike[str]) -> Path:
    """Create a folder to save artifacts in (and its parents), checked by :func:`writable_path`.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it.
        ArtifactWriteError: the folder cannot be created (read-only, full disk).
    """
    folder = writable_path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _write_error(folder, error) from error
    return folder


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; on success it is flushed and renamed over ``path``.

    ``with atomic_path(folder / "model.safetensors") as partial: save_file(tensors, str(partial))``:
    a reader of ``path`` sees the old file or the new one, whole, never a torn one. If the write or
    the rename fails, or the block raises, the temporary file is removed and ``path`` is untouched.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it (nothing is written).
        ArtifactWriteError: the file cannot be written (a read-only folder, a full disk); it names
            the file and keeps the cause's ``errno``.
    """
    final = writable_path(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = _new_partial(final)
    except OSError as error:
        raise _write_error(final, error) from error
    try:
        yield partial
        move_into_place(partial, final)
    except ArtifactWriteError:
        raise
    except OSError as error:
        raise _write_error(final, error) from error
    finally:
        with contextlib.suppress(OSError):
            partial.unlink()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Save ``data`` as the file ``path`` through :func:`atomic_path`; returns the file written."""
    with atomic_path(path) as partial:
        handle = os.open(partial, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_BINARY", 0))
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view) :]
        finally:
            os.close(handle)
    return writable_path(path)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Save ``text`` (UTF-8) as the file ``path`` through :func:`atomic_path`; returns the file written."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def move_into_place(partial: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Flush a finished temporary file (in ``path``'s folder) to disk and rename it over ``path``.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it.
        ArtifactWriteError: the flush or the rename failed; ``path`` is untouched.
    """
    final = writable_path(path)
    try:
        _fsync(Path(partial))
        os.replace(partial, final)
    except OSError as error:
        raise _write_error(final, error) from error
    _fsync_folder(final.parent)
    return final


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; on success its files are flushed and it replaces ``path``.

    A folder cannot be swapped in one step: an existing ``path`` is first renamed aside (and
    removed after), so a reader sees the old folder, then for an instant none, then the new one;
    never a half-written one. If anything fails the temporary folder is removed.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it.
        ArtifactWriteError: the folder cannot be written; it names the folder.
    """
    final = writable_path(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = final.with_name(f".{final.name}.{secrets.token_hex(4)}.partial")
        partial.mkdir()
    except OSError as error:
        raise _write_error(final, error) from error
    try:
        yield partial
        for file in sorted(partial.rglob("*")):
            if file.is_file() and not file.is_symlink():
                _fsync(file)
        _fsync_folder(partial)
        _swap_folder(partial, final)
    except ArtifactWriteError:
        raise
    except OSError as error:
        raise _write_error(final, error) from error
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _swap_folder(partial: Path, final: Path, attempts: int = 5) -> None:
    """Put the finished folder ``partial`` in ``final``'s place; the old one is restored if that fails.

    Another process swapping in its own copy at the same moment makes the rename find a folder
    again (``ENOTEMPTY``); the swap is then tried again, so the last writer's copy stands.
    """
    for attempt in range(attempts):
        aside = final.with_name(f".{final.name}.{secrets.token_hex(4)}.old")
        try:
            os.replace(final, aside)
            moved = True
        except FileNotFoundError:  # none yet (or another writer just moved it aside)
            moved = False
        try:
            os.replace(partial, final)
        except OSError as error:
            if moved:
                try:
                    os.replace(aside, final)
                except OSError:  # another copy stands there now
                    shutil.rmtree(aside, ignore_errors=True)
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST) and attempt + 1 < attempts:
                continue
            raise
        _fsync_folder(final.parent)
        if moved:
            shutil.rmtree(aside, ignore_errors=True)
        return


def _new_partial(final: Path) -> Path:
    """Create ``.<name>.<random>.partial`` beside ``final``: exclusively, never through a link."""
    partial = final.with_name(f".{final.name}.{secrets.token_hex(4)}.partial")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    os.close(os.open(partial, flags, 0o666))  # the umask applies, as for any file the user writes
    return partial


def _fsync(file: Path) -> None:
    handle = os.open(file, os.O_RDONLY if os.name == "posix" else os.O_RDWR)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (the rename) to disk where the platform can (POSIX); best effort."""
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


def _write_error(path: Path, error: OSError) -> ArtifactWriteError:
    """``[Errno 28] could not save <path>: No space left on device; ...`` with the cause's errno."""
    reason = error.strerror or str(error) or type(error).__name__
    code = error.errno if error.errno is not None else errno.EIO
    failure = ArtifactWriteError(code, f"could not save {path}: {reason}; nothing was written in its place")
    failure.filename = os.fspath(path)
    return failure


# ------------------------------------------------------------------------------- locking
@dataclass(frozen=True)
class ArtifactLock:
    """What :func:`artifact_lock` got.

    Attributes:
        held: this process holds the lock (``False``: no lock could be taken, or the wait ran out).
        waited: another process held it when asked (it may have saved the artifact meanwhile).
        holder_pid: that process's id, when its lock file says it.
        timed_out: the wait ran out while the other process still held it.
    """

    held: bool
    waited: bool = False
    holder_pid: int | None = None
    timed_out: bool = False


@contextlib.contextmanager
def artifact_lock(
    path: str | os.PathLike[str],
    *,
    wait: float,
    on_wait: Callable[[int | None], None] | None = None,
    poll: float = 0.05,
) -> Iterator[ArtifactLock]:
    """Hold an exclusive lock on the lock file ``path`` (``fcntl.flock``) while producing an artifact.

    A lock another process holds is waited for up to ``wait`` seconds (``on_wait`` is told once,
    with the holder's pid, which the lock file records); after that the block runs without the
    lock. Where no lock can be taken (no ``fcntl`` on this platform, a folder that cannot be
    written) the block runs unlocked: nothing can be saved there for another process to wait for.
    The lock file stays (removing a lock file others may hold races); the lock ends with the block
    or with the process.

    Raises:
        UnsafeCachePathError: a link inside the cache leads out of it.
    """
    if fcntl is None:  # pragma: no cover - Windows
        logger.warning("this platform has no fcntl: %s is not locked, another process may produce it too", path)
        yield ArtifactLock(held=False)
        return
    handle, state = _acquire(writable_path(path), wait, on_wait, poll)
    try:
        yield state
    finally:
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            os.close(handle)


def _acquire(
    path: Path, wait: float, on_wait: Callable[[int | None], None] | None, poll: float
) -> tuple[int | None, ArtifactLock]:
    """The open, locked lock file (or ``None``) and what happened on the way."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o666)
    except OSError as error:
        logger.debug("not locking %s: %s", path, error)
        return None, ArtifactLock(held=False)
    deadline = time.monotonic() + wait
    holder: int | None = None
    waited = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if not waited:
                waited, holder = True, _holder_pid(handle)
                if on_wait is not None:
                    on_wait(holder)
            if time.monotonic() >= deadline:
                os.close(handle)
                return None, ArtifactLock(held=False, waited=True, holder_pid=holder, timed_out=True)
            time.sleep(poll)
        except OSError as error:  # a file system without locks (some network mounts)
            logger.debug("not locking %s: %s", path, error)
            os.close(handle)
            return None, ArtifactLock(held=False)
    with contextlib.suppress(OSError):
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"{os.getpid()}\n".encode(), 0)
    return handle, ArtifactLock(held=True, waited=waited, holder_pid=holder)


def _holder_pid(handle: int) -> int | None:
    """The pid the lock's holder wrote into the lock file, if it did."""
    try:
        text = os.pread(handle, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
