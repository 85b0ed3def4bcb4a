"""Intra-op workers: one worker runs a group of CPU devices' cores as its intra-op threads.

The candidate is priced on a calibration measured with ``k`` threads; here every such
calibration is synthetic (the suite's pinned 1-thread rates scaled), so each verdict follows
from the numbers given, never from this machine's speed. The suite's own pin has no
2-thread entry, so every other test plans exactly as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tppc
from tppc.cost_models.calibration_store import pinned
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.intra_op import intra_op_chain
from tppc.driver.options import CompileOptions
from tppc.driver.planning import length_planner
from tppc.errors import PlanError, SpecError
from tppc.examples.hf import hf_llama
from tppc.frontend.front_end import capture_front_end
from tppc.passes.sharding.annotate_shards import annotate_shards
from tppc.planner import Plan
from tppc.planner.configurations import intra_op_configurations
from tppc.program.cores import cores_per_device

SUITE_PIN = Path(__file__).parents[1] / "data" / "cpu_calibration.json"
RATES = ("fp32", "bf16", "vector", "bandwidth", "stream_bandwidth")


def _pin(tmp_path: Path, factor: float) -> Path:
    """The suite's pin plus ``"1t2"`` and ``"2t2"`` entries (one or two workers of 2
    threads): its 1-thread rates times ``factor``."""
    data = json.loads(SUITE_PIN.read_text())
    for workers in (1, 2):
        one = data[str(workers)]
        measured = {k: v * factor if k in RATES else v for k, v in one["measured"].items()}
        data[f"{workers}t2"] = {**one, "measured": measured, "description": f"x{factor}"}
    path = tmp_path / f"pin_{factor}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def front():
    model, args, kwargs = hf_llama(seq_len=32, layers=2)  # hidden 64, vocab 128, fp32
    fe = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    annotate_shards(fe.chunk)
    return fe


def _plan(front, monkeypatch, tmp_path, factor: float, **options) -> Plan:
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, factor)))
    opts = CompileOptions(cluster="2xcpu", time_limit=2.0, **options)
    return length_planner(opts)(front, 256)


def test_intra_op_configurations_are_groups_of_cpu_devices_only() -> None:
    [two] = intra_op_configurations(Cluster.parse("2xcpu"))
    assert (two.groups, two.intra_op, two.degrees, two.label) == (((0, 1),), 2, (1,), "IntraOp2")
    assert [c.groups for c in intra_op_configurations(Cluster.parse("4xcpu"))] == \
        [((0, 1), (2, 3)), ((0, 1, 2, 3),)]
    assert intra_op_configurations(Cluster.parse("2xh100-sxm")) == []
    with pytest.raises(PlanError, match="non-CPU"):
        intra_op_configurations(Cluster.parse("2xh100-sxm"), 2)
    with pytest.raises(PlanError, match="does not divide the 2 CPU devices"):
        intra_op_configurations(Cluster.parse("2xcpu"), 3)


def test_a_pin_without_k_threads_refuses_them_by_name() -> None:
    assert pinned(str(SUITE_PIN), 2)["measured"]["group_members"] == 2.0
    with pytest.raises(SpecError, match="'1t2'"):
        pinned(str(SUITE_PIN), 1, threads=2)


def test_the_candidate_is_priced_on_the_k_thread_spec(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 3.0)))
    two = json.loads(SUITE_PIN.read_text())["2"]["measured"]["fp32"]  # 2 workers at once
    chain = intra_op_chain(Cluster.parse("4xcpu"), ((0, 1), (2, 3)), 2)
    assert chain.num_devices == 2  # one worker a group
    assert chain.devices[0].matrix.peak_flops["fp32"] == pytest.approx(3.0 * two)


def test_the_planner_picks_intra_op_when_its_price_is_lower(front, monkeypatch,
                                                            tmp_path) -> None:
    plan = _plan(front, monkeypatch, tmp_path, 10.0)
    st = plan.stages[0]
    assert plan.degrees["intra_op"] == 2 and plan.degrees["tensor_parallel"] == 1
    assert (plan.num_stages, st.device_indices, st.tensor_parallel, st.workers) == \
        (1, (0, 1), 1, 1)
    text = plan.summary()
    assert "PP1 x TP1 x IntraOp2" in text and "stage 0 is one worker of 2 CPU devices'" in text
    assert "runner-up: " in text and "why: PP1 x TP1 x IntraOp2 predicts" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_the_planner_keeps_pp_or_tp_when_intra_op_costs_more(front, monkeypatch,
                                                             tmp_path) -> None:
    plan = _plan(front, monkeypatch, tmp_path, 0.3)
    assert plan.degrees["intra_op"] == 1
    c = plan.choice  # TP1, TP2 and IntraOp2 were all in the search
    assert c.searched + c.pruned + len(c.infeasible) == 3


def test_intra_op_can_be_excluded_or_forced(front, monkeypatch, tmp_path) -> None:
    assert _plan(front, monkeypatch, tmp_path, 10.0, intra_op=1).degrees["intra_op"] == 1
    forced = _plan(front, monkeypatch, tmp_path, 0.3, intra_op=2)
    assert forced.degrees["intra_op"] == 2 and forced.choice.searched == 1
    tp2 = _plan(front, monkeypatch, tmp_path, 10.0, tensor_parallel=2)
    assert (tp2.degrees["tensor_parallel"], tp2.degrees["intra_op"]) == (2, 1)
    with pytest.raises(SpecError, match="intra_op=2 and tensor_parallel=2"):
        CompileOptions(intra_op=2, tensor_parallel=2)
    with pytest.raises(PlanError, match="needs 4 CPU devices"):
        _plan(front, monkeypatch, tmp_path, 10.0, intra_op=2, num_stages=2)


def test_an_intra_op_stage_runs_exact_with_k_threads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 0.3)))  # forced anyway
    model, (ids,), _ = hf_llama(seq_len=32, layers=2)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", intra_op=2, executor="threads")
    worker = cp.program(ids.shape[1]).runners[0]
    assert (worker.intra_op, worker.threads) == (2, 2 * cores_per_device(2))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(cp(ids).logits, want, atol=1e-5, rtol=1e-5)
    seen: list[int] = []
    real, before = torch.set_num_threads, torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    real(worker.threads + 1)  # the caller's count differs from the worker's
    try:
        got = cp(ids, executor="local").logits
        assert worker.threads in seen  # set for the stage's computes
        assert torch.get_num_threads() == worker.threads + 1  # the caller's given back
    finally:
        real(before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_distributed_backend_refuses_intra_op_by_name() -> None:
    from tppc.distributed.pipeline import compile_distributed

    model, (ids,), _ = hf_llama(seq_len=32, layers=2)
    with pytest.raises(SpecError, match="intra_op=2: the distributed backend"):
        compile_distributed(model, (ids,), intra_op=2)


def test_tppc_plan_takes_intra_op(tmp_path, monkeypatch, capsys) -> None:
    from tppc.cli.main import main

    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 0.3)))
    assert main(["plan", "tppc.examples:gpt", "--cluster", "2xcpu", "--intra-op", "2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(st["intra_op"], st["device_indices"]) for st in data["stages"]] == [(2, [0, 1])]
    assert data["degrees"]["intra_op"] == 2 and data["schema"] == "tppc.plan/6"
