"""The three wheels build, install into a fresh virtual environment, and each adapter answers there.

What CI checks for the installs of issue 19: ``selfspec``, ``langchain-selfspec`` and
``llama-index-llms-selfspec`` are built as wheels, installed into an empty venv (CPU torch first,
then the wheels, whose dependency bounds ``selfspec[grammar]>=0.1,<0.2`` resolve to the core's
wheel), and one call per adapter runs there on the bundled demo model, from outside the
repository so that nothing is imported from the source tree. The integration READMEs document
the same order for installs from a clone (checked below).

Slow (minutes: the venv's dependencies come from the package index or pip's cache).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT, ROOT / "integrations" / "langchain-selfspec", ROOT / "integrations" / "llama-index-llms-selfspec"]
#: torch as the Makefile installs it without a GPU (pip takes it from a local wheel where there is one).
TORCH = "torch==2.13.0"

SCRIPT = textwrap.dedent(
    """
    import langchain_selfspec, llama_index.llms.selfspec as li, selfspec, pathlib, sys
    for module in (selfspec, langchain_selfspec, li):
        assert "site-packages" in module.__file__, module.__file__
        assert (pathlib.Path(module.__file__).parent / "py.typed").is_file(), module.__name__
    from langchain_selfspec import ChatSpeculative
    from llama_index.llms.selfspec import SpeculativeLLM
    chat = ChatSpeculative(model="selfspec-demo", max_tokens=8).invoke("Hello")
    text = SpeculativeLLM(model="selfspec-demo", max_new_tokens=8).complete("Hello").text
    assert chat.content and text, (chat, text)
    print("OK", repr(chat.content), repr(text))
    """
)


def run(*command: str | Path, cwd: Path | None = None) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)  # installing the dependencies dominates; a loaded machine takes long
def test_wheels_install_into_a_fresh_venv_and_answer(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist, *PACKAGES)
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    assert [re.sub(r"-0\.1\.0-.*", "", w) for w in wheels] == [
        "langchain_selfspec", "llama_index_llms_selfspec", "selfspec"
    ], wheels
    import zipfile

    core_files = zipfile.ZipFile(next(dist.glob("selfspec-*.whl"))).namelist()
    rings = {name.split("/")[1] for name in core_files if name.startswith("selfspec/") and name.count("/") > 1}
    assert rings == {"core", "modeling", "drafting", "decoding", "calibration", "serving", "cli", "models"}, rings
    assert not [name for name in core_files if "demo_model" in name or "/training/" in name]  # the builder stays out
    top = [n for n in core_files if n.startswith("selfspec/") and n.count("/") == 1 and n.endswith(".py")]
    assert len(top) <= 6, top
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", TORCH)
    core = next(dist.glob("selfspec-*.whl"))
    adapters = [p for p in dist.glob("*.whl") if p != core]
    run(python, "-m", "pip", "install", "--quiet", f"{core}[grammar]", *adapters)
    out = run(python, "-c", SCRIPT, cwd=tmp_path)
    assert out.startswith("OK")


@pytest.mark.parametrize("package", ["langchain-selfspec", "llama-index-llms-selfspec"])
def test_readme_install_order(package: str) -> None:
    """CPU torch first, then the core with its grammar extra (and the gguf and serve extras its examples use), then
    the package; bounds on the core."""
    readme = (ROOT / "integrations" / package / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line for line in block.group(1).splitlines() if line.startswith("pip install")]
    assert commands == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        'pip install -e ".[grammar,gguf,serve]"',
        f"pip install -e integrations/{package}",
    ]
    pyproject = (ROOT / "integrations" / package / "pyproject.toml").read_text()
    assert '"selfspec[grammar]>=0.1,<0.2"' in pyproject
