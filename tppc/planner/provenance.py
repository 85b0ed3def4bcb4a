"""Provenance of a plan's solve: which solver, its status, bound and time.

Terms:
    objective: the value a solver minimised (seconds; a latency bound of the model).
    bound: a proven lower bound on that objective; gap: ``(objective - bound) / objective``.
    status: ``"optimal"``, ``"time_limit"`` (the incumbent when time ran out) or
        ``"heuristic"`` (no proof).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SolverInfo", "SplitSearch"]


@dataclass(frozen=True, kw_only=True)
class SolverInfo:
    """Provenance of a solve.

    Attributes:
        solver: e.g. ``"milp-highs"``, ``"milp-cbc"``, ``"terapipe-dp"``, ``"exhaustive"``.
        status: ``"optimal"``, ``"time_limit"`` (incumbent, see ``gap``) or ``"heuristic"``.
        objective: the minimised objective (seconds; the latency bound of the model).
        bound: best proven lower bound on that objective.
        gap: relative gap ``(objective - bound) / objective``.
        seconds: wall-clock solve time.
        detail: free text (pruning statistics, decomposition rounds...).
    """

    solver: str
    status: str
    objective: float
    bound: float
    gap: float
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class SplitSearch:
    """The certified search over chunk boundaries for the plan's placement
    (:mod:`tppc.planner.certify`).

    Attributes:
        method: how the split was searched.
        status: ``"optimal"`` (no split of the placement simulates faster), ``"time_limit"``
            or ``"label_limit"`` (the best split found, see ``gap``).
        bound: lower bound on the latency of every split of this placement on the grid.
        gap: ``(latency - bound) / latency``.
        seconds: wall-clock time of the search.
    """

    method: str
    status: str
    bound: float
    gap: float
    seconds: float
