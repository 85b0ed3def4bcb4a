"""cp.profile: every job predicted and measured; plan.timeline draws the Gantt chart."""

from __future__ import annotations

import pytest

import tppc
from tppc import examples
from tppc.cli.main import main


@pytest.fixture(scope="module")
def profiled():
    model, args, _ = examples.gpt(seq_len=64, n_layer=2)
    cp = tppc.compile(model, args, chunks=4, num_stages=2, executor="local")
    return cp, cp.profile(*args)


def test_profile_times_every_job_of_every_stage_in_pipeline_order(profiled):
    cp, prof = profiled
    assert [(j.stage, j.chunk) for j in prof.jobs] == [(s, c) for s in range(2) for c in range(4)]
    for j in prof.jobs:
        assert 0 <= j.measured_start < j.measured_end <= prof.measured
    for c in range(4):  # a chunk leaves stage 0 before it starts on stage 1
        first, second = prof.jobs[c], prof.jobs[4 + c]
        assert first.measured_end <= second.measured_start
    assert prof.predicted == pytest.approx(cp.plan.latency - cp.plan.warmup_seconds)
    assert f"{prof.predicted * 1e3:.2f} ms" in prof.table()
    assert cp.executor == "local"  # profiling did not change the pipeline


def test_timeline_writes_a_png_with_the_measured_run(profiled, tmp_path):
    pytest.importorskip("matplotlib")
    _, prof = profiled
    out = tppc.plan_timeline(prof.plan, tmp_path / "plan.png", measured=prof)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tppc_plan_png_draws_the_predicted_schedule(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main(["plan", "tppc.examples:gpt", "--cluster", "2xh100-sxm", "--png",
                 str(path)]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
