"""``time_limit`` of ``tppc.plan`` covers pricing: the solver gets what pricing left.

These run one configuration (``tensor_parallel=1``); the hybrid search shares the limit among
its configurations (:mod:`tppc.planner.hybrid`).

Pricing is made to look slow with a clock that only the planning grid reads (pricing
advances it), so the tests do not depend on how fast this machine prices or solves.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest

import tppc
import tppc.planner.grid as grid_module
from tppc import examples
from tppc.driver import planning
from tppc.planner.grid import MIN_SOLVE_SECONDS


@pytest.fixture
def slow_pricing(monkeypatch):
    """``seconds(s)`` makes each cost table take ``s`` more seconds on the grid's clock;
    returns the time limits the solver was given."""
    offset = [0.0]
    limits: list[float] = []
    monkeypatch.setattr(grid_module, "time",
                        SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0]))
    real_price, real_solve = planning.build_cost_table, grid_module.plan_from_costs
    extra = [0.0]

    def price(*args, **kwargs):
        table = real_price(*args, **kwargs)
        offset[0] += extra[0]
        return table

    def solve(*args, time_limit, **kwargs):
        limits.append(time_limit)
        return real_solve(*args, time_limit=time_limit, **kwargs)

    monkeypatch.setattr(planning, "build_cost_table", price)
    monkeypatch.setattr(grid_module, "plan_from_costs", solve)

    def seconds(s: float) -> list[float]:
        extra[0] = s
        return limits

    return seconds


def _valid(plan, num_layers: int, seq_len: int) -> None:
    assert plan.boundaries[0] == 0 and plan.boundaries[-1] == seq_len
    assert all(a < b for a, b in itertools.pairwise(plan.boundaries))
    ranges = [(st.layer_start, st.layer_end) for st in plan.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert plan.latency > 0


def test_the_solver_gets_what_pricing_left_of_the_time_limit(slow_pricing):
    limits = slow_pricing(0.6)
    model, args, _ = examples.gpt(seq_len=64, n_layer=2)
    tppc.plan(model, args, cluster="2xcpu", time_limit=1.0, tensor_parallel=1)
    assert len(limits) == 1
    assert MIN_SOLVE_SECONDS <= limits[0] <= 0.4


def test_pricing_past_the_time_limit_gives_a_valid_plan_that_says_time_limit(slow_pricing):
    """The solver gets its minimum; 286 placements cannot all be searched in it, so the
    plan is the incumbent and its status says ``time_limit``."""
    limits = slow_pricing(5.0)
    model, args, _ = examples.gpt(seq_len=1024, n_layer=12)
    plan = tppc.plan(model, args, cluster="4xh100-sxm", time_limit=1.0, tensor_parallel=1)
    assert limits == [MIN_SOLVE_SECONDS]
    assert plan.solver.status == "time_limit", plan.solver
    _valid(plan, plan.stages[-1].layer_end, 1024)


def test_a_plan_within_its_time_limit_keeps_its_status(slow_pricing):
    limits = slow_pricing(0.0)
    model, args, _ = examples.gpt(seq_len=64, n_layer=2)
    plan = tppc.plan(model, args, cluster="2xcpu", time_limit=30.0, tensor_parallel=1)
    assert limits[0] > 29.0
    assert plan.solver.status == "optimal"
