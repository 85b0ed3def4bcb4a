"""The planning grid of any sequence length: a default granularity and one partial chunk.

Terms:
    grid: chunk boundaries are multiples of the granularity ``g``; a length that ``g`` does
        not divide is planned on the grid of ``⌈L / g⌉ · g`` tokens and its last boundary
        clipped to ``L`` (one shorter last chunk), then priced again at ``L``. The search
        reads the cost table of ``L`` as if it had ``⌈L / g⌉ · g`` tokens (one table per
        length, not two: pricing is most of a re-plan; the memory rule then holds the
        longer buffers); the plan, its latency and its bound are priced at ``L``. The
        granularity never drops to 1 because ``L`` is odd.
    time limit: a deadline for everything :func:`plan_any_length` does: pricing (the cost
        table) comes out of it, the solver gets what is left less
        :data:`~tppc.planner.polish.FINISH_RESERVE` of the limit (at most
        :data:`~tppc.planner.polish.FINISH_RESERVE_MAX` s), kept for pricing the plan
        at ``L`` after it (at least :data:`MIN_SOLVE_SECONDS`, to have a plan at all). A plan
        that ends after its deadline without a proven optimum says
        ``solver.status == "time_limit"``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from tppc.cost_models.table import CostTable
from tppc.errors import PlanError
from tppc.planner.devices import sub_table
from tppc.planner.evaluate import plan_for
from tppc.planner.joint import plan_from_costs
from tppc.planner.plan import Plan, say_expired
from tppc.planner.polish import FINISH_RESERVE, FINISH_RESERVE_MAX
from tppc.planner.workload import Workload

__all__ = ["MAX_DEFAULT_GRID", "MIN_SOLVE_SECONDS", "default_granularity", "plan_any_length"]

MAX_DEFAULT_GRID = 1024
"""Grid points (``⌈L / granularity⌉``) the default granularity keeps at most."""

MIN_SOLVE_SECONDS = 0.05
"""Seconds the solver gets when pricing used up the time limit (its first incumbent)."""


def default_granularity(tokens: int) -> int:
    """The grid step for ``tokens``: the smallest power of two giving at most 64 grid points,
    at most 128 unless that gives more than :data:`MAX_DEFAULT_GRID` points."""
    g = 1 << max(0, math.ceil(math.log2(max(1, tokens) / 64)))
    g = min(g, 128)
    while math.ceil(tokens / g) > MAX_DEFAULT_GRID:
        g *= 2
    return g


def plan_any_length(table_at: Callable[[int], CostTable], length: int, *,
                    granularity: int | None = None, num_stages: int | None = None,
                    time_limit: float = 10.0, workload: Workload | None = None,
                    bounds: tuple[int, ...] | None = None) -> Plan:
    """Plan ``length`` tokens on the grid of ``granularity`` (see the module docstring).

    Args:
        table_at: the cost table at a given length.
        length: tokens to plan for.
        granularity: grid step (default: :func:`default_granularity`).
        num_stages: stages (default: the planner chooses the devices).
        time_limit: seconds for everything after capture: pricing (``table_at``) and
            solving (see the module docstring).
        workload: causal prefill (default) or diffusion.
        bounds: chunk boundaries to use instead of the planned split (placement still
            planned).

    Raises:
        PlanError: ``length`` or ``granularity`` below 1.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise PlanError(f"seq_len={length!r} must be a positive number of tokens")
    if granularity is not None and (isinstance(granularity, bool)
                                    or not isinstance(granularity, int) or granularity < 1):
        raise PlanError(f"granularity={granularity!r} must be a positive number of tokens "
                        "(or None for the default)")
    deadline = time.perf_counter() + time_limit
    g = granularity or default_granularity(length)
    grid_len = math.ceil(length / g) * g
    table = table_at(length)  # searched as if it had grid_len tokens (module docstring)
    reserve = min(FINISH_RESERVE * time_limit, FINISH_RESERVE_MAX)  # packaging at L after it
    left = max(deadline - time.perf_counter() - reserve, MIN_SOLVE_SECONDS)
    grid = plan_from_costs(dataclasses.replace(table, seq_len=grid_len), workload=workload,
                           granularity=g, num_stages=num_stages, time_limit=left,
                           ranged=grid_len == length)  # else priced at L by _clip only
    return say_expired(_clip(table, grid, grid_len, length, g, bounds, workload,
                             time.perf_counter() < deadline), deadline)


def _clip(table: CostTable, grid: Plan, grid_len: int, length: int, g: int,
          bounds: tuple[int, ...] | None, workload: Workload | None, ranged: bool) -> Plan:
    """The plan of the ``grid_len`` grid at ``length`` tokens (priced on ``table``, the cost
    table at ``length``), with ``bounds`` if given (module docstring)."""
    if bounds is None:
        bounds = tuple(sorted({min(b, length) for b in grid.boundaries}))
    if grid_len == length and bounds == grid.boundaries:
        return grid
    cuts = (0, *(st.layer_end for st in grid.stages))
    chosen = tuple(st.device_index for st in grid.stages)
    names = [name for st in grid.stages for name in st.layer_names]  # blocks cut at a waist
    plan = plan_for(sub_table(table, chosen).with_layers(names), cuts, bounds,
                    workload, granularity=g, solver=grid.solver, ranged=ranged)
    stages = tuple(dataclasses.replace(st, device_index=old.device_index)
                   for st, old in zip(plan.stages, grid.stages))
    return dataclasses.replace(plan, stages=stages, notes=grid.notes)

