"""``scripts/check_import_cycles.py``: no module under ``src/selfspec`` imports itself back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
