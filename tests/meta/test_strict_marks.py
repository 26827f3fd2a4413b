"""No test is marked in a way that passes whatever happens (issue 19, item 6).

``xfail(strict=False)`` (pytest's default) passes whether the test fails or not; the project
allows only ``xfail(strict=True)``, which fails the day the expected failure goes away. This reads
every test file of the repository (``tests/`` and both integration packages) with :mod:`ast`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FILES = sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("integrations/*/tests/**/*.py")])


def loose_xfails(source: str) -> list[int]:
    """Lines of ``mark.xfail`` uses without ``strict=True``."""
    tree = ast.parse(source)
    called = set()
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "xfail":
            if isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "mark":
                called.add(id(node.func))
                strict = [k for k in node.keywords if k.arg == "strict"]
                if not (strict and isinstance(strict[0].value, ast.Constant) and strict[0].value.value is True):
                    lines.append(node.lineno)
    for node in ast.walk(tree):  # a bare ``@pytest.mark.xfail`` is not strict either
        if (isinstance(node, ast.Attribute) and node.attr == "xfail" and id(node) not in called
                and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_loose_marks() -> None:
    source = (
        "import pytest\n"
        "@pytest.mark.xfail(reason='x')\ndef test_a(): ...\n"
        "@pytest.mark.xfail(strict=False)\ndef test_b(): ...\n"
        "@pytest.mark.xfail\ndef test_c(): ...\n"
        "@pytest.mark.xfail(reason='y', strict=True)\ndef test_d(): ...\n"
        "CASES = [pytest.param(1, marks=pytest.mark.xfail(reason='z'))]\n"
    )
    assert loose_xfails(source) == [2, 4, 6, 10]


def test_every_xfail_in_the_repository_is_strict() -> None:
    assert len(TEST_FILES) > 20
    loose = {
        str(path.relative_to(ROOT)): lines
        for path in TEST_FILES
        if (lines := loose_xfails(path.read_text(encoding="utf-8")))
    }
    assert not loose, f"xfail marks without strict=True: {loose}"
