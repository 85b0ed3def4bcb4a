"""The import layers of ``tppc/`` (docs/layout.md): imports point down, never in a circle, and
no private name crosses a module.

The floors and the forbidden imports are read from the two tables of ``docs/layout.md`` (the one
map of the packages). Every import in ``tppc/`` is read from the AST (module level, function
level and ``TYPE_CHECKING`` blocks alike; :mod:`import_graph`). A package may import its own
modules and any package on a lower floor of :data:`FLOORS`; anything else is an upward import.
Modules import each other without a circle (inside a package too), and so do the sub-packages
of a package, each taken as one node. A name with a leading underscore is imported only inside
its own module, and a module with a leading underscore only from its own package. The
torch-free core has its own tests (``test_torch_free_core.py``).

To see the test fail, add ``from tppc.pipeline.compiled import CompiledPipeline`` to any
function in ``tppc/planner/plan.py``: the planner (floor 8) may not import the in-process
pipeline (15).
"""

from __future__ import annotations

import re
from pathlib import Path

import import_graph as graph
import pytest
from import_graph import import_cycles, import_edges, imports_of, module_name, tppc_files

LAYOUT = graph.ROOT.parent / "docs" / "layout.md"
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


def floor_of(module: str) -> int:
    """The floor of a ``tppc`` module: its package's index in :data:`FLOORS`."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TOP:
        return len(FLOORS)
    if parts[1] not in FLOORS:
        raise AssertionError(f"{module}: package {parts[1]!r} has no floor; add it to the table "
                             "of docs/layout.md")
    return FLOORS.index(parts[1])


def upward_imports() -> list[str]:
    """Every import from a package to one on a higher floor (or to another top package)."""
    bad = []
    for path in tppc_files():
        me = module_name(path)
        mine = floor_of(me)
        for module, name, line in imports_of(path):
            theirs = floor_of(module)
            same_package = module.split(".")[:2] == me.split(".")[:2]
            forbidden = module.split(".")[1:2] and module.split(".")[1] in FORBIDDEN.get(
                me.split(".")[1] if "." in me else "", ())
            if theirs > mine or (theirs == mine and not same_package) or forbidden:
                what = f"{module}:{name}" if name else module
                bad.append(f"{path.relative_to(graph.ROOT.parent)}:{line} imports {what} "
                           f"(floor {mine} -> {theirs})")
    return bad


def private_imports() -> list[str]:
    """Private names imported from another module, private modules from another package."""
    bad = []
    for path in tppc_files():
        me = module_name(path)
        my_package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for module, name, line in imports_of(path):
            where = f"{path.relative_to(graph.ROOT.parent)}:{line}"
            if name is not None and name.startswith("_") and not name.endswith("__"):
                bad.append(f"{where} imports the private name {module}:{name}")
            private_at = [i for i, p in enumerate(module.split(".")) if p.startswith("_")]
            if private_at:
                owner = ".".join(module.split(".")[: private_at[0]])
                if my_package != owner and not my_package.startswith(owner + "."):
                    bad.append(f"{where} imports the private module {module} from outside "
                               f"{owner}")
    return bad


def test_every_package_has_a_floor() -> None:
    for path in tppc_files():
        floor_of(module_name(path))


def test_the_map_names_the_tree() -> None:
    """Every floor of docs/layout.md is a package or module on disk, and so is every rule's."""
    on_disk = {p.stem if p.suffix else p.name for p in graph.ROOT.iterdir()
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
    packages = {p.stem if p.suffix else p.name for p in graph.ROOT.iterdir()
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
    monkeypatch.setattr(graph, "ROOT", fake)
    assert any("tppc/planner/plan.py:2 imports tppc.pipeline.compiled:X" in b
               for b in upward_imports())
    (fake / "pipeline" / "compiled.py").write_text("from tppc.pipeline.other import _y\n")
    (fake / "pipeline" / "other.py").write_text("from tppc.pipeline.compiled import *\n_y = 1\n")
    assert import_cycles() == [["tppc.pipeline.compiled", "tppc.pipeline.other"]]
    assert private_imports() == ["tppc/pipeline/compiled.py:1 imports the private name "
                                 "tppc.pipeline.other:_y"]


def subpackage_of(module: str) -> str:
    """``tppc.passes.chunking.bias_rows`` -> ``tppc.passes.chunking``; a module directly in a
    package (``tppc.passes.runner``, ``tppc.passes.chunking``) is its own unit."""
    return ".".join(module.split(".")[:3])


def subpackage_cycles() -> list[list[str]]:
    """Circles between the sub-packages of a package, each sub-package one node (chunking
    reads annotation's helpers, so annotation may never read chunking), less the lazy
    imports of :data:`LAZY_UPWARD`."""
    edges: dict[str, set[str]] = {}
    for me, targets in import_edges().items():
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
    monkeypatch.setattr(graph, "ROOT", fake)
    assert import_cycles() == []
    assert subpackage_cycles() == [["tppc.passes.annotation", "tppc.passes.chunking"]]
