"""The import graph of ``tppc/``, read from the AST: what each module imports, and its circles.

Shared by the tests of the import rules (``test_import_layers.py``: floors, circles, private
names; ``test_torch_free_core.py``: the torch-free core). Every import counts: module level,
function level and ``TYPE_CHECKING`` blocks alike. Tests that check the checkers point
:data:`ROOT` at a fake tree (``monkeypatch.setattr(import_graph, "ROOT", fake)``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tppc"
"""The package whose imports are read."""


def module_name(path: Path) -> str:
    """``tppc/a/b.py`` -> ``tppc.a.b``; a package's ``__init__.py`` -> the package."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[str, str | None, int]]:
    """Every ``(module, name or None, line)`` a file imports from ``tppc``, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if not _ours(base):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists() \
                    or (ROOT.parent / sub.replace(".", "/") / "__init__.py").exists()
                found.append((sub, None, node.lineno) if is_module
                             else (base, alias.name, node.lineno))
    return found


def _ours(module: str) -> bool:
    return module == "tppc" or module.startswith("tppc.")


def tppc_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def import_edges() -> dict[str, set[str]]:
    modules = {module_name(p) for p in tppc_files()}
    edges: dict[str, set[str]] = {}
    for path in tppc_files():
        me = module_name(path)
        targets = edges.setdefault(me, set())
        for module, _name, _line in imports_of(path):
            while module not in modules and "." in module:
                module = module.rpartition(".")[0]
            if module != me:
                targets.add(module)
    return edges


def import_cycles(edges: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan); ``edges``: module ->
    modules it imports (default: every import in ``tppc/``)."""
    edges = import_edges() if edges is None else edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles
