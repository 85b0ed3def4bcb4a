"""A lower bound for pipelined diffusion steps that prices PipeFusion's ring against the
per-patch overhead.

Terms (``S ≥ 2`` stages on devices ``0..S-1``, layers ``0..N-1``, ``K`` pipelined steps, grid
``x_0 = 0 < ... < x_n = L``: multiples of the granularity, and ``L``):
    ``T_{d,j}[a, b]``: layer ``j``'s time on device ``d`` for the patch ``[x_a, x_b)``.
    cycle ``r[a, b]``: ``K·(Σ_j min_d T_{d,j}[a, b] + Σ_s link_s) + (K-1)·back``, links and the
        way back priced for the least activation bytes per token of any layer. In a
        diffusion plan patch ``i`` of step ``t + 1`` enters stage 0 only once patch ``i`` of
        step ``t`` has left the last stage and come back, so each patch crosses every layer
        and link ``K`` times one after the other: every plan takes at least ``max_i r_i``
        (after the warm-up steps). Few large patches make this long.
    work ``D_{s,j}(T)``: the least ``Σ_i T_{s,j}[patch i]`` over grid splits whose patches all
        have ``r ≤ T`` (a min-sum DP per distinct layer function). Many small patches make it
        long (every patch re-pays per-op and weight-read costs). Stage ``s`` on layers
        ``[lo, hi)`` runs every patch ``K`` times, after the first patch has crossed the
        layers before it and before the last patch crosses the layers after it, so a plan
        whose patches all have ``r ≤ T`` takes at least ``head(lo) + K·Σ_j D_{s,j}(T) +
        tail(hi)`` (heads and tails as in :mod:`tppc.planner.bounds`; the split's per-layer
        minimum never exceeds the split's own sum); ``W(T)``: the least max over contiguous
        placements of that (a min-max partition DP, exact).
    bound: every plan has some largest cycle ``r* = max_i r_i``, so it takes at least
        ``max(r*, W(r*))``; ``W`` never increases with ``T``. Over thresholds ``T_0 < ... <
        T_m`` (the values of ``r``), priced on a subset and refined where the least term is
        (as in :func:`tppc.planner.path_bound.path_value`), an optimum with ``r*`` in
        ``(T_i, T_j]`` costs at least ``max(T_{i+1}, W(T_j))``. The least of those terms is
        the bound.
"""

from __future__ import annotations

import itertools

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.planner.bounds import edge_costs
from tppc.planner.path_bound import min_tiling_sum
from tppc.planner.table_cache import TableCache

__all__ = ["RING_MAX_GRID", "ring_bound"]

RING_MAX_GRID = 256
"""Grid steps priced at most; above it :func:`ring_bound` returns 0 (no bound)."""

_ROUNDS = 12
"""Refinements of the least interval at most (each prices 15 more thresholds)."""

_CACHE: TableCache[float] = TableCache(size=8)
"""The last few results (:class:`TableCache`; keyed by stages, grid and steps too): a plan
prices many splits of one table."""


def ring_bound(table: CostTable, num_stages: int, granularity: int, steps: int) -> float:
    """``min`` over the largest cycle ``r*`` of ``max(r*, W(r*))`` (module docstring).

    Args:
        table: the cost table (stage ``s`` runs on device ``s``).
        num_stages: ``S``; below 2 there is no ring and the bound is 0.
        granularity: patches start on multiples of this many tokens.
        steps: pipelined steps ``K``.

    Returns:
        Seconds after the warm-up steps that every diffusion plan takes at least.
    """
    return _CACHE.get(table, num_stages, (granularity, steps),
                      lambda: _ring_bound(table, num_stages, granularity, steps))


def _ring_bound(table: CostTable, num_stages: int, granularity: int, steps: int) -> float:
    L = float(table.seq_len)
    g = float(min(granularity, table.seq_len))
    x = np.unique(np.minimum(np.arange(0.0, L + g, g), L))
    n, N, S = x.size - 1, table.num_layers, num_stages
    if S < 2 or N < S or steps < 1 or n > RING_MAX_GRID:
        return 0.0
    a, b = np.triu_indices(n + 1, 1)
    fns: dict[int, int] = {}  # id(time function) -> row of mats
    rows: list[np.ndarray] = []
    for lc in (lc for d in range(S) for lc in table.layers[d]):
        if id(lc.time) not in fns:
            fns[id(lc.time)] = len(rows)
            rows.append(np.broadcast_to(np.asarray(lc.time(x[b] - x[a], x[a]), dtype=float),
                                        a.shape))
    vals = np.array(rows)  # (F, chunks)
    key = np.array([[fns[id(lc.time)] for lc in table.layers[d]] for d in range(S)])  # (S, N)
    act = min((lc.act_bytes_per_token for d in range(S) for lc in table.layers[d]),
              default=0.0)
    size = x[b] - x[a]
    links = table.links[: S - 1]
    hops = sum((np.asarray(lk.time(act * size), dtype=float) for lk in links),
               np.zeros(a.size))
    back = np.min([np.asarray(lk.time(act * size), dtype=float) for lk in links], axis=0)
    cross = vals[key].min(axis=0).sum(axis=0)  # (chunks,): every layer, fastest device
    r = steps * (cross + hops) + (steps - 1) * back
    h, e, _work = edge_costs(table, S, granularity)
    head = np.concatenate([[0.0], np.cumsum(h)])
    tail = np.concatenate([np.cumsum(e[::-1])[::-1], [0.0]])
    levels = np.unique(r)
    W: dict[int, float] = {}

    def price(idx: list[int]) -> None:
        idx = [i for i in idx if i not in W]
        if not idx:
            return
        for lo in range(0, len(idx), 8):  # batches bound the memory
            part = idx[lo:lo + 8]
            m = np.full((len(part), vals.shape[0], n + 1, n + 1), np.inf)
            for k, i in enumerate(part):
                m[k][:, a, b] = np.where(r[None, :] <= levels[i], vals, np.inf)
            least = min_tiling_sum(m.reshape(-1, n + 1, n + 1)).reshape(len(part), -1)
            for k, i in enumerate(part):  # no split with r ≤ T: no plan has r* ≤ T
                W[i] = _placement(least[k][key], head, tail, steps) \
                    if np.isfinite(least[k]).all() else np.inf

    price(sorted({int(i) for i in np.linspace(0, levels.size - 1, 16)}))
    best = np.inf
    for _ in range(_ROUNDS + 1):
        pts = sorted(W)  # pts[0] == 0: r* == levels[0], else r* in (levels[i], levels[j]]
        terms = [max(levels[0], W[0])] + [max(levels[i + 1], W[j])
                                          for i, j in itertools.pairwise(pts)]
        k = int(np.argmin(terms))
        best = float(terms[k])
        if k == 0 or pts[k] == pts[k - 1] + 1:
            break  # the least term is exact
        price([int(i) for i in np.linspace(pts[k - 1], pts[k], 17)[1:-1]])
    return best if np.isfinite(best) else 0.0


def _placement(work: np.ndarray, head: np.ndarray, tail: np.ndarray, steps: int) -> float:
    """Least ``max_s head[lo] + steps·Σ work[s, lo:hi] + tail[hi]`` over contiguous
    placements of ``N`` layers on ``S`` stages (each at least one layer)."""
    S, N = work.shape
    lo, hi = np.meshgrid(np.arange(N + 1), np.arange(N + 1), indexing="ij")
    best = np.full(N + 1, np.inf)
    best[0] = 0.0
    for s in range(S):
        pre = np.concatenate([[0.0], np.cumsum(work[s])])
        cost = np.where(hi > lo, head[lo] + steps * (pre[hi] - pre[lo]) + tail[hi], np.inf)
        best = np.min(np.maximum(best[:, None], cost), axis=0)
    return float(best[N])
