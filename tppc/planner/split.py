"""Optimal token split: where to cut one sequence into pipelined chunks.

Terms (see :mod:`tppc.planner.dp` for the grid and the objective):
    grid: chunk boundaries are multiples of the granularity ``g``; ``n = L / g`` points.
    split: grid bounds ``(0, b_1, ..., n)``; its objective is ``K·Σ m + (S-1)·max f``.

:func:`split_tokens` splits under a cost function, :func:`solve_split` under the chunk
matrices ``m`` and ``f``; both solve with TeraPipe's DP (exact) or the MILP of
:mod:`tppc.planner.split_milp`, seeded with the DP's or the best uniform split.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from tppc.errors import PlanError
from tppc.planner.dp import SplitSolution, chunk_matrix, evaluate_split, terapipe_dp
from tppc.planner.provenance import SolverInfo
from tppc.planner.split_milp import solve_milp

__all__ = ["MAX_GRID_POINTS", "MILP_MAX_GRID", "TokenSplit", "solve_split", "split_tokens"]

MAX_GRID_POINTS = 4096
"""Largest ``seq_len / granularity`` the planner accepts (the chunk table is n²)."""

MILP_MAX_GRID = 128
"""``solver="auto"`` solves grids of more points with the (exact) DP alone: at ``n = 256``
the pruned MILP still has ~4500 binaries and HiGHS needs ~15 s to prove what the DP proves
in 0.06 s (see BENCHMARKS.md)."""

CostFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class TokenSplit:
    """The chosen chunks of one sequence.

    Attributes:
        boundaries: token offsets ``(0, b_1, ..., L)``; chunk ``i`` is
            ``[boundaries[i], boundaries[i+1])``.
        objective: ``K·Σ t_i + (S-1)·max t_i`` at these chunks (seconds).
        t_max: the max term.
        solver: provenance of the solve.
    """

    boundaries: tuple[int, ...]
    objective: float
    t_max: float
    solver: SolverInfo

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunk sizes in tokens."""
        return tuple(b - a for a, b in itertools.pairwise(self.boundaries))


def check_grid(seq_len: int, granularity: int) -> int:
    """Validate the grid and return ``n = seq_len / granularity``.

    Raises:
        PlanError: naming the bad value and a fix.
    """
    if granularity <= 0:
        raise PlanError(f"granularity={granularity} must be a positive number of tokens")
    if seq_len <= 0:
        raise PlanError(f"seq_len={seq_len} must be positive")
    if seq_len % granularity:
        lo = seq_len // granularity * granularity
        raise PlanError(
            f"seq_len={seq_len} is not a multiple of granularity={granularity}; pad the "
            f"sequence to {lo + granularity} or pick a granularity dividing {seq_len}"
        )
    n = seq_len // granularity
    if n > MAX_GRID_POINTS:
        raise PlanError(
            f"seq_len / granularity = {n} grid points exceeds {MAX_GRID_POINTS}; use "
            f"granularity >= {math.ceil(seq_len / MAX_GRID_POINTS)}"
        )
    return n


def split_tokens(
    cost: CostFn,
    seq_len: int,
    num_stages: int,
    *,
    granularity: int = 128,
    max_chunks: int | None = None,
    time_limit: float = 10.0,
    solver: Literal["auto", "milp", "dp"] = "auto",
    warm_start: Literal["dp", "uniform"] = "dp",
) -> TokenSplit:
    """Split a sequence into chunks minimising TeraPipe's latency ``Σ t_i + (S-1)·max t_i``.

        Args:
            cost: ``cost(c, p)``, vectorised over numpy arrays: the slowest stage's seconds for
                a chunk of ``c`` tokens after ``p`` prefix tokens.
            seq_len: sequence length ``L``; a multiple of ``granularity``.
            num_stages: pipeline stages ``S`` (≥ 1).
            granularity: chunk sizes are multiples of this many tokens.
            max_chunks: at most this many chunks (``None``: no limit).
            time_limit: seconds for the MILP; on expiry the incumbent is returned with status
                ``"time_limit"`` and its gap.
            solver: ``"milp"`` (PuLP, HiGHS or CBC), ``"dp"`` (TeraPipe's DP only), or
                ``"auto"``: the MILP unless the grid has more than
    :data:`MILP_MAX_GRID` points; then the DP's answer, which is
                exact too (its branch and bound proves optimality), is returned.
            warm_start: upper bound and start for the MILP: the exact DP (``"dp"``) or the best
                uniform split (``"uniform"``).

        Returns:
            The split, its objective and the solver's provenance.

        Raises:
            PlanError: bad ``seq_len``, ``granularity``, ``num_stages`` or ``max_chunks``.

        Example:
            >>> causal = lambda c, p: 1e-4 + c * (1 + (p + c / 2) / 2048) * 1e-6
            >>> split_tokens(causal, 2048, 4, granularity=256).chunks
            (512, 512, 256, 256, 256, 256)
    """
    n = check_grid(seq_len, granularity)
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages} must be at least 1")
    if max_chunks is not None and max_chunks < 1:
        raise PlanError(f"max_chunks={max_chunks} must be at least 1 (or None for no limit)")
    m = chunk_matrix(cost, n, granularity)
    bad = ~np.isfinite(m[np.triu_indices(n + 1, 1)]) | (m[np.triu_indices(n + 1, 1)] < 0)
    if bad.any():
        raise PlanError("cost(c, p) returned a negative or non-finite time; fix the cost")
    result = solve_split(
        m,
        m,
        num_stages,
        max_chunks=max_chunks,
        time_limit=time_limit,
        solver=solver,
        warm_start=warm_start,
    )
    bounds, objective, info = result
    return TokenSplit(
        boundaries=tuple(b * granularity for b in bounds),
        objective=objective,
        t_max=max(float(m[a, b]) for a, b in itertools.pairwise(bounds)),
        solver=info,
    )


def solve_split(
    m: np.ndarray,
    f: np.ndarray,
    num_stages: int,
    *,
    repeats: float = 1.0,
    max_chunks: int | None = None,
    time_limit: float = 10.0,
    solver: Literal["auto", "milp", "dp"] = "auto",
    warm_start: Literal["dp", "uniform"] = "dp",
) -> tuple[tuple[int, ...], float, SolverInfo]:
    """Minimise ``K·Σ m + (S-1)·max f`` over grid splits (the engine of :func:`split_tokens`).

    ``solver="milp"`` returns the MILP's own solution and the solver's own status: the start
    (DP or uniform) only seeds it (its objective prunes chunks that cannot beat it, and CBC
    gets it as an initial solution); the solver must still find and prove the optimum.

    Returns:
        ``(grid bounds, objective of those bounds, provenance)``; ``provenance.objective`` is
        the value the solver claims, ``provenance.bound`` its proven lower bound.

    Raises:
        PlanError: when no split satisfies ``max_chunks``, or the MILP is infeasible although
            the start is a feasible split (a broken model).
    """
    t0 = time.perf_counter()
    if solver == "dp" or warm_start == "dp":
        start = terapipe_dp(m, f, num_stages, repeats=repeats, max_chunks=max_chunks,
                            deadline=t0 + time_limit)
        how = f"terapipe-dp ({start.dps} DPs)"
    else:
        start = _best_uniform(m, f, num_stages, repeats, max_chunks)
        how = "uniform"
    if not math.isfinite(start.objective):
        raise PlanError(f"no split of the sequence into at most max_chunks={max_chunks} chunks")
    if solver == "auto":
        solver = "dp" if warm_start == "dp" and m.shape[0] - 1 > MILP_MAX_GRID else "milp"
    if solver == "dp":
        info = SolverInfo(
            solver="terapipe-dp",
            status="optimal" if start.complete else "time_limit",
            objective=start.objective,
            bound=start.objective if start.complete else -math.inf,
            gap=0.0 if start.complete else math.inf,
            seconds=time.perf_counter() - t0,
            detail=how,
        )
        return start.bounds, start.objective, info
    return solve_milp(m, f, num_stages, repeats, max_chunks, time_limit, start, how, t0)


def _best_uniform(
    m: np.ndarray, f: np.ndarray, num_stages: int, repeats: float, max_chunks: int | None
) -> SplitSolution:
    """Best split into ``k`` near-equal grid chunks over all ``k`` (an upper bound)."""
    n = m.shape[0] - 1
    best = SplitSolution((), math.inf, math.inf)
    for k in range(1, (max_chunks or n) + 1):
        bounds = tuple(sorted({round(i * n / k) for i in range(k + 1)}))
        value = evaluate_split(bounds, m, f, num_stages, repeats)
        if value < best.objective:
            best = SplitSolution(bounds, value, max(f[a, b] for a, b in itertools.pairwise(bounds)))
    return best
