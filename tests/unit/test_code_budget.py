"""House rules checked in CI: module size, ``__all__``, future annotations (STYLE.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "tppc"
MODULES = sorted(ROOT.rglob("*.py"))
LINE_BUDGET = 450  # STYLE.md: "no file over ~400 lines without a reason"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_within_line_budget(path: Path) -> None:
    lines = path.read_text().count("\n")
    assert lines <= LINE_BUDGET, f"{path} has {lines} lines; split it by concern"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_declares_all_and_future_annotations(path: Path) -> None:
    text = path.read_text()
    assert "__all__" in text, f"{path} has no __all__"
    assert "from __future__ import annotations" in text, f"{path} lacks future annotations"
