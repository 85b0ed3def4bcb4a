"""The token split as a MILP (the exact solver behind ``solver="milp"`` of :mod:`.split`).

Terms (see :mod:`tppc.planner.dp` for the grid and the objective ``K·Σ m + (S-1)·t_max``):
    levels: the distinct max-term costs ``f(a, b)`` of the candidate chunks, above which
        ``t_max`` never needs to go (``t_max ≤ (UB - K·min Σ m) / (S-1)``).
    bucket ``β = (lo, hi]``: a range of ``t_max``; the buckets cut the levels into at most
        16 runs of about equal count (the first open below). A bucket holds the chunks
        whose ``f ≤ hi`` that survive its pruning.
    ``z_β``: 1 for the one bucket that holds ``t_max`` (``Σ_β z_β = 1``).
    ``y_β[a, b]``: 1 when chunk ``[a·g, b·g)`` is used in bucket ``β``; flow constraints make
        the chosen chunks tile ``[0, L)`` with flow ``z_β``.
    ``t_β``: the bucket's ``t_max``: ``t_β ≥ f(a, b)·y_β[a, b]``, ``lo·z_β ≤ t_β ≤ hi·z_β``.

The naive model (one ``t_max ≥ t·y`` row per chunk over all ``n(n+1)/2`` chunks) takes
minutes at ``L = 32768, g = 128``. Three things make it fast and keep it exact:

1. An upper bound ``UB`` first (TeraPipe's DP, exact and cheap, or the best uniform split).
2. Pruning, per bucket: with ``F(a)`` / ``G(b)`` the cheapest tilings of ``[0, a)`` and
   ``[b, L)`` by the bucket's chunks, any split in it that uses chunk ``(a, b)`` costs at
   least ``K·(F(a) + m(a,b) + G(b)) + (S-1)·max(f(a,b), lo)``; chunks where that exceeds
   ``UB`` cannot be in an optimal split and are dropped (this subsumes TeraPipe's
   ``t > UB/S`` rule), and so are buckets left with none.
3. Disaggregation by ``t_max`` bucket (:func:`solve_milp`): each bucket's relaxation is a
   shortest-path LP (integral) up to its ``t_max`` range, so the LP bound is tight; and a
   warm start from the bound's split, in the bucket that holds its ``t_max``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import pulp

from tppc.errors import PlanError
from tppc.planner._solver import available_solver, solve, variable
from tppc.planner.dp import SplitSolution, evaluate_split
from tppc.planner.provenance import SolverInfo

__all__ = ["solve_milp"]


def _reach(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``F[a]``: cheapest Σ m tiling ``[0, a)``; ``G[b]``: cheapest tiling ``[b, n)``."""
    n = m.shape[0] - 1
    fwd = np.full(n + 1, np.inf)
    bwd = np.full(n + 1, np.inf)
    fwd[0] = bwd[n] = 0.0
    for b in range(1, n + 1):
        fwd[b] = np.min(fwd[:b] + m[:b, b])
    for a in range(n - 1, -1, -1):
        bwd[a] = np.min(m[a, a + 1 :] + bwd[a + 1 :])
    return fwd, bwd


@dataclass(frozen=True)
class _Bucket:
    """A ``t_max`` range ``(lo, hi]`` and the chunks that may appear when ``t_max`` is in it."""

    lo: float
    hi: float
    chunks: tuple[tuple[int, int], ...]


def _buckets(
    m: np.ndarray, f: np.ndarray, num_stages: int, repeats: float, ub: float, count: int
) -> list[_Bucket]:
    """Split the ``t_max`` range into ``count`` buckets and prune each (see module doc)."""
    s1 = num_stages - 1
    n = m.shape[0] - 1
    finite = np.isfinite(m) & np.isfinite(f)
    levels = np.unique(f[finite])
    _, base = _reach(np.where(finite, m, np.inf))
    if s1 > 0:  # t_max ≤ (UB - K·min Σ m) / (S-1)
        levels = levels[levels <= (ub - repeats * base[0]) / s1 * (1 + 1e-12)]
    edges = np.unique(
        levels[np.linspace(0, levels.size - 1, min(count, levels.size) + 1).astype(int)]
    )
    a_idx, b_idx = np.triu_indices(n + 1, 1)
    out: list[_Bucket] = []
    lows = [-math.inf, *edges[:-1].tolist()] if s1 > 0 else [-math.inf]
    highs = edges.tolist() if s1 > 0 else [float(levels[-1])]
    for lo, hi in zip(lows, highs):
        allowed = np.where(finite & (f <= hi), m, np.inf)
        fwd, bwd = _reach(allowed)
        floor = max(lo, 0.0) if math.isfinite(lo) else 0.0
        bound = repeats * (fwd[a_idx] + allowed[a_idx, b_idx] + bwd[b_idx]) + s1 * np.maximum(
            f[a_idx, b_idx], floor
        )
        keep = np.isfinite(bound) & (bound <= ub)
        if keep.any():
            out.append(_Bucket(lo, hi, tuple(zip(a_idx[keep].tolist(), b_idx[keep].tolist()))))
    return out


def solve_milp(
    m: np.ndarray,
    f: np.ndarray,
    num_stages: int,
    repeats: float,
    max_chunks: int | None,
    time_limit: float,
    start: SplitSolution,
    how: str,
    t0: float,
) -> tuple[tuple[int, ...], float, SolverInfo]:
    """MILP disaggregated by ``t_max`` bucket: one tiling flow per bucket, one bucket chosen.

    ``z_β`` picks bucket ``β = (lo, hi]``; ``y_β[a, b]`` tile the sequence with chunks whose
    ``f ≤ hi`` (flow ``z_β``); ``t_β ≥ f·y_β``, ``t_β ≥ lo·z_β``. Buckets whose bound
    ``K·minsum(hi) + (S-1)·lo`` exceeds the start's objective are dropped and, inside a
    bucket, chunks that cannot lie on a split at most as good as the start (the start itself
    is always kept, so the optimum stays in the model). Each bucket's relaxation is a
    shortest-path LP (integral) up to its ``t_max`` range, so the LP bound is tight.
    """
    n = m.shape[0] - 1
    scale = start.objective if start.objective > 0 else 1.0  # solve in units of the start
    m_s, f_s = m / scale, f / scale
    buckets = _buckets(m_s, f_s, num_stages, repeats, 1.0 + 1e-9, count=16)
    prob, y, z, tvars = _split_model(m_s, f_s, num_stages, repeats, max_chunks, buckets)
    _warm(start, buckets, f_s, z, y, tvars, scale)
    remaining = max(time_limit - (time.perf_counter() - t0), 0.05)
    out = solve(prob, time_limit=remaining, warm_start=True)
    detail = (f"{len(y)} chunk variables in {len(buckets)} t_max buckets "
              f"({(n + 1) * n // 2} candidate chunks), start {how}")
    if out.status == "infeasible":
        raise PlanError(
            f"the split MILP is infeasible although the start split {start.bounds} is feasible "
            f"({detail}); this is a bug in tppc.planner.split_milp: use solver='dp'"
        )
    bounds = None
    if out.status in ("optimal", "time_limit"):
        picked = sorted((a, b) for (_, a, b), var in y.items() if (var.value() or 0) > 0.5)
        bounds = _chain(picked, n)
        if bounds is None and out.status == "optimal":
            raise PlanError(f"the split MILP returned chunks {picked[:6]} that do not tile "
                            f"[0, {n}); this is a bug in tppc.planner.split_milp: use solver='dp'")
    claimed = out.objective * scale
    if bounds is None or (out.status != "optimal" and
                          evaluate_split(bounds, m, f, num_stages, repeats) > start.objective):
        bounds, claimed = start.bounds, start.objective  # no incumbent better than the start
        detail += "; returned the start (the solver had no better incumbent)"
    objective = evaluate_split(bounds, m, f, num_stages, repeats)
    bound = out.bound * scale if math.isfinite(out.bound) else -math.inf
    info = SolverInfo(
        solver=f"milp-{available_solver()}",
        status="time_limit" if out.status == "no_solution" else out.status,
        objective=claimed,
        bound=bound,
        gap=_rel_gap(objective, bound),
        seconds=time.perf_counter() - t0,
        detail=detail,
    )
    return bounds, objective, info


def _split_model(m_s, f_s, num_stages, repeats, max_chunks, buckets):
    """The bucketed split MILP: ``(problem, y, z, t)`` (see :func:`solve_milp`)."""
    n = m_s.shape[0] - 1
    prob = pulp.LpProblem("token_split", pulp.LpMinimize)
    z = [variable(f"z_{k}", cat="Binary") for k in range(len(buckets))]
    prob += pulp.lpSum(z) == 1
    y: dict[tuple[int, int, int], pulp.LpVariable] = {}
    tvars, objective_terms = [], []
    for k, bucket in enumerate(buckets):
        t_k = variable(f"t_{k}", 0)
        tvars.append(t_k)
        out_of: dict[int, list] = {i: [] for i in range(n + 1)}
        into: dict[int, list] = {i: [] for i in range(n + 1)}
        for a, b in bucket.chunks:
            var = y[k, a, b] = variable(f"y_{k}_{a}_{b}", cat="Binary")
            out_of[a].append(var)
            into[b].append(var)
            objective_terms.append(float(m_s[a, b]) * var)
        _max_term_rows(prob, t_k, bucket, f_s, y, k)
        prob += pulp.lpSum(out_of[0]) == z[k]
        for i in range(1, n):
            prob += pulp.lpSum(into[i]) == pulp.lpSum(out_of[i])
        if math.isfinite(bucket.lo):
            prob += t_k >= bucket.lo * z[k]
        prob += t_k <= bucket.hi * z[k]
    if max_chunks is not None:
        prob += pulp.lpSum(y.values()) <= max_chunks
    prob += repeats * pulp.lpSum(objective_terms) + (num_stages - 1) * pulp.lpSum(tvars)
    return prob, y, z, tvars


def _max_term_rows(prob, t_k, bucket: _Bucket, f_s: np.ndarray, y, k: int) -> None:
    """``t_k ≥ f[a, b]·y[k, a, b]`` for the bucket's chunks above its floor (the max term)."""
    for a, b in bucket.chunks:
        if f_s[a, b] > bucket.lo:
            prob += t_k >= float(f_s[a, b]) * y[k, a, b]


def _warm(start: SplitSolution, buckets, f: np.ndarray, z, y, tvars, scale: float) -> None:
    """Set the start split as the initial solution (in the bucket holding its ``t_max``)."""
    chosen = set(itertools.pairwise(start.bounds))
    home = next(
        (
            k
            for k, bk in enumerate(buckets)
            if bk.lo < start.t_max / scale <= bk.hi and chosen <= set(bk.chunks)
        ),
        None,
    )
    for k, var in enumerate(z):
        var.setInitialValue(1 if k == home else 0)
        tvars[k].setInitialValue(start.t_max / scale if k == home else 0.0)
    for (k, a, b), var in y.items():
        var.setInitialValue(1 if k == home and (a, b) in chosen else 0)


def _chain(picked: list[tuple[int, int]], n: int) -> tuple[int, ...] | None:
    """Grid bounds from the chosen chunks, or None when they do not tile ``[0, n)``."""
    nxt = dict(picked)
    bounds, at = [0], 0
    while at != n:
        if at not in nxt:
            return None
        at = nxt[at]
        bounds.append(at)
    return tuple(bounds)


def _rel_gap(objective: float, bound: float) -> float:
    if not math.isfinite(bound) or objective <= 0:
        return math.inf
    return max(0.0, (objective - bound) / objective)
