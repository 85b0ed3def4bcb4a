"""Intra-op workers for diffusion transformers: the DiT planner prices one worker of ``k``
threads (alone, or as each worker of a CFG / Ring / Ulysses mesh) beside CFG, Ulysses, Ring
and PipeFusion, on a ``k``-thread calibration.

Every ``k``-thread calibration here is synthetic (the suite's pinned 1-thread rates scaled,
``tests/unit/test_intra_op.py``'s ``_pin``), so each verdict follows from the numbers given;
the suite's own pin has no ``"1t2"`` entry, so every other DiT test plans as before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tests.unit.test_dit_planner import ROWS, WORKLOAD, _front
from tests.unit.test_intra_op import SUITE_PIN, _pin
from tests.unit.test_mesh_programs import _guided_dit
from tppc.driver.options import CompileOptions
from tppc.driver.planning import length_planner
from tppc.errors import PlanError, SpecError
from tppc.planner import Plan
from tppc.planner.mesh_configurations import FixedDegrees, MeshLimits, mesh_configurations
from tppc.program.cores import cores_per_device

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def guided():
    """A PixArt-shaped transformer captured on meta, a guided batch of 2 (6 heads)."""
    return _front(2)


def _plan(front, monkeypatch, tmp_path, factor: float | None, cluster: str = "2xcpu",
          **options) -> Plan:
    """The DiT planner's plan under a pin whose 2-thread rates are ``factor`` x the 1-thread
    ones (None: the suite's pin, without 2-thread entries)."""
    pin = SUITE_PIN if factor is None else _pin(tmp_path, factor)
    monkeypatch.setenv("TPPC_CALIBRATION", str(pin))
    opts = CompileOptions.from_kwargs(cluster=cluster, time_limit=2.0, **options)
    return length_planner(opts)(front, ROWS, workload=WORKLOAD)


def test_the_mesh_configurations_have_an_intra_op_axis_on_cpu_clusters_only() -> None:
    limits = MeshLimits(heads=(6,), shard_sizes=(), batch=2, tokens=1024)
    labels = [c.label for c in mesh_configurations(tppc.Cluster.parse("2xcpu"), limits)[0]]
    assert "IntraOp2" in labels and "CFG2 x TP1" in labels
    four = {c.label: c for c in mesh_configurations(tppc.Cluster.parse("4xcpu"), limits)[0]}
    both = four["CFG2 x IntraOp2"]
    assert (both.groups, both.token_workers, both.degrees) == (((0, 1, 2, 3),), 2, (1,))
    assert four["IntraOp2"].groups == ((0, 1), (2, 3)) and "IntraOp4" in four
    gpus = mesh_configurations(tppc.Cluster.parse("2xh100-sxm"), limits)[0]
    assert all(c.intra_op == 1 for c in gpus)
    job = mesh_configurations(tppc.Cluster.parse("2xcpu"), limits,
                              FixedDegrees(every_device=True))[0]
    assert all(c.intra_op == 1 for c in job)  # a rank per device: no intra-op workers


def test_the_planner_picks_intra_op_when_its_price_is_lower(guided, monkeypatch,
                                                            tmp_path) -> None:
    plan = _plan(guided, monkeypatch, tmp_path, 10.0)
    st = plan.stages[0]
    assert plan.degrees["intra_op"] == 2 and plan.degrees["cfg_parallel"] == 1
    assert (plan.num_stages, st.device_indices, st.workers) == (1, (0, 1), 1)
    text = plan.summary()
    assert "why: PP1 x TP1 x IntraOp2 predicts" in text and "runner-up: " in text
    assert "stage 0 is one worker of 2 CPU devices'" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_the_planner_keeps_cfg_when_intra_op_costs_more(guided, monkeypatch, tmp_path) -> None:
    plan = _plan(guided, monkeypatch, tmp_path, 0.3)
    assert plan.degrees["intra_op"] == 1 and plan.degrees["cfg_parallel"] == 2
    c = plan.choice  # PipeFusion, CFG2, Ring2 (two forms), Ulysses2, TP2, and IntraOp2
    without = _plan(guided, monkeypatch, tmp_path, 0.3, intra_op=1).choice
    assert c.searched + c.pruned + len(c.infeasible) == 7 == \
        without.searched + without.pruned + len(without.infeasible) + 1


def test_products_with_intra_op_on_a_larger_cpu_cluster(guided, monkeypatch, tmp_path) -> None:
    plan = _plan(guided, monkeypatch, tmp_path, 10.0, cluster="4xcpu")
    st = plan.stages[0]
    assert (plan.degrees["cfg_parallel"], plan.degrees["intra_op"]) == (2, 1 * 2)
    assert (st.workers, st.group_size, st.device_indices) == (2, 4, (0, 1, 2, 3))
    text = plan.summary()
    assert "PP1 x CFG2 x TP1 x IntraOp2" in text and "2 workers on 4 devices" in text
    assert any("IntraOp4" in r and "'1t4'" in r for r in plan.choice.infeasible)  # no pin
    assert Plan.from_json(plan.to_json()) == plan


def test_a_pin_without_k_threads_skips_or_refuses_intra_op_by_name(guided, monkeypatch,
                                                                    tmp_path) -> None:
    plan = _plan(guided, monkeypatch, tmp_path, None)
    assert plan.degrees["intra_op"] == 1
    assert any(r.startswith("IntraOp2: ") and "'1t2'" in r for r in plan.choice.infeasible)
    with pytest.raises(SpecError, match="'1t2'"):
        _plan(guided, monkeypatch, tmp_path, None, intra_op=2)


@pytest.mark.parametrize(("cluster", "options", "error", "words"), [
    ("2xh100-sxm", {"intra_op": 2}, PlanError, "intra_op=2: the cluster '2xh100-sxm"),
    ("2xcpu", {"intra_op": 3}, PlanError, "intra_op=3 does not divide"),
    ("2xcpu", {"intra_op": 2, "cfg_parallel": 2}, PlanError, "x 2 intra-op, 1 stage"),
    ("2xcpu", {"intra_op": 2, "tensor_parallel": 2}, SpecError, "intra_op=2 and tensor_p"),
])
def test_intra_op_degrees_the_cluster_cannot_hold_are_refused_by_name(
        guided, monkeypatch, tmp_path, cluster, options, error, words) -> None:
    with pytest.raises(error, match=words):
        _plan(guided, monkeypatch, tmp_path, 10.0, cluster=cluster, **options)


def test_a_stage_plan_refuses_intra_op_with_tensor_parallel_workers(guided, monkeypatch,
                                                                     tmp_path) -> None:
    st = _plan(guided, monkeypatch, tmp_path, 10.0).stages[0]
    with pytest.raises(PlanError, match="intra_op=2 with TP2 x IntraOp2"):
        dataclasses.replace(st, tensor_parallel=2, device_indices=(0, 1, 2, 3))


@pytest.fixture(scope="module")
def dit_case():
    model, args = _guided_dit()
    x, _, y = args
    with torch.no_grad():
        want = model(*args)
    loop = serial_denoise(model, x, diffusers.DDIMScheduler(), 3, timestep_arg="t",
                          model_kwargs={"y": y})
    return model, args, want, loop


@pytest.mark.parametrize(("cluster", "degrees"), [("2xcpu", {}), ("4xcpu", {"cfg_parallel": 2})],
                         ids=["intra2", "cfg2xintra2"])
def test_an_intra_op_dit_plan_is_exact_and_its_workers_run_k_threads(
        dit_case, monkeypatch, tmp_path, cluster, degrees) -> None:
    model, args, want, loop = dit_case
    x, _, y = args
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 0.3)))  # forced anyway
    cp = tppc.compile(model, args, cluster=cluster, executor="threads", intra_op=2,
                      verify=False, **degrees)  # checked against eager below
    assert cp.plan.degrees["intra_op"] == 2
    program = cp.program(cp.plan.seq_len)
    share = cores_per_device(int(cluster[0]))
    assert [(w.intra_op, w.threads) for w in program.runners] == \
        [(2, 2 * share)] * (degrees.get("cfg_parallel", 1))
    assert_kernels_close(cp(*args), want)
    run = {"timestep_arg": "t", "model_kwargs": {"y": y}}
    for executor in ("threads", "local") if degrees else ("threads",):  # one worker: local
        warm = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=None,
                          executor=executor, **run)
        assert_kernels_close(warm, loop, depth=3)


def test_stale_patches_of_one_intra_op_worker_run_with_its_threads(dit_case, monkeypatch,
                                                                   tmp_path) -> None:
    """The pipelined steps of a one-worker plan run in the calling thread: with the
    worker's ``k`` threads, the caller's count given back; the result is the one-device
    plan's (threads split ops, they change nothing else)."""
    model, args, _, _ = dit_case
    x, _, y = args
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 0.3)))
    run = {"warmup_steps": 1, "patches": 2, "timestep_arg": "t", "model_kwargs": {"y": y}}
    cp = tppc.compile(model, args, cluster="2xcpu", intra_op=2, verify=False)
    one = tppc.compile(model, args, cluster="1xcpu", verify=False)
    want = one.denoise(x, diffusers.DDIMScheduler(), 3, **run)
    worker = cp.program(cp.plan.seq_len).runners[0]
    seen: list[int] = []
    real, before = torch.set_num_threads, torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    real(worker.threads + 1)  # the caller's count differs from the worker's
    try:
        got = cp.denoise(x, diffusers.DDIMScheduler(), 3, **run)
        assert seen.count(worker.threads) >= 3  # the warm step and both stale patches
        assert torch.get_num_threads() == worker.threads + 1
    finally:
        real(before)
    assert_kernels_close(got, want, depth=3)
