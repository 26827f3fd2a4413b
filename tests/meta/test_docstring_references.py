"""A docstring's cross-reference names where the thing is defined (issue 42: three in ``server/app.py`` did not).

``:class:`~selfspec.a.b.Name``` must name the module that defines ``Name``, or a package that
exports it (``selfspec``, ``selfspec.drafting``: the public names); a module that merely imports
it from elsewhere is where it no longer is. Checked over the whole package.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parents[2] / "src" / "selfspec"
MISSING = object()
REFERENCE = re.compile(r":(?:class|func|meth|data|attr|exc):`~?(selfspec\.[\w.]+)`")


def misplaced_references(root: Path) -> list[str]:
    """``path: reference -> where it is`` for each reference that misses, or names a module that only imports it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for reference in sorted(set(REFERENCE.findall(path.read_text(encoding="utf-8")))):
            parts = reference.split(".")
            module: ModuleType | None = None
            for split in range(len(parts), 0, -1):  # the longest importable prefix
                try:
                    module = importlib.import_module(".".join(parts[:split]))
                except ImportError:
                    continue
                break
            assert module is not None
            target: object = module
            for name in parts[split:]:
                target = getattr(target, name, MISSING)  # a constant may be None: that is found
            if target is MISSING:
                found.append(f"{path.relative_to(root)}: {reference} -> missing")
                continue
            named_module = ".".join(parts[:split])
            home = (
                getattr(target, "__module__", None) if inspect.isclass(target) or inspect.isfunction(target) else None
            )
            package = hasattr(module, "__path__")
            if len(parts) - split == 1 and home is not None and home != named_module and not package:
                found.append(f"{path.relative_to(root)}: {reference} -> {home}")
    return found


def test_docstrings_name_where_things_are() -> None:
    assert misplaced_references(SOURCE) == []


def test_the_check_finds_a_reference_to_a_re_export(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        '"""See :class:`~selfspec.serving.server.limits.ServerLimits`, '
        ":class:`~selfspec.serving.server.settings.ServerLimits`, :func:`selfspec.get_engine` and "
        ':func:`selfspec.serving.requests.no_such_function`."""\n'
    )
    assert misplaced_references(tmp_path) == [
        "a.py: selfspec.serving.requests.no_such_function -> missing",
        "a.py: selfspec.serving.server.limits.ServerLimits -> selfspec.serving.server.settings",
    ]
