"""The import layers of ``tppc/`` (docs/layout.md): imports point down, never in a circle, and
no private name crosses a module.

The floors and the forbidden imports are read from the two tables of ``docs/layout.md`` (the one
map of the packages). Every import in ``tppc/`` is read from the AST (module level, function
level and ``TYPE_CHECKING`` blocks alike). A package may import its own modules and any package
on a lower floor of :data:`FLOORS`; anything else is an upward import. Modules import each other
without a circle (inside a package too), and so do the sub-packages of a package, each taken as
one node. A name with a leading underscore is imported only inside its own module, and a module
with a leading underscore only from its own package. The torch-free packages
(:data:`TORCH_FREE`) never import torch, nor at module level a module that does.

To see the test fail, add ``from tppc.pipeline.compiled import CompiledPipeline`` to any
function in ``tppc/planner/plan.py``: the planner (floor 8) may not import the in-process
pipeline (15).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tppc"
LAYOUT = ROOT.parent / "docs" / "layout.md"
_ROW = re.compile(r"^\| *(\d+|top) *\| *(`tppc/[^|]*`) *\|", re.MULTILINE)
_RULE = re.compile(r"^\| *`tppc/(\w+)` *\| *((?:`tppc/\w+`,? *)+)\|", re.MULTILINE)


def read_floors(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The floor table of docs/layout.md: packages from the bottom up, and the top's modules."""
    rows = [(floor, re.findall(r"`tppc/(\w+)(?:\.py|/__init__\.py)?`", cells))
            for floor, cells in _ROW.findall(text)]
    numbered = [(int(floor), names) for floor, names in rows if floor != "top"]
    assert [f for f, _ in numbered] == list(range(len(numbered))), \
        f"docs/layout.md: floors {[f for f, _ in numbered]} are not 0, 1, 2, ... in order"
    assert all(len(names) == 1 for _, names in numbered), "one package per floor"
    top = [name for floor, names in rows if floor == "top" for name in names]
    return tuple(names[0] for _, names in numbered), tuple(top)


def read_forbidden(text: str) -> dict[str, frozenset[str]]:
    """The "never imports" table of docs/layout.md: package -> packages it may not import."""
    return {pkg: frozenset(re.findall(r"`tppc/(\w+)`", never)) for pkg, never in _RULE.findall(text)}


#: Packages from the bottom up: a package imports only those on lower floors (and itself);
#: the top: the public API (``tppc/__init__.py``) and the ``python -m tppc.run`` shim.
FLOORS, TOP = read_floors(LAYOUT.read_text())
#: Packages a package may not import although they sit lower (the cost model never calls the
#: front end, the planner never reads fx graphs, executors know programs, never plans).
FORBIDDEN = read_forbidden(LAYOUT.read_text())


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


def floor_of(module: str) -> int:
    """The floor of a ``tppc`` module: its package's index in :data:`FLOORS`."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TOP:
        return len(FLOORS)
    if parts[1] not in FLOORS:
        raise AssertionError(f"{module}: package {parts[1]!r} has no floor; add it to the table "
                             "of docs/layout.md")
    return FLOORS.index(parts[1])


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


def _edges() -> dict[str, set[str]]:
    modules = {module_name(p) for p in _files()}
    edges: dict[str, set[str]] = {}
    for path in _files():
        me = module_name(path)
        targets = edges.setdefault(me, set())
        for module, _name, _line in imports_of(path):
            while module not in modules and "." in module:
                module = module.rpartition(".")[0]
            if module != me:
                targets.add(module)
    return edges


def upward_imports() -> list[str]:
    """Every import from a package to one on a higher floor (or to another top package)."""
    bad = []
    for path in _files():
        me = module_name(path)
        mine = floor_of(me)
        for module, name, line in imports_of(path):
            theirs = floor_of(module)
            same_package = module.split(".")[:2] == me.split(".")[:2]
            forbidden = module.split(".")[1:2] and module.split(".")[1] in FORBIDDEN.get(
                me.split(".")[1] if "." in me else "", ())
            if theirs > mine or (theirs == mine and not same_package) or forbidden:
                what = f"{module}:{name}" if name else module
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {what} "
                           f"(floor {mine} -> {theirs})")
    return bad


def private_imports() -> list[str]:
    """Private names imported from another module, private modules from another package."""
    bad = []
    for path in _files():
        me = module_name(path)
        my_package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for module, name, line in imports_of(path):
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            if name is not None and name.startswith("_") and not name.endswith("__"):
                bad.append(f"{where} imports the private name {module}:{name}")
            private_at = [i for i, p in enumerate(module.split(".")) if p.startswith("_")]
            if private_at:
                owner = ".".join(module.split(".")[: private_at[0]])
                if my_package != owner and not my_package.startswith(owner + "."):
                    bad.append(f"{where} imports the private module {module} from outside "
                               f"{owner}")
    return bad


def import_cycles(edges: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan); ``edges``: module ->
    modules it imports (default: every import in ``tppc/``)."""
    edges = _edges() if edges is None else edges
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


def test_every_package_has_a_floor() -> None:
    for path in _files():
        floor_of(module_name(path))


def test_the_map_names_the_tree() -> None:
    """Every floor of docs/layout.md is a package or module on disk, and so is every rule's."""
    on_disk = {p.stem if p.suffix else p.name for p in ROOT.iterdir()
               if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert set(FLOORS) | set(TOP) == on_disk, (set(FLOORS) | set(TOP)) ^ on_disk
    assert FORBIDDEN and all(pkg in FLOORS and never <= set(FLOORS)
                             for pkg, never in FORBIDDEN.items()), FORBIDDEN


def test_the_map_is_read_from_its_tables() -> None:
    """A floor table out of order is refused; a rule row gives the packages it names."""
    with pytest.raises(AssertionError, match="not 0, 1, 2"):
        read_floors("| 0 | `tppc/errors.py` | x |\n| 2 | `tppc/ir` | y |\n")
    assert read_forbidden("| `tppc/planner` | `tppc/passes`, `tppc/frontend` | z |\n") == {
        "planner": frozenset({"passes", "frontend"})}


def test_imports_point_down() -> None:
    bad = upward_imports()
    assert not bad, "imports that run up:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_crosses_a_module() -> None:
    bad = private_imports()
    assert not bad, "private imports:\n" + "\n".join(bad)


def test_no_package_is_named_like_a_public_function() -> None:
    import tppc

    public = {n for n in tppc.__all__ if callable(getattr(tppc, n)) and n[0].islower()}
    packages = {p.stem if p.suffix else p.name for p in ROOT.iterdir()
                if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not public & packages, f"modules named like public functions: {public & packages}"


def test_an_upward_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself fails on a planner module that imports the pipeline."""
    fake = tmp_path / "tppc"
    (fake / "planner").mkdir(parents=True)
    (fake / "pipeline").mkdir()
    for pkg in ("", "planner", "pipeline"):
        (fake / pkg / "__init__.py").write_text("")
    (fake / "pipeline" / "compiled.py").write_text("X = 1\n")
    (fake / "planner" / "plan.py").write_text(
        "def f():\n    from tppc.pipeline.compiled import X\n    return X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert any("tppc/planner/plan.py:2 imports tppc.pipeline.compiled:X" in b
               for b in upward_imports())
    (fake / "pipeline" / "compiled.py").write_text("from tppc.pipeline.other import _y\n")
    (fake / "pipeline" / "other.py").write_text("from tppc.pipeline.compiled import *\n_y = 1\n")
    assert import_cycles() == [["tppc.pipeline.compiled", "tppc.pipeline.other"]]
    assert private_imports() == ["tppc/pipeline/compiled.py:1 imports the private name "
                                 "tppc.pipeline.other:_y"]


def test_tppc_loads_an_artifact_without_torch(tmp_path: Path) -> None:
    """``import tppc`` and ``tppc.load`` work where ``import torch`` fails."""
    code = textwrap.dedent(f"""
        import builtins, sys
        real = builtins.__import__
        def no_torch(name, *a, **k):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is not installed here")
            return real(name, *a, **k)
        builtins.__import__ = no_torch
        import tppc
        runner = tppc.load({str(tmp_path / "art")!r})
        import numpy as np
        out = runner(np.arange(12, dtype=np.int64).reshape(1, 12) % 50)
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
        print("ok", sorted(out) if isinstance(out, dict) else type(out).__name__)
    """)
    import torch

    import tppc
    from tppc.examples import gpt

    model, args, kwargs = gpt(seq_len=12, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, kwargs, cluster="2xcpu", chunks=2)
    tppc.export(cp, tmp_path / "art")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok"), result.stdout


def subpackage_of(module: str) -> str:
    """``tppc.passes.chunking.bias_rows`` -> ``tppc.passes.chunking``; a module directly in a
    package (``tppc.passes.runner``, ``tppc.passes.chunking``) is its own unit."""
    return ".".join(module.split(".")[:3])


def subpackage_cycles() -> list[list[str]]:
    """Circles between the sub-packages of a package, each sub-package one node (chunking
    reads annotation's helpers, so annotation may never read chunking), less the lazy
    imports of :data:`LAZY_UPWARD`."""
    edges: dict[str, set[str]] = {}
    for me, targets in _edges().items():
        mine = edges.setdefault(subpackage_of(me), set())
        mine |= {subpackage_of(t) for t in targets
                 if (me, t) not in LAZY_UPWARD and subpackage_of(t) != subpackage_of(me)}
    return import_cycles(edges)


#: Function-level imports that run against the order of their package's sub-packages, each
#: with its reason; any other closes a circle and fails :func:`test_no_subpackage_cycles`.
LAZY_UPWARD: dict[tuple[str, str], str] = {
    ("tppc.artifact.core.loaded", "tppc.artifact.torch_runners.denoise"):
        "LoadedPipeline.denoise steps diffusers' (torch) schedulers: it imports torch only "
        "when called, so loading and plain calls stay torch-free",
}


def test_no_subpackage_cycles() -> None:
    cycles = subpackage_cycles()
    assert not cycles, "sub-package circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_a_subpackage_cycle_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sub-packages whose modules import each other without a module circle."""
    fake = tmp_path / "tppc"
    for pkg in ("", "passes", "passes/annotation", "passes/chunking"):
        (fake / pkg).mkdir(parents=True, exist_ok=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "passes" / "annotation" / "a.py").write_text("X = 1\n")
    (fake / "passes" / "annotation" / "b.py").write_text(
        "def f():\n    from tppc.passes.chunking.c import Y\n    return Y\n")
    (fake / "passes" / "chunking" / "c.py").write_text(
        "from tppc.passes.annotation.a import X\nY = X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert import_cycles() == []
    assert subpackage_cycles() == [["tppc.passes.annotation", "tppc.passes.chunking"]]


#: Packages that never import torch, nor at module level a ``tppc`` module that does: what
#: ``tppc.load`` and ``tppc run`` need on a machine without torch.
TORCH_FREE: tuple[str, ...] = ("tppc.artifact.core",)


def _run_on_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported (none inside a function or
    under ``if TYPE_CHECKING``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            found.append(stmt)
        elif isinstance(stmt, ast.If):
            checking = "TYPE_CHECKING" in ast.unparse(stmt.test)
            todo += stmt.orelse if checking else [*stmt.body, *stmt.orelse]
        elif isinstance(stmt, ast.Try | ast.With | ast.ClassDef):
            for block in ("body", "orelse", "finalbody"):
                todo += getattr(stmt, block, [])
            for handler in getattr(stmt, "handlers", []):
                todo += handler.body
    return found


def _torch_lines(nodes: list[ast.AST]) -> list[int]:
    """The lines of the ``import torch...`` and ``from torch... import`` among ``nodes``."""
    lines = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        if any(n == "torch" or n.startswith("torch.") for n in names):
            lines.append(node.lineno)
    return lines


def torch_imports() -> list[str]:
    """Modules of :data:`TORCH_FREE` that import torch (at any depth of their own file), or
    import at module level a ``tppc`` module that imports torch at module level."""
    files = {module_name(p): p for p in _files()}
    bad = []
    for me, path in files.items():
        if not any(me == p or me.startswith(p + ".") for p in TORCH_FREE):
            continue
        bad += [f"{path.relative_to(ROOT.parent)}:{line} imports torch"
                for line in _torch_lines(list(ast.walk(ast.parse(path.read_text()))))]
        seen, todo = {me}, [(me, (me,))]
        while todo:
            module, chain = todo.pop()
            tree = ast.parse(files[module].read_text())
            on_import = _run_on_import(tree)
            if module != me and _torch_lines(on_import):
                bad.append(f"{me} imports torch through {' -> '.join(chain)}")
                continue
            lines = {n.lineno for n in on_import}
            for target, _name, line in imports_of(files[module]):
                while target not in files and "." in target:
                    target = target.rpartition(".")[0]
                if line in lines and target in files and target not in seen:
                    seen.add(target)
                    todo.append((target, (*chain, target)))
    return bad


def test_the_torch_free_core_imports_no_torch() -> None:
    bad = torch_imports()
    assert not bad, "torch in the torch-free packages:\n" + "\n".join(bad)


def test_a_torch_import_in_the_core_is_caught(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A function-level ``import torch`` in the core, and a module-level one a step away."""
    fake = tmp_path / "tppc"
    for pkg in ("", "artifact", "artifact/core", "backends"):
        (fake / pkg).mkdir(parents=True, exist_ok=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "artifact" / "core" / "load.py").write_text(
        "from tppc.backends.ort import X\n\ndef f():\n    import torch.nn\n    return X\n")
    (fake / "backends" / "ort.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\nX = 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    assert torch_imports() == ["tppc/artifact/core/load.py:4 imports torch"]
    (fake / "backends" / "ort.py").write_text("from torch import fx\nX = 1\n")
    assert torch_imports() == [
        "tppc/artifact/core/load.py:4 imports torch",
        "tppc.artifact.core.load imports torch through tppc.artifact.core.load -> "
        "tppc.backends.ort"]
