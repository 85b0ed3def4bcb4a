"""Stages on devices that share one memory pool are charged together.

The ``cpu`` devices of one node are cores of one machine and share its RAM
(:meth:`tppc.cost_models.cluster.Cluster.memory_pools`); the planner charged each stage
against its device's whole RAM, so two stages that each fit alone were planned on one
machine that cannot hold both. Numbers by hand from :func:`tests.unit.planner_helpers.table`:
4 layers of 10**9 weight bytes + 100 K/V bytes a token at 1024 tokens (1 000 102 400 bytes
each), the last layer's outputs kept (1000 bytes a token: 1 024 000), in-flight chunks of
3 · 1000 bytes a token on every stage (queue depth 2 + the running chunk).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.planner_helpers import table
from tests.unit.test_intra_op import _pin
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.intra_op import intra_op_chain
from tppc.errors import PlanInfeasible
from tppc.planner import plan_from_costs
from tppc.planner.memory import over_capacity
from tppc.planner.placement import place_layers
from tppc.planner.workload import Workload

STATIC = 4 * (10**9 + 100 * 1024) + 1000 * 1024  # every layer's, whichever stage holds it
PER_TOKEN = 2 * 3 * 1000  # in-flight chunk bytes a token, both stages


def _pooled(capacity: int, pools: tuple[int, ...] = (0, 0)):
    return dataclasses.replace(table(num_layers=4, capacity=capacity, weight_bytes=10**9),
                               pools=pools)


def test_the_cpu_devices_of_one_node_share_one_pool(tmp_path, monkeypatch) -> None:
    assert Cluster.parse("3xcpu").memory_pools() == (0, 0, 0)
    assert Cluster.parse("2x(2xcpu)@eth-100g").memory_pools() == (0, 0, 1, 1)  # per node
    assert Cluster.parse("2xh100-sxm").memory_pools() == (0, 1)
    # intra-op workers keep their nodes: a group of each node's two devices, a pool each
    monkeypatch.setenv("TPPC_CALIBRATION", str(_pin(tmp_path, 1.0)))
    chain = intra_op_chain(Cluster.parse("2x(2xcpu)@eth-100g"), ((0, 1), (2, 3)), 2)
    assert (chain.nodes, chain.memory_pools()) == ((0, 1), (0, 1))
    assert intra_op_chain(Cluster.parse("4xcpu"), ((0, 1), (2, 3)), 2).memory_pools() == (0, 0)


@pytest.mark.parametrize("method", ["exhaustive", "alternate"])  # split masks; DP + MILP
def test_two_stages_that_fit_alone_but_not_together_are_infeasible(method: str) -> None:
    # 3 GB a machine: either half fits alone (at most 2.0013 GB with 64-token chunks), both
    # halves need the 4.0014 GB of static bytes alone
    alone = plan_from_costs(_pooled(3 * 10**9, pools=()), num_stages=2, granularity=64,
                            time_limit=5, method=method)
    assert not alone.notes and max(st.memory_bytes for st in alone.stages) <= 3 * 10**9
    with pytest.raises(PlanInfeasible, match=r"devices 0, 1 share one memory pool .*together "
                       r"they need 4\.00 GB, capacity 3\.00 GB  <-- over\nmore devices of"):
        plan_from_costs(_pooled(3 * 10**9), num_stages=2, granularity=64, time_limit=5,
                        method=method)


@pytest.mark.parametrize("method", ["exhaustive", "alternate"])
def test_a_pool_bounds_the_chunks_of_its_stages_together(method: str) -> None:
    # 4.003 GB shared: less the 4 001 433 600 static bytes, 1 566 400 are left for both
    # stages' in-flight chunks, 6000 bytes a token: chunks of at most 261 tokens (256 on a
    # grid of 64); each stage alone would take chunks of 1024
    cap = 4_003_000_000
    alone = plan_from_costs(_pooled(cap, pools=()), num_stages=2, granularity=64,
                            time_limit=5, method=method)
    plan = plan_from_costs(_pooled(cap), num_stages=2, granularity=64, time_limit=5,
                           method=method)
    assert max(plan.chunk_sizes) <= 256 < max(alone.chunk_sizes) and not plan.notes
    assert STATIC + PER_TOKEN * max(plan.chunk_sizes) <= cap


def test_over_capacity_names_the_pool_and_its_summed_need() -> None:
    t = _pooled(100, pools=(0, 0))
    assert over_capacity(t, [(0, 60), (1, 50)]) == [((0, 1), 110.0, 100)]
    assert over_capacity(dataclasses.replace(t, pools=()), [(0, 60), (1, 50)]) == []


def test_the_placement_milp_charges_a_pool_once_for_all_its_stages() -> None:
    # layer 0 three times slower: alone, stage 0 takes it and stage 1 the rest, (0, 1, 4).
    # Layers 0 and 1 hold 10**6 bytes a chunk token more (their intermediates), so with
    # chunks of 512 (0, 1, 4) needs 1 513 638 400 + 3 514 867 200 = 5 028 505 600 bytes,
    # (0, 2, 4) 2 513 740 800 + 2 002 764 800 = 4 516 505 600: only it fits 4.8 GB shared.
    # (The balanced start overfilled the pool too and was refused as infeasible.)
    t = table(num_layers=4, weight_bytes=10**9, layer_scales=(3, 1, 1, 1),
              capacity=4_800_000_000)
    t = dataclasses.replace(t, layers=tuple(
        tuple(dataclasses.replace(lc, peak_bytes_per_token=10**6 if j < 2 else 0)
              for j, lc in enumerate(row)) for row in t.layers))
    alone = place_layers(t, (0, 512, 1024), 2, Workload(), time_limit=5)[0]
    pooled = place_layers(dataclasses.replace(t, pools=(0, 0)), (0, 512, 1024), 2,
                          Workload(), time_limit=5)[0]
    assert (alone, pooled) == ((0, 1, 4), (0, 2, 4))
