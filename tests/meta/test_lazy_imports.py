"""Importing selfspec or an adapter does not import torch (issue 19, item 7: adapters import fast).

The import *time* is measured by ``benchmarks/import_time.py`` (results in
``benchmarks/results/import_time.md``); this checks what makes it fast, deterministically:
``selfspec`` imports its public names on first use (PEP 562), and the adapters import the
engine (torch, transformers) only when a model is loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import selfspec

HEAVY = ("torch", "transformers", "selfspec.decoding.engine", "openai", "llguidance")


def _modules_after(statement: str) -> set[str]:
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import selfspec",
        "import langchain_selfspec",
        "from langchain_selfspec import ChatSpeculative; ChatSpeculative(model='selfspec-demo', max_tokens=8)",
        "import llama_index.llms.selfspec",
        "from llama_index.llms.selfspec import SpeculativeLLM; SpeculativeLLM(model='selfspec-demo')",
    ],
)
def test_importing_does_not_import_torch(statement: str) -> None:
    loaded = _modules_after(statement)
    assert not loaded & set(HEAVY), f"{statement!r} imported {sorted(loaded & set(HEAVY))}"


def test_the_first_use_of_a_name_imports_its_module() -> None:
    loaded = _modules_after("from selfspec import SpeculativeEngine, get_engine")
    assert {"torch", "selfspec.decoding.engine", "selfspec.serving.engines"} <= loaded


def test_every_public_name_resolves_and_is_listed() -> None:
    for name in selfspec.__all__:
        assert getattr(selfspec, name) is not None, name
    assert set(selfspec.__all__) <= set(dir(selfspec))
    assert selfspec.SpeculativeEngine.__module__ == "selfspec.decoding.engine"
    assert selfspec.decoding.engine.SpeculativeEngine is selfspec.SpeculativeEngine  # submodules as before
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = selfspec.no_such_name
