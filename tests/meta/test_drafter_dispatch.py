"""The decoding loops reach drafters through the drafter contract only (issue 40).

No module under ``src/selfspec/decoding/`` names a drafter class (a subclass of ``Drafter``
anywhere in the package): the static round asks ``static_drafting`` and calls ``draft_static``,
the eager loop ``propose``; a class check there would send every other drafter (a user's) down
a different path without a word.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src" / "selfspec"


def drafter_classes(root: Path) -> set[str]:
    """Every class under ``root`` that derives from ``Drafter``, directly or through another one."""
    bases: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {
                    b.id if isinstance(b, ast.Name) else b.attr
                    for b in node.bases
                    if isinstance(b, ast.Name | ast.Attribute)
                }
                bases.setdefault(node.name, set()).update(names)
    found: set[str] = set()
    frontier = {"Drafter"}
    while frontier:
        frontier = {name for name, parents in bases.items() if parents & frontier} - found
        found |= frontier
    return found


def named_drafters(root: Path, classes: set[str]) -> list[str]:
    """``path:line: name`` for each drafter class named in a module under ``root``."""
    pattern = re.compile(r"\b(" + "|".join(sorted(classes)) + r")\b")
    hits = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            for match in pattern.finditer(line):
                hits.append(f"{path.relative_to(root)}:{number}: {match.group(1)}")
    return hits


def test_no_drafter_class_is_named_in_decoding() -> None:
    classes = drafter_classes(SOURCE)
    assert {"EarlyExitDrafter", "HybridDrafter", "PromptLookupDrafter", "EagleDrafter", "NoDrafter"} <= classes
    assert named_drafters(SOURCE / "decoding", classes) == []


def test_the_check_finds_a_named_drafter(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class Drafter: ...\nclass Mine(Drafter): ...\nclass Theirs(Mine): ...\n")
    (tmp_path / "b.py").write_text("x = 1\nif type(d) is Theirs:\n    pass\n")
    classes = drafter_classes(tmp_path)
    assert classes == {"Mine", "Theirs"}
    assert [hit.split(": ")[-1] for hit in named_drafters(tmp_path, classes) if "b.py" in hit] == ["Theirs"]
