"""Fail when any module under ``src/selfspec`` imports, directly or not, a module that imports it back.

Every import that runs counts: at module level and inside functions (lazy imports). Imports under
``if TYPE_CHECKING:`` do not: with ``from __future__ import annotations`` they never execute and
only name types for the type checker. With ``--module-level`` only the imports that run when a
module is imported count (lazy ones are left out too). The script reads the source with
:mod:`ast` (nothing is imported), builds the graph of ``selfspec`` modules, and prints each cycle
it finds (one per strongly connected component). Exit status 0 means no cycle.

Usage: ``python scripts/check_import_cycles.py [--module-level] [src/selfspec]``
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "selfspec"


def module_name(path: Path, root: Path) -> str:
    """``src/selfspec/drafting/base.py`` -> ``selfspec.drafting.base`` (a package is its ``__init__``)."""
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _statements(tree: ast.Module, module_level: bool) -> list[ast.stmt]:
    """Every import statement that can run, or (``module_level``) those that run on import."""
    found: list[ast.stmt] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending += node.orelse  # annotation-only imports never run
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and module_level:
            if isinstance(node, ast.ClassDef):
                pending += node.body  # a class body runs on import; a function body does not
        else:
            pending += list(ast.iter_child_nodes(node))
    return found


def imported_modules(path: Path, name: str, modules: set[str], module_level: bool = False) -> set[str]:
    """The ``selfspec`` modules one file imports (``from .x import y`` counts ``.x`` and ``.x.y`` if a module)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(encoding="utf-8"), str(path)), module_level):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            targets = [origin, *(f"{origin}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, module_level: bool = False) -> dict[str, set[str]]:
    """Module -> the ``selfspec`` modules it imports."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: imported_modules(path, name, modules, module_level) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in sorted(graph.get(node, ())):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main(argv: list[str]) -> int:
    """Print every import cycle under the package folder; return 1 if there is one."""
    module_level = "--module-level" in argv
    paths = [arg for arg in argv[1:] if not arg.startswith("--")]
    root = Path(paths[0]) if paths else Path(__file__).resolve().parents[1] / "src" / PACKAGE
    graph = import_graph(root, module_level)
    found = cycles(graph)
    for component in found:
        sys.stderr.write("import cycle: " + " <-> ".join(component) + "\n")
    if not found:
        sys.stdout.write(f"no import cycles among the {len(graph)} modules under {root}\n")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
