"""``scripts/check_import_cycles.py``: no module under ``src/selfspec`` imports itself back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_import_cycles.py"
sys.path.insert(0, str(SCRIPT.parent))

from check_import_cycles import cycles, import_graph  # noqa: E402


def test_no_import_cycles() -> None:
    """No cycle at all among the imports that run, lazy ones included."""
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_the_check_finds_a_cycle(tmp_path: Path) -> None:
    """A lazy import back counts in the full check, not in the module-level one; TYPE_CHECKING in neither."""
    package = tmp_path / "selfspec"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")
    assert cycles(import_graph(package)) == [["selfspec.a", "selfspec.sub.b"]]
    assert cycles(import_graph(package, module_level=True)) == []
    (package / "sub" / "b.py").write_text("class C:\n    from ..a import g\n")  # a class body runs on import
    assert cycles(import_graph(package, module_level=True)) == [["selfspec.a", "selfspec.sub.b"]]
    # annotation-only imports never run: no cycle in either check
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    assert cycles(import_graph(package)) == []
    assert cycles(import_graph(package, module_level=True)) == []


def test_no_upward_imports_between_rings() -> None:
    """The rings import one way (the script's exit status covers both checks; this names the edges)."""
    from check_import_cycles import upward_imports

    assert upward_imports(import_graph(ROOT / "src" / "selfspec")) == []


def test_the_check_finds_an_upward_import_and_counts_package_inits(tmp_path: Path) -> None:
    """core importing decoding is reported; importing ``selfspec.drafting.x`` runs ``drafting/__init__``."""
    from check_import_cycles import upward_imports

    package = tmp_path / "selfspec"
    for sub in ("core", "decoding", "drafting"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "core" / "maths.py").write_text("def f():\n    from ..decoding import loop\n")
    (package / "decoding" / "loop.py").write_text("from ..drafting import base\n")
    (package / "drafting" / "base.py").write_text("")
    graph = import_graph(package)
    assert "selfspec.drafting" in graph["selfspec.decoding.loop"]  # the package __init__ runs first
    assert upward_imports(graph) == [
        ("selfspec.core.maths", "selfspec.decoding"),
        ("selfspec.core.maths", "selfspec.decoding.loop"),
    ]
    # a cycle through a package __init__: drafting/__init__ imports decoding, which imports drafting.base
    (package / "drafting" / "__init__.py").write_text("from ..decoding import loop\n")
    assert cycles(import_graph(package)) != []


def test_type_checking_only_cycles_are_reported_as_warnings(tmp_path: Path) -> None:
    package = tmp_path / "selfspec"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("from . import b\n")
    (package / "core" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    result = subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "TYPE_CHECKING only: selfspec.core.a <-> selfspec.core.b" in result.stderr


def test_a_heads_command_is_part_of_drafting(tmp_path: Path) -> None:
    """``drafting/<head>/cli.py`` reading the calibration climbs a ring: the ``cli`` ring passes such things in."""
    from check_import_cycles import upward_imports

    package = tmp_path / "selfspec"
    for sub in ("drafting", "drafting/head", "calibration", "cli"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "calibration" / "store.py").write_text("")
    (package / "drafting" / "head" / "cli.py").write_text("def f():\n    from ...calibration import store\n")
    (package / "cli" / "main.py").write_text("def f():\n    from ..calibration import store\n")
    assert upward_imports(import_graph(package)) == [
        ("selfspec.drafting.head.cli", "selfspec.calibration"),
        ("selfspec.drafting.head.cli", "selfspec.calibration.store"),
    ]
