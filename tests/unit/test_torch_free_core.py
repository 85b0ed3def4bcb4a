"""The torch-free core: ``tppc.load`` and ``tppc run`` work on a machine without torch.

No module of :data:`TORCH_FREE` imports torch (at any depth of its own file), nor at module
level a ``tppc`` module that does (:mod:`import_graph` reads the imports); and ``import tppc``
plus ``tppc.load`` of an exported artifact run where ``import torch`` fails.

To see the test fail, add ``import torch`` inside any function of
``tppc/artifact/core/loaded.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import import_graph as graph
import pytest

from tests.torchless import run_without_torch

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
    files = {graph.module_name(p): p for p in graph.tppc_files()}
    bad = []
    for me, path in files.items():
        if not any(me == p or me.startswith(p + ".") for p in TORCH_FREE):
            continue
        bad += [f"{path.relative_to(graph.ROOT.parent)}:{line} imports torch"
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
            for target, _name, line in graph.imports_of(files[module]):
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
    monkeypatch.setattr(graph, "ROOT", fake)
    assert torch_imports() == ["tppc/artifact/core/load.py:4 imports torch"]
    (fake / "backends" / "ort.py").write_text("from torch import fx\nX = 1\n")
    assert torch_imports() == [
        "tppc/artifact/core/load.py:4 imports torch",
        "tppc.artifact.core.load imports torch through tppc.artifact.core.load -> "
        "tppc.backends.ort"]


def test_tppc_loads_an_artifact_without_torch(tmp_path: Path) -> None:
    """``import tppc`` and ``tppc.load`` work where ``import torch`` fails."""
    code = f"""
        import tppc
        runner = tppc.load({str(tmp_path / "art")!r})
        import numpy as np
        out = runner(np.arange(12, dtype=np.int64).reshape(1, 12) % 50)
        print("ok", sorted(out) if isinstance(out, dict) else type(out).__name__)
    """
    import torch

    import tppc
    from tppc.examples import gpt

    model, args, kwargs = gpt(seq_len=12, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, kwargs, cluster="2xcpu", chunks=2)
    tppc.export(cp, tmp_path / "art")
    out = run_without_torch(code)
    assert out.startswith("ok"), out
