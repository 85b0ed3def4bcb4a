"""The CI tier keeps every test module: a ``slow`` test widens a net, never removes the only one.

``bash scripts/test.sh`` (CI) deselects tests marked ``pytest.mark.slow`` (by a decorator, or
listed in ``tests/ci_skips.txt``); ``--all`` runs them. Read from the source (no import, no
collection): a module may not mark itself slow as a whole, at least one of its test functions
must run in CI, and every listed skip must name a test that exists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import CI_TIER_SKIPS, listed_skips

TESTS = Path(__file__).resolve().parents[1]
MODULES = sorted(TESTS.rglob("test_*.py"))
SKIPS = listed_skips()


def _is_slow(node: ast.expr) -> bool:
    """``pytest.mark.slow``, or a call of it (``pytest.mark.slow(reason=...)``)."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "slow" and (
        isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def _tests(tree: ast.Module) -> list[ast.FunctionDef]:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("Test")):
        found += [n for n in cls.body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    return found


def _module_marks(tree: ast.Module) -> list[ast.expr]:
    marks: list[ast.expr] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            value = node.value
            marks += list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return marks


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(TESTS)))
def test_every_module_keeps_an_unmarked_test_in_ci(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not any(_is_slow(m) for m in _module_marks(tree)), (
        f"{path.name} marks every test slow (pytestmark): CI would run none of it; mark the "
        "tests that widen the net one by one")
    tests = _tests(tree)
    prefix = f"{path.relative_to(TESTS.parent)}::"
    unmarked = [t.name for t in tests if not any(_is_slow(d) for d in t.decorator_list)
                and prefix + t.name not in SKIPS]
    assert not tests or unmarked, (
        f"every test of {path.name} is marked slow, so CI checks none of what it covers: "
        f"leave the cheapest end-to-end one ({min(tests, key=lambda t: t.lineno).name}?) unmarked")


def test_every_listed_skip_names_a_test_that_exists() -> None:
    for nodeid in sorted(SKIPS):
        file, _, name = nodeid.partition("::")
        path = TESTS.parent / file
        assert path.is_file(), f"{CI_TIER_SKIPS.name}: {nodeid} names no file {file}"
        names = {t.name for t in _tests(ast.parse(path.read_text()))}
        assert name.split("[", 1)[0] in names, (
            f"{CI_TIER_SKIPS.name}: {nodeid} names no test of {file}; remove or rename the line")


def test_the_checker_sees_a_slow_mark_and_a_module_mark() -> None:
    tree = ast.parse("import pytest\npytestmark = [pytest.mark.slow]\n"
                     "@pytest.mark.slow\ndef test_a(): pass\n"
                     "@pytest.mark.timeout(5)\ndef test_b(): pass\n")
    assert [_is_slow(m) for m in _module_marks(tree)] == [True]
    assert [any(_is_slow(d) for d in t.decorator_list) for t in _tests(tree)] == [True, False]
