"""Fail when a module under ``src/selfspec`` imports itself back, or imports a ring above its own.

Every import that runs counts: at module level and inside functions (lazy imports). Imports under
``if TYPE_CHECKING:`` do not: with ``from __future__ import annotations`` they never execute and
only name types for the type checker. With ``--module-level`` only the imports that run when a
module is imported count (lazy ones are left out too). The script reads the source with
:mod:`ast` (nothing is imported), builds the graph of ``selfspec`` modules, and prints each cycle
it finds (one per strongly connected component). Exit status 0 means no cycle.

Importing ``selfspec.a.b`` also runs ``selfspec/__init__`` and ``selfspec/a/__init__``: those
package edges count too. The rings (``../DESIGN.md``, "Layout") import one way, leaves first:
``errors``/``artifacts``/``prompts`` <- ``core`` <- ``modeling`` <- ``drafting`` <- ``decoding`` <-
``calibration`` <- ``serving`` <- ``cli`` (a learned head's ``train-*`` verb, ``drafting/<head>/cli.py``,
is part of ``drafting`` like the rest of its folder: what it needs from a ring above, ``cli`` passes in when it
registers the verb); an import of a ring to the right is reported, except the lazy edges in
:data:`ALLOWED_UPWARD` (which must be lazy, and which close no reported cycle: they are the designed way back).
Cycles that exist only through ``TYPE_CHECKING`` imports are reported as well (as a warning: they never run,
but they show a layering the code does not keep).

Usage: ``python scripts/check_import_cycles.py [--module-level] [src/selfspec]``
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "selfspec"
#: The rings, leaves first; a module may import its own ring and those before it.
RINGS = (("errors", "artifacts", "prompts"), ("core",), ("modeling",), ("drafting",), ("decoding",),
         ("calibration",), ("serving",), ("cli",))  # fmt: skip
#: Upward edges that are allowed, each lazy (inside a function): (importer, imported package).
ALLOWED_UPWARD = {
    # first-load calibration and its saved result, from from_pretrained / the constructor
    ("selfspec.decoding.engine", "selfspec.calibration"),
}


def module_name(path: Path, root: Path) -> str:
    """``src/selfspec/drafting/base.py`` -> ``selfspec.drafting.base`` (a package is its ``__init__``)."""
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _statements(tree: ast.Module, module_level: bool, type_checking: bool = False) -> list[ast.stmt]:
    """Every import statement that can run, or (``module_level``) those that run on import.

    With ``type_checking`` the imports under ``if TYPE_CHECKING:`` count too.
    """
    found: list[ast.stmt] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not type_checking:
            pending += node.orelse  # annotation-only imports never run
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and module_level:
            if isinstance(node, ast.ClassDef):
                pending += node.body  # a class body runs on import; a function body does not
        else:
            pending += list(ast.iter_child_nodes(node))
    return found


def imported_modules(
    path: Path, name: str, modules: set[str], module_level: bool = False, type_checking: bool = False
) -> set[str]:
    """The ``selfspec`` modules one file imports (``from .x import y`` counts ``.x`` and ``.x.y`` if a module).

    The packages above each imported module count too: importing it runs their ``__init__``.
    """
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(encoding="utf-8"), str(path)), module_level, type_checking):
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
            while target:  # the module, then each package whose __init__ runs first
                if target != name and not name.startswith(target + "."):
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def import_graph(root: Path, module_level: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the ``selfspec`` modules it imports (packages included: their ``__init__`` runs)."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {
        name: imported_modules(path, name, modules, module_level, type_checking) for name, path in files.items()
    }


def ring(module: str) -> int | None:
    """The ring of a ``selfspec`` module (its first component), or ``None`` for the package root."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for index, names in enumerate(RINGS):
        if parts[1] in names:
            return index
    return None


def upward_imports(
    graph: dict[str, set[str]], module_level: dict[str, set[str]] | None = None
) -> list[tuple[str, str]]:
    """Every edge from a module to a module of a ring to its right (allowed lazy edges left out).

    With ``module_level`` (the graph of imports that run on import), an allowed edge counts as
    upward when it runs on import: the allowed edges must be lazy.
    """
    found = []
    for importer, targets in sorted(graph.items()):
        here = ring(importer)
        for target in sorted(targets):
            there = ring(target)
            if here is None or there is None or there <= here:
                continue
            eager = module_level is not None and target in module_level.get(importer, set())
            allowed = any(importer == a and (target == b or target.startswith(b + ".")) for a, b in ALLOWED_UPWARD)
            if allowed and not eager:
                continue
            found.append((importer, target))
    return found


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


def without_allowed_edges(graph: dict[str, set[str]], module_level: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` less the allowed lazy upward edges: the one way back down by design, not a cycle to report."""

    def allowed(importer: str, target: str) -> bool:
        if target in module_level.get(importer, set()):
            return False  # it runs on import: not lazy, so not the allowed edge
        return any(importer == a and (target == b or target.startswith(b + ".")) for a, b in ALLOWED_UPWARD)

    return {importer: {t for t in targets if not allowed(importer, t)} for importer, targets in graph.items()}


def main(argv: list[str]) -> int:
    """Print every import cycle under the package folder; return 1 if there is one."""
    module_level = "--module-level" in argv
    paths = [arg for arg in argv[1:] if not arg.startswith("--")]
    root = Path(paths[0]) if paths else Path(__file__).resolve().parents[1] / "src" / PACKAGE
    graph = import_graph(root, module_level)
    eager = import_graph(root, module_level=True)
    found = cycles(without_allowed_edges(graph, eager))
    for component in found:
        sys.stderr.write("import cycle: " + " <-> ".join(component) + "\n")
    upward = upward_imports(graph, eager)
    for importer, target in upward:
        sys.stderr.write(f"upward import: {importer} -> {target} (rings: {' <- '.join('/'.join(r) for r in RINGS)})\n")
    typed_graph = without_allowed_edges(import_graph(root, module_level, type_checking=True), eager)
    typed = [c for c in cycles(typed_graph) if c not in found]
    for component in typed:
        sys.stderr.write("warning: import cycle through TYPE_CHECKING only: " + " <-> ".join(component) + "\n")
    if not found and not upward:
        sys.stdout.write(f"no import cycles and no upward imports among the {len(graph)} modules under {root}\n")
    return 1 if found or upward else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
