"""The hybrid planner (tensor parallel x pipeline x replicas) on hand-built cost tables, its
configurations, the plan's new fields and the options that fix the degrees."""

from __future__ import annotations

import dataclasses
import json

import pytest
from planner_helpers import table

from tppc.cost_models.cluster import Cluster
from tppc.driver.options import CompileOptions
from tppc.errors import PlanError, PlanInfeasible, SpecError
from tppc.planner import Plan, StagePlan, Workload, plan_from_costs
from tppc.planner.configurations import (
    Configuration,
    check_degree,
    fixed_configuration,
    tp_configurations,
)
from tppc.planner.grid import plan_any_length
from tppc.planner.hybrid import plan_hybrid

PP2 = Configuration(((0,), (1,)))
TP2 = Configuration(((0, 1),))
L = 1024


def _plan_table(calls: list | None = None):
    def plan_table(t, stages, seconds, _config):
        if calls is not None:
            calls.append(t.device_names)
        return plan_any_length(lambda _n: t, L, granularity=64, num_stages=stages,
                               time_limit=seconds)
    return plan_table


def _prices(tp_speed: float, **tp_kw):
    """TP1: two devices of speed 1 (a chain); TP2: one group ``tp_speed`` times faster."""
    tables = {PP2: table(4, (1.0, 1.0), seq_len=L),
              TP2: dataclasses.replace(table(4, (tp_speed,), seq_len=L, **tp_kw),
                                       device_names=("grp",))}
    return lambda config: (tables[config], ("1 all_reduce of 256 B/token",) * 4)


def _hybrid(tp_speed: float, objective: str = "latency", calls=None, **tp_kw) -> Plan:
    return plan_hybrid([PP2, TP2], _prices(tp_speed, **tp_kw), _plan_table(calls),
                       cluster=Cluster.parse("2xh100-sxm"), granularity=64,
                       objective=objective, time_limit=5.0)


def _alone(config: Configuration, tp_speed: float) -> Plan:
    t, _ = _prices(tp_speed)(config)
    return plan_from_costs(t, granularity=64, time_limit=5.0)


def test_tensor_parallel_wins_when_the_group_is_faster_than_any_pipeline() -> None:
    plan = _hybrid(3.0)  # a pipeline of two devices of speed 1 is at most 2x faster
    assert plan.degrees == {"num_stages": 1, "tensor_parallel": 2, "cfg_parallel": 1, "ulysses": 1, "ring": 1, "intra_op": 1, "replicas": 1}
    assert plan.stages[0].device_indices == (0, 1)
    assert plan.latency == pytest.approx(_alone(TP2, 3.0).latency)
    assert plan.latency < _alone(PP2, 3.0).latency


def test_the_pipeline_wins_when_the_group_barely_speeds_up() -> None:
    plan = _hybrid(1.05)
    assert plan.degrees == {"num_stages": 2, "tensor_parallel": 1, "cfg_parallel": 1, "ulysses": 1, "ring": 1, "intra_op": 1, "replicas": 1}
    assert [st.device_indices for st in plan.stages] == [(0,), (1,)]
    assert plan.latency == pytest.approx(_alone(PP2, 1.05).latency)
    assert "TP2" in plan.choice.runner_up and "PP2 x TP1 predicts" in plan.choice.why


@pytest.mark.parametrize("speed", [1.05, 1.7, 3.0])
def test_the_bound_covers_every_configuration_searched(speed: float) -> None:
    plan = _hybrid(speed)
    for config in (PP2, TP2):
        assert plan.lower_bound <= _alone(config, speed).latency * (1 + 1e-9)
    assert plan.lower_bound <= plan.latency


def test_a_configuration_whose_bound_cannot_win_is_never_planned() -> None:
    calls: list = []
    plan = _hybrid(0.01, calls=calls)  # the group is 100x slower: its bound loses
    assert plan.degrees["tensor_parallel"] == 1
    assert calls == [("dev0", "dev1")] and plan.choice.pruned == 1


def test_throughput_per_device_prefers_replicas_of_one_device_over_a_group() -> None:
    plan = _hybrid(1.9, objective="throughput_per_device")  # 2 devices for 1.9x
    assert plan.degrees == {"num_stages": 1, "tensor_parallel": 1, "cfg_parallel": 1, "ulysses": 1, "ring": 1, "intra_op": 1, "replicas": 2}
    assert _hybrid(2.5, objective="throughput_per_device").degrees["tensor_parallel"] == 2


def test_memory_that_fits_only_in_the_group_picks_the_group() -> None:
    big = {PP2: table(4, (1.0, 1.0), seq_len=L, capacity=10**6, weight_bytes=10**6),
           TP2: table(4, (1.2,), seq_len=L, capacity=10**9)}
    plan = plan_hybrid([PP2, TP2], lambda c: (big[c], ()), _plan_table(),
                       cluster=Cluster.parse("2xh100-sxm"), granularity=64, time_limit=5.0)
    assert plan.degrees["tensor_parallel"] == 2
    assert any("PP* x TP1" in line for line in plan.choice.infeasible)
    with pytest.raises(PlanInfeasible):
        plan_hybrid([PP2], lambda c: (big[c], ()), _plan_table(),
                    cluster=Cluster.parse("2xh100-sxm"), granularity=64, time_limit=5.0)


def test_groups_across_nodes_only_when_nothing_inside_a_node_fits() -> None:
    small = table(4, (1.0, 1.0), seq_len=L, capacity=10**6, weight_bytes=10**6)
    wide = table(4, (1.5,), seq_len=L)
    cluster = Cluster.parse("2x(1xh100-sxm)@ib-ndr")
    across = Configuration(((0, 1),), spans_nodes=True)
    plan = plan_hybrid([PP2], lambda c: (small if c == PP2 else wide, ()), _plan_table(),
                       cluster=cluster, granularity=64, time_limit=5.0, across=[across])
    assert plan.stages[0].device_indices == (0, 1)
    assert "inter-node link" in plan.choice.spans_nodes
    assert "groups cross the inter-node link" in plan.summary()


def test_configurations_of_a_cluster() -> None:
    assert [c.label for c in tp_configurations(Cluster.parse("2xcpu"), (4, 2))] == ["TP1", "TP2"]
    assert [c.label for c in tp_configurations(Cluster.parse("4xh100-sxm"), (6,))] == \
        ["TP1", "TP2"]  # 4 does not divide 6
    mixed = tp_configurations(Cluster.parse("(2xh100-sxm)+(2xa100-80gb)@ib-hdr"), (4,))
    assert [c.degrees for c in mixed] == [(1, 1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 2)]
    h20 = Cluster.parse("4x(8xh20)@ib-ndr")
    assert [c.label for c in tp_configurations(h20, (128,))] == ["TP1", "TP2", "TP4", "TP8"]
    wide = tp_configurations(h20, (128,), across_nodes=True)
    assert [c.label for c in wide] == ["TP16", "TP32"] and all(c.spans_nodes for c in wide)


def test_fixed_degrees_make_groups_inside_nodes() -> None:
    h20 = Cluster.parse("4x(8xh20)@ib-ndr")
    tp8 = fixed_configuration(h20, (128,), 8, None)
    assert tp8.groups[1] == tuple(range(8, 16)) and not tp8.spans_nodes
    assert fixed_configuration(h20, (128,), 32, None).spans_nodes
    per = fixed_configuration(Cluster.parse("2x(6xh100-sxm)@ib-ndr"), (8,), (4, 4), None)
    assert per.groups == ((0, 1, 2, 3), (6, 7, 8, 9)) and per.fixed_stages == 2


def test_a_degree_that_does_not_divide_the_shard_sizes_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match=r"tensor_parallel=3 does not divide .*\[8, 32\].*fix: "
                                        r"one of \[1, 2, 4, 8\]"):
        check_degree(3, (32, 8))
    with pytest.raises(PlanError, match="nothing in this model was sharded"):
        check_degree(2, ())
    with pytest.raises(PlanError, match="needs 64 devices"):
        fixed_configuration(Cluster.parse("4x(8xh20)@ib-ndr"), (128,), 16, 4)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel": 0}, "tensor_parallel=0 must be an integer"),
    ({"tensor_parallel": (2, "a")}, "must be an integer ≥ 1"),
    ({"tensor_parallel": True}, "must be an integer"),
    ({"tensor_parallel": (2, 2), "num_stages": 3}, "names 2 stages, num_stages=3"),
    ({"objective": "fast"}, "objective='fast'"),
])
def test_option_errors_name_the_value_and_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        CompileOptions.from_kwargs(**kwargs)
    assert CompileOptions.from_kwargs(tensor_parallel=[2, 4]).tensor_parallel == (2, 4)


def test_workload_objective_is_checked() -> None:
    with pytest.raises(PlanError, match="objective='x'"):
        Workload(objective="x")


def test_hybrid_plan_json_round_trips_and_older_schemas_read() -> None:
    plan = _hybrid(3.0)
    back = Plan.from_json(plan.to_json())
    assert back == plan and back.stages[0].device_indices == (0, 1)
    data = json.loads(plan.to_json())
    assert data["schema"] == "tppc.plan/6" and data["degrees"]["tensor_parallel"] == 2
    old = _hybrid(1.05)
    data = json.loads(old.to_json())
    for key in ("degrees", "replicas", "choice"):
        data.pop(key)
    for st in data["stages"]:
        st.pop("tensor_parallel"), st.pop("device_indices")
    data["schema"] = "tppc.plan/2"
    data["workload"].pop("objective")
    read = Plan.from_json(json.dumps(data))
    assert read.degrees == {"num_stages": 2, "tensor_parallel": 1, "cfg_parallel": 1, "ulysses": 1, "ring": 1, "intra_op": 1, "replicas": 1}
    assert read.stages[1].device_indices == (1,)


def test_stage_groups_are_checked_and_follow_a_moved_device() -> None:
    st = StagePlan(index=0, layer_start=0, layer_end=1, device_index=2, device_name="x",
                   memory_bytes=0, capacity_bytes=1)
    assert dataclasses.replace(st, device_index=5).device_indices == (5,)
    with pytest.raises(PlanError, match=r"device_indices=.*must name 2 distinct devices \(TP2\)"):
        dataclasses.replace(st, tensor_parallel=2, device_indices=(3, 4))


def test_summary_shows_groups_degrees_collectives_and_the_runner_up() -> None:
    text = _hybrid(3.0).summary()
    assert "degrees PP1 x TP2 (2 devices)" in text
    assert "0-1" in text and "1 all_reduce of 256 B/token" in text
    assert "runner-up: TP1 (any number of stages): at least" in text


def test_degrees_may_differ_per_stage_on_a_mixed_cluster() -> None:
    mixed = Configuration(((0, 1), (2,)))  # an H100 pair, then one A100
    cluster = Cluster.parse("(2xh100-sxm)+(1xa100-80gb)@ib-hdr")
    rows = dataclasses.replace(table(4, (2.0, 1.0), seq_len=L), device_names=("grp", "a100"))
    plan = plan_hybrid([mixed], lambda c: (rows, ()), _plan_table(), cluster=cluster,
                       granularity=64, num_stages=2, time_limit=5.0)
    assert plan.degrees == {"num_stages": 2, "tensor_parallel": (2, 1), "cfg_parallel": 1, "ulysses": 1, "ring": 1, "intra_op": 1, "replicas": 1}
    assert [st.device_indices for st in plan.stages] == [(0, 1), (2,)]
    assert Plan.from_json(plan.to_json()).degrees == plan.degrees
    assert "PP2 x TP(2,1)" in plan.summary()


def test_charts_and_traces_name_a_stage_group() -> None:
    from tppc.report.trace import plan_trace

    names = [e["args"]["name"] for e in plan_trace(_hybrid(3.0))["traceEvents"]
             if e.get("name") == "thread_name"]
    assert names == ["stage 0 (grp TP2 (devices 0-1), layers [0, 4))"]
