"""The phases that only improve a plan: when they stop, and the coarser grids.

Terms:
    improvement-only phase: after the split and placement search has a plan, the local
        moves and certified split search, the cuts inside blocks (:mod:`.joint`) and the
        coarser grids (:func:`try_coarser_grids`) each may find a faster plan, never a worse
        one; a plan is already complete without them.
    near its bound: ``plan.latency ≤ ratio · floor``, where ``floor`` is a lower bound of
        every plan the phases can return: the plan's own lower bound (any split and
        placement of whole layers), and when blocks may be cut at their waist the bound of
        the table whose blocks are all cut (finer layers allow every placement of whole
        ones, so its bound is below both). No plan the phases find is faster than
        ``floor``, so a plan near it is at most ``ratio - 1`` slower than any of them: they
        are skipped (:data:`NEAR_BOUND`; ``near_bound=1.0`` runs them all).
    finish reserve: the share of ``time_limit`` (at most half a second) kept back from the search for packaging the
        plan after it (pricing at the exact length, the bounds), so a search that runs to its
        deadline still returns within the limit (:func:`tppc.planner.grid.plan_any_length`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from tppc.cost_models.table import CostTable
from tppc.planner.evaluate import lower_bounds
from tppc.planner.plan import Plan
from tppc.planner.workload import Workload

__all__ = ["FINISH_RESERVE", "FINISH_RESERVE_MAX", "NEAR_BOUND", "NearBound", "try_coarser_grids"]

NEAR_BOUND = 1.03
"""Default ratio of a plan's latency to its lower bound below which the improvement-only
phases stop (the plan is at most 3 % slower than the best possible)."""

FINISH_RESERVE = 0.05
"""Share of the time limit kept from the search for packaging the plan after it (at most
:data:`FINISH_RESERVE_MAX` seconds)."""

FINISH_RESERVE_MAX = 0.5
"""Seconds kept from the search at most (:data:`FINISH_RESERVE`)."""


class NearBound:
    """The stopping rule of one search (module docstring): ``reached(plan)``, ``note(plan)``.

    Args:
        table: the search's cost table (stage ``s`` on device ``s``).
        num_stages: its stages.
        workload: its workload.
        granularity: its grid.
        ratio: stop at ``latency ≤ ratio · floor``; at most 1 never stops.
    """

    def __init__(self, table: CostTable, num_stages: int, workload: Workload,
                 granularity: int, ratio: float) -> None:
        self.table, self.num_stages, self.workload = table, num_stages, workload
        self.granularity, self.ratio = granularity, ratio
        self._parts: float | None = None

    def floor(self, plan: Plan) -> float:
        """A lower bound of ``plan`` and of every plan the phases can return from it."""
        if self._parts is None:
            names = [part.name for lc in self.table.layers[0] for part in (lc.parts or (lc,))]
            self._parts = float("inf") if len(names) == self.table.num_layers else max(
                lower_bounds(self.table.with_layers(names), self.num_stages, self.workload,
                             self.granularity, ranged=False))
        return min(plan.lower_bound, self._parts)

    def reached(self, plan: Plan) -> bool:
        """Whether ``plan`` is within the ratio of :meth:`floor` (the phases stop)."""
        return self.ratio > 1 and plan.latency <= self.ratio * self.floor(plan)

    def note(self, plan: Plan) -> Plan:
        """``plan`` with its solver detail saying the improvement phases were skipped."""
        note = f"; improvements skipped: within {self.ratio:g} of the lower bound"
        if note in plan.solver.detail:
            return plan
        return dataclasses.replace(plan, solver=dataclasses.replace(
            plan.solver, detail=plan.solver.detail + note))


def try_coarser_grids(best: Plan, seq_len: int, granularity: int, count: int, t0: float,
                  time_limit: float, stop: NearBound,
                  plan_on: Callable[[int, float], Plan]) -> Plan:
    """Plan on the grids ``2·g, 4·g, ...`` (``count`` of them) and keep the fastest.

    The split objective is an upper bound of the simulated makespan, so a finer grid can
    return a plan that simulates slower than a coarser one; every candidate is still a plan
    on the ``g`` grid, and keeps the finer grid's lower bound.

    Args:
        best: the plan on the ``granularity`` grid.
        seq_len: tokens (a coarser grid must divide it).
        granularity: the finer grid.
        count: coarser grids to try at most.
        t0: when the search of ``best`` started (``time.perf_counter``).
        time_limit: seconds from ``t0`` for everything.
        stop: the search's stopping rule (:class:`NearBound`).
        plan_on: ``plan_on(granularity, seconds)`` plans on a coarser grid.
    """
    first = time.perf_counter() - t0
    for k in range(1, count + 1):
        coarse, left = granularity * 2**k, t0 + time_limit - time.perf_counter()
        if seq_len % coarse or left <= 0:
            break
        if stop.reached(best):
            return stop.note(best)
        other = plan_on(coarse, min(left, max(0.5, first / 2)))  # smaller problems
        if other.latency < best.latency * (1 - 1e-9):
            detail = (f"{other.solver.detail.removesuffix('; stopped by the time limit')}; "
                      f"grid {coarse} simulated faster than {granularity}")
            best = dataclasses.replace(
                other, granularity=granularity, lower_bound=best.lower_bound,
                lower_bound_work=best.lower_bound_work, lower_bound_path=best.lower_bound_path,
                solver=dataclasses.replace(other.solver, detail=detail,  # status: this
                                           status=best.solver.status,  # search's, not the
                                           seconds=time.perf_counter() - t0),  # sub-budget's
                split=best.split and dataclasses.replace(  # the bound of the finer grid
                    best.split, gap=max(0.0, 1 - best.split.bound / other.latency)))
    return best
