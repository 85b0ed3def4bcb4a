"""One place that runs a PuLP model: solver choice, time limit, warm start, provenance.

HiGHS (through ``highspy``) is used when it is installed, CBC otherwise. Every solve has a
time limit; when it is hit the incumbent comes back with status ``"time_limit"`` and the
relative gap between the incumbent and the best bound.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Literal

import pulp

__all__ = ["SolveOutcome", "SolveStatus", "available_solver", "solve", "variable"]

SolveStatus = Literal["optimal", "time_limit", "infeasible", "no_solution"]


@dataclass(frozen=True)
class SolveOutcome:
    """What a MILP solve returned.

    Attributes:
        solver: ``"highs"`` or ``"cbc"``.
        status: ``"optimal"``, ``"time_limit"`` (incumbent returned), ``"infeasible"``, or
            ``"no_solution"`` (limit hit before any incumbent).
        objective: objective of the returned solution (``inf`` when there is none).
        bound: best proven lower bound (equal to ``objective`` when optimal).
        gap: relative gap ``(objective - bound) / objective`` (0 when optimal).
        seconds: wall-clock seconds spent in the solver, model building excluded.
    """

    solver: str
    status: SolveStatus
    objective: float
    bound: float
    gap: float
    seconds: float


@functools.cache
def available_solver() -> str:
    """Name of the solver :func:`solve` will use: ``"highs"`` or ``"cbc"``.

    The first HiGHS model a process builds prints a banner from C code; it is built here once
    with the process' standard output pointed at /dev/null, so plans print only their own text.
    """
    if not pulp.HiGHS().available():
        return "cbc"
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return "highs"


def solve(
    prob: pulp.LpProblem,
    *,
    time_limit: float,
    warm_start: bool = False,
    rel_gap: float = 1e-7,
) -> SolveOutcome:
    """Solve ``prob`` (a minimisation) under a time limit.

    Args:
        prob: the model; variables set with ``setInitialValue`` seed the search when
            ``warm_start`` is True.
        time_limit: seconds; must be positive.
        warm_start: pass the variables' initial values to CBC. (HiGHS 1.16 reports wrong
            objectives after ``setSolution`` on these models, so it starts cold.) No cutoff
            is ever set: ``"infeasible"`` always means the model has no solution.
        rel_gap: relative MIP gap at which the solver stops. (The absolute gap is 1e-9:
            callers scale objectives to about 1, HiGHS's default 1e-6 would stop early.)

    Returns:
        The outcome; variable values are readable with ``pulp.value`` when it has a solution.
    """
    name = available_solver()
    t0 = time.perf_counter()
    if name == "highs":
        solver = pulp.HiGHS(
            msg=False, timeLimit=time_limit, gapRel=rel_gap, gapAbs=1e-9, threads=1
        )
        prob.solve(solver)
        seconds = time.perf_counter() - t0
        model = prob.solverModel
        hstatus = model.getModelStatus()
        info = model.getInfo()
        has_sol = info.primal_solution_status == 2
        objective = float(info.objective_function_value) if has_sol else math.inf
        bound = float(info.mip_dual_bound) if info.mip_node_count >= 0 else objective
        status_name = str(hstatus).rsplit(".", 1)[-1]
        if status_name == "kOptimal":
            return SolveOutcome(name, "optimal", objective, objective, 0.0, seconds)
        if status_name in ("kInfeasible", "kUnboundedOrInfeasible"):
            return SolveOutcome(name, "infeasible", math.inf, math.inf, math.inf, seconds)
        if not has_sol:
            return SolveOutcome(name, "no_solution", math.inf, bound, math.inf, seconds)
        return SolveOutcome(name, "time_limit", objective, bound, _gap(objective, bound), seconds)
    solver = pulp.PULP_CBC_CMD(
        msg=False, timeLimit=time_limit, gapRel=rel_gap, warmStart=warm_start
    )
    status = prob.solve(solver)
    seconds = time.perf_counter() - t0
    if status == pulp.LpStatusInfeasible:
        return SolveOutcome(name, "infeasible", math.inf, math.inf, math.inf, seconds)
    objective = pulp.value(prob.objective)
    if objective is None:
        return SolveOutcome(name, "no_solution", math.inf, -math.inf, math.inf, seconds)
    objective = float(objective)
    hit_limit = seconds >= 0.98 * time_limit or prob.sol_status != pulp.LpSolutionOptimal
    if hit_limit:
        return SolveOutcome(name, "time_limit", objective, -math.inf, math.inf, seconds)
    return SolveOutcome(name, "optimal", objective, objective, 0.0, seconds)


def _gap(objective: float, bound: float) -> float:
    """Relative gap of an incumbent against a lower bound (0 when they meet)."""
    if not math.isfinite(objective) or not math.isfinite(bound):
        return math.inf
    if objective <= 0:
        return 0.0 if objective <= bound else math.inf
    return max(0.0, (objective - bound) / abs(objective))


def variable(
    name: str, low: float | None = None, up: float | None = None, cat: str = "Continuous"
) -> pulp.LpVariable:
    """``pulp.LpVariable`` without PuLP 3's deprecation warning (the 2.x API we support)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.LpVariable(name, low, up, cat=cat)
