"""Certified split search: the grid split of least simulated makespan for a fixed placement.

Terms (grid as in :mod:`tppc.planner.dp`; ``S`` stages, ``n`` grid steps):
    ``t[s][a, b]``: seconds stage ``s`` spends on chunk ``[a, b)`` (``inf``: not allowed).
    ``lk[s][a, b]``: seconds to send that chunk from stage ``s`` to ``s + 1``.
    label: the completion times ``C`` (one per stage) of the chunks tiling ``[0, a)``, the
        state of the flow shop (:mod:`tppc.program.schedule`) after them. Adding chunk
        ``[a, b)``: ``end_s = max(C_s, end_{s-1} + lk[s-1][a, b]) + t[s][a, b]``.
    dominance: a label whose times are all ≤ another's at the same position finishes every
        continuation no later (the recursion is monotone), so the other is dropped.
    suffix bound ``R_s[a]``: the least time stage ``s`` still needs for any tiling of
        ``[a, n)``, plus the last chunk's way through the later stages (a min-sum DP).
        A label is pruned when ``max_s C_s + R_s[a]`` is not below the incumbent.

Method: exact DP over (position, completion-time vector) with dominance and bound pruning,
seeded with an incumbent (TeraPipe's split refined locally). It either proves the best
split (``"optimal"``) or stops at its deadline or label cap (``"time_limit"`` /
``"label_limit"``) and returns the incumbent. :func:`split_bound` states the gap: a lower
bound on the makespan of every split of the placement (TeraPipe's DP on a relaxation).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from tppc.planner.dp import min_sum_dp, terapipe_dp

__all__ = ["MAX_LABELS", "SearchResult", "search_split", "split_bound", "suffix_bounds"]

MAX_LABELS = 4096
"""Labels kept at one position at most; beyond it the search stops (``"label_limit"``)."""


@dataclass(frozen=True)
class SearchResult:
    """Outcome of :func:`search_split`.

    Attributes:
        bounds: best grid boundaries found (the incumbent if nothing beat it).
        makespan: their simulated makespan.
        status: ``"optimal"`` (proven), ``"time_limit"`` or ``"label_limit"``.
        labels: labels expanded.
    """

    bounds: tuple[int, ...]
    makespan: float
    status: str
    labels: int


def _edges(t: list[np.ndarray], lk: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(head[s], tail[s])``: the first chunk ``[0, b)`` reaching stage ``s`` (row ``b``)
    and the last chunk ``[a, n)`` leaving it (row ``a``): the only parts of the whole
    ``(n+1, n+1)`` matrices the bounds read (building those took seconds at 1024 points)."""
    num_stages, n = len(t), t[0].shape[0] - 1
    head = [np.zeros(n + 1)]
    for s in range(1, num_stages):
        head.append(head[-1] + t[s - 1][0, :] + lk[s - 1][0, :])
    tail = [np.zeros(n + 1)]
    for s in range(num_stages - 2, -1, -1):
        tail.append(tail[-1] + t[s + 1][:, n] + lk[s][:, n])
    return np.array(head), np.array(tail[::-1])


def suffix_bounds(t: list[np.ndarray], lk: list[np.ndarray]) -> np.ndarray:
    """``R[s, a]``: least ``Σ t_s`` over tilings of ``[a, n)`` plus the last chunk's tail."""
    _head, tail = _edges(t, lk)
    n = t[0].shape[0] - 1
    out = np.zeros((len(t), n + 1))
    for s in range(len(t)):
        m = t[s].copy()
        m[:, n] += tail[s]  # the chunk ending at n is the last
        for a in range(n - 1, -1, -1):
            out[s, a] = np.min(m[a, a + 1:] + out[s, a + 1:])
    return out


def split_bound(t: list[np.ndarray], lk: list[np.ndarray], deadline: float | None = None
                ) -> float:
    """A lower bound on the makespan of every grid split of this placement.

    The largest of: per stage ``s``, the least (first chunk reaching ``s``) + ``Σ t_s`` +
    (last chunk leaving ``s``) over splits (a min-sum DP); and the path that runs stage 0
    up to chunk ``k``, crosses every stage at chunk ``k`` and runs the last stage from ``k``:
    ``≥ Σ_i u_i + max_k v_k`` with ``u = min(t_0, t_{S-1})``, ``v = u + Σ_{0<r<S-1} t_r +
    Σ lk``, minimised exactly by TeraPipe's DP (``S = 2`` in its objective).
    """
    head, tail = _edges(t, lk)
    n = t[0].shape[0] - 1
    best = 0.0
    for s in range(len(t)):
        m = t[s].copy()
        m[0, :] += head[s]
        m[:, n] += tail[s]
        best = max(best, min_sum_dp(m)[0])
    if len(t) > 1:
        u = np.minimum(t[0], t[-1])
        v = u + sum(t[1:-1], np.zeros_like(u)) + sum(lk, np.zeros_like(u))
        sol = terapipe_dp(u, v, 2, deadline=deadline)
        if sol.complete:
            best = max(best, sol.objective)
    return float(best)


def search_split(
    t: list[np.ndarray],
    lk: list[np.ndarray],
    incumbent: tuple[int, ...],
    *,
    deadline: float,
    max_labels: int = MAX_LABELS,
) -> SearchResult:
    """The grid split of least flow-shop makespan (see the module docstring).

    Args:
        t: ``S`` stage matrices ``(n+1, n+1)``.
        lk: ``S - 1`` link matrices.
        incumbent: grid boundaries of a known split (returned unless beaten).
        deadline: ``time.perf_counter()`` value to stop at.
        max_labels: labels per position at most.
    """
    num_stages, n = len(t), t[0].shape[0] - 1
    best_bounds, best = tuple(incumbent), _makespan(t, lk, incumbent)
    if time.perf_counter() > deadline:  # not even the suffix bounds (S·n² work)
        return SearchResult(best_bounds, best, "time_limit", 0)
    R = suffix_bounds(t, lk)
    cut = best * (1 - 1e-12)
    # per position: list of (C array (K, S), parent position array, parent index array)
    pools: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n + 1)]
    kept: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * (n + 1)
    pools[0].append((np.zeros((1, num_stages)), np.array([-1]), np.array([-1])))
    expanded, status, final = 0, "optimal", None
    for a in range(n):
        if not pools[a]:
            continue
        if time.perf_counter() > deadline:
            status = "time_limit"
            break
        C, pa, pi = (np.concatenate(x) for x in zip(*pools[a]))
        keep = _pareto(C)
        C, pa, pi = C[keep], pa[keep], pi[keep]
        if C.shape[0] > max_labels:
            status = "label_limit"
            break
        kept[a] = (C, pa, pi)
        pools[a] = []
        expanded += C.shape[0]
        bs = np.arange(a + 1, n + 1)
        prev = np.full((C.shape[0], bs.size), -np.inf)
        for s in range(num_stages):
            arrive = prev + (lk[s - 1][a, bs] if s else 0.0)
            prev = np.maximum(C[:, s:s + 1], arrive) + t[s][a, bs]
            if s == 0:
                ends = [prev]
            else:
                ends.append(prev)
        E = np.stack(ends, axis=-1)  # (K, nb, S)
        lb = np.max(E + R[:, bs].T[None, :, :], axis=-1)
        ok = np.isfinite(lb) & (lb < cut)
        for j, b in enumerate(bs):
            rows = np.nonzero(ok[:, j])[0]
            if rows.size == 0:
                continue
            if b == n:
                k = rows[np.argmin(E[rows, j, -1])]
                best, cut = float(E[k, j, -1]), float(E[k, j, -1]) * (1 - 1e-12)
                final = (a, int(k))
            else:
                pools[b].append((E[rows, j, :], np.full(rows.size, a), rows))
    if final is not None:
        best_bounds = _walk(kept, *final, n)
    return SearchResult(best_bounds, best, status, expanded)


def _walk(kept, a: int, k: int, n: int) -> tuple[int, ...]:
    out = [n]
    while a >= 0:
        out.append(a)
        _C, pa, pi = kept[a]
        a, k = int(pa[k]), int(pi[k])
    return tuple(reversed(out))


def _pareto(C: np.ndarray) -> np.ndarray:
    """Indices of the labels no other label dominates (of equal labels, the first)."""
    order = np.lexsort(C.T[::-1])
    C = C[order]
    out = []
    for lo in range(0, C.shape[0], 256):
        rows = C[lo:lo + 256]
        le = np.all(C[None, :, :] <= rows[:, None, :], axis=2)  # [i, j]: j dominates i
        eq = np.all(C[None, :, :] == rows[:, None, :], axis=2)
        idx = np.arange(lo, lo + rows.shape[0])[:, None]
        later_tie = eq & (np.arange(C.shape[0])[None, :] >= idx)
        out.append(~np.any(le & ~later_tie, axis=1))
    return order[np.concatenate(out)]


def _makespan(t: list[np.ndarray], lk: list[np.ndarray], bounds: tuple[int, ...]) -> float:
    end = np.zeros(len(t))
    for a, b in itertools.pairwise(bounds):
        prev = -math.inf
        for s in range(len(t)):
            arrive = prev + (lk[s - 1][a, b] if s else 0.0)
            prev = end[s] = max(end[s], arrive) + t[s][a, b]
    return float(end[-1])
