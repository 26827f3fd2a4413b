"""The decoding loops ask a cache what it holds (``KVCache.batched``), never which class it is (issue 42).

A class check in ``src/selfspec/decoding/`` would send any other cache (a new one, a user's) down
the wrong path without a word; every cache the loop can meet says whether it holds a batch's rows.
"""

from __future__ import annotations

import ast
from pathlib import Path

from selfspec.modeling.cache import BatchedKVCache, StaticKVCache
from selfspec.modeling.static_step import DeviceKVCache

SOURCE = Path(__file__).resolve().parents[2] / "src" / "selfspec"


def _names(node: ast.AST) -> list[str]:
    """The class names an ``isinstance`` argument or a compared expression mentions."""
    return [
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)
    ]


def cache_class_checks(root: Path) -> list[str]:
    """``path:line`` for each ``isinstance``/``issubclass``/``type(...)`` check against a ``*Cache`` class."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            checked: list[str] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
                    checked = _names(node.args[1])
            elif isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Call) and isinstance(side.func, ast.Name) and side.func.id == "type"
                for side in (node.left, *node.comparators)
            ):
                checked = [name for side in (node.left, *node.comparators) for name in _names(side)]
            if any(name.endswith("Cache") for name in checked):
                hits.append(f"{path.relative_to(root)}:{node.lineno}")
    return hits


def test_decoding_never_checks_a_cache_class() -> None:
    assert cache_class_checks(SOURCE / "decoding") == []


def test_every_cache_the_loop_meets_says_whether_it_is_batched() -> None:
    assert BatchedKVCache(2).batched is True
    assert StaticKVCache(2, 8).batched is False
    assert DeviceKVCache.batched is False  # the static round's (built from a runner)


def test_the_check_finds_a_class_check(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        "if isinstance(c, BatchedKVCache):\n    pass\n"
        "ok = isinstance(c, int)\n"
        "if type(state.cache) is m.StaticKVCache:\n    pass\n"
        "if isinstance(c, (int, DeviceKVCache)):\n    pass\n"
        "if c.batched:\n    pass\n"
    )
    assert cache_class_checks(tmp_path) == ["a.py:1", "a.py:4", "a.py:6"]
