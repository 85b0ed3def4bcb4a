"""The scripts in examples/ run as documented."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_quickstart_example_matches_eager(capsys) -> None:
    pytest.importorskip("transformers")
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("max |pipeline - eager| = "))
    assert float(line.rsplit("=", 1)[1]) <= 1e-4


def test_plan_llama70b_example_plans_on_meta(capsys, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr("sys.argv", ["plan_llama70b.py", "8xh100-sxm", "8192"])
    runpy.run_path(str(EXAMPLES / "plan_llama70b.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "seq_len=8192" in out and "8 stages" in out
