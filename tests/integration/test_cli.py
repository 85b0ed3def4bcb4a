"""The ``tppc`` command end to end: demo, graph, cost, plan, and its errors."""

from __future__ import annotations

import json

import pytest

from tppc.cli.main import main


def test_demo_quick_passes_its_checks(capsys) -> None:
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "pipeline vs eager: max |difference|" in out
    assert "warm-up on every step vs the serial loop" in out and "PSNR" in out
    assert "demo: all checks passed" in out


def test_graph_prints_the_layer_table(capsys) -> None:
    assert main(["graph", "tppc.examples:gpt"]) == 0
    out = capsys.readouterr().out
    assert "blocks.3" in out and "causal" in out


def test_cost_prints_a_report(capsys) -> None:
    assert main(["cost", "tppc.examples:gpt", "--cluster", "1xh100-sxm", "--chunk", "64"]) == 0
    assert "ridge point" in capsys.readouterr().out


def test_plan_prints_json(capsys) -> None:
    assert main(["plan", "tppc.examples:gpt", "--cluster", "2xh100-sxm", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seq_len"] == 64


def test_plan_takes_fixed_degrees(capsys) -> None:
    assert main(["plan", "tppc.examples:gpt", "--cluster", "4xcpu", "--stages", "2",
                 "--tensor-parallel", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [st["tensor_parallel"] for st in data["stages"]] == [2, 2]


def test_plan_writes_a_chrome_trace(tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "tppc.examples:gpt", "--cluster", "2xh100-sxm", "--trace", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"].startswith("chunk 0") for e in events)


def test_bad_factory_is_a_clear_error(capsys) -> None:
    assert main(["graph", "tppc.examples:nope"]) == 2
    assert "no callable 'nope'" in capsys.readouterr().err


def test_bad_cluster_lists_presets(capsys) -> None:
    assert main(["plan", "tppc.examples:gpt", "--cluster", "3xfoo"]) == 2
    assert "h100-sxm" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["graph"], ["nosuch"]])
def test_usage_errors_exit_2(argv) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
