"""The path half of the placement-free bound: the first and last stage's chunks and one chunk
across every layer, on every (first stage, last stage) layer range.

Terms (grid ``x_0 = 0 < ... < x_n = L``; stage 0 runs layers ``[0, e)`` on device 0, the
last stage ``[f, N)`` on device ``S-1``):
    ``u[a, b]``: ``min`` (stage 0's, last stage's) time for chunk ``[x_a, x_b)``.
    ``v[a, b]``: ``u`` plus the chunk on layers ``[e, f)`` (fastest device per layer) plus every
        link: in any split, some chunk ``k`` leaves stage 0 after chunks ``≤ k`` ran there,
        crosses the middle, and the last stage then runs chunks ``≥ k``, so the plan takes at
        least ``Σ_i u_i + max_k v_k`` (as in :func:`tppc.planner.certify.split_bound`).
    ``F(T)``: least ``Σ u`` over splits whose chunks all have ``v ≤ T`` (a min-sum DP).
    path value: ``min`` over splits of ``Σ u + max v`` = ``min_T T + F(T)``. With thresholds
        ``T_0 < ... < T_m`` taken from the values of ``v`` (``T_0`` the least, ``T_m`` the
        largest), an optimum with ``max v`` in ``(T_i, T_{i+1}]`` costs at least
        ``T_i⁺ + F(T_{i+1})`` (``T_i⁺`` the next value of ``v`` above ``T_i``; ``F`` never
        increases), exactly so when no value lies between; one with ``max v = T_0`` costs
        ``T_0 + F(T_0)``. The least of those terms is a valid bound, refined where it is least
        (exact once the least term is).
"""

from __future__ import annotations

import itertools

import numpy as np

from tppc.cost_models.table import CostTable

__all__ = ["end_pairs_bound", "min_tiling_sum", "path_value", "range_sum"]

_ROUNDS = 12
"""Refinements of the least interval at most (each prices 15 more thresholds)."""


def range_sum(mats: list[np.ndarray], keys: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``Σ_{lo≤j<hi} mats[keys[j]]`` (layers with the same cost function share a matrix)."""
    counts = np.bincount(keys[lo:hi], minlength=len(mats))
    out = np.zeros_like(mats[0])
    for k in np.nonzero(counts)[0]:
        out += counts[k] * mats[k]
    return out


def min_tiling_sum(m: np.ndarray) -> np.ndarray:
    """Least ``Σ m`` over tilings of ``[0, n)`` for each of ``K`` matrices ``(K, n+1, n+1)``
    (:func:`tppc.planner.dp.min_sum_dp` batched, without the argmin)."""
    n = m.shape[1] - 1
    best = np.full((m.shape[0], n + 1), np.inf)
    best[:, 0] = 0.0
    for b in range(1, n + 1):
        best[:, b] = np.min(best[:, :b] + m[:, :b, b], axis=1)
    return best[:, n]


def path_value(u: np.ndarray, v: np.ndarray, stop: float = np.inf) -> float:
    """A lower bound on ``min`` over splits of ``Σ u + max v`` (module docstring).

    Args:
        u: sum-term chunk costs ``(n+1, n+1)``, ``inf`` where not a chunk.
        v: max-term chunk costs, ``inf`` where not a chunk.
        stop: refinement stops once the bound reaches this (it cannot matter above).
    """
    levels = np.unique(v[np.isfinite(v)])
    if levels.size == 0:
        return np.inf
    F: dict[int, float] = {}

    def price(idx: list[int]) -> None:
        idx = [i for i in idx if i not in F]
        if idx:
            m = np.where(v[None] <= levels[idx][:, None, None], u[None], np.inf)
            F.update(zip(idx, map(float, min_tiling_sum(m))))

    price(sorted({int(i) for i in np.linspace(0, levels.size - 1, 16)}))
    best = np.inf
    for _ in range(_ROUNDS + 1):
        pts = sorted(F)  # pts[0] == 0: max v == levels[0], else in (levels[i], levels[j]]
        terms = [levels[0] + F[0]] + [levels[i + 1] + F[j] for i, j in itertools.pairwise(pts)]
        k = int(np.argmin(terms))
        best = float(terms[k])
        if best >= stop or k == 0 or pts[k] == pts[k - 1] + 1:
            break  # cannot matter, or the least term is exact
        price([int(i) for i in np.linspace(pts[k - 1], pts[k], 17)[1:-1]])
    return best


def _layer_mats(table: CostTable, devices: list[int], x: np.ndarray
                ) -> tuple[list[np.ndarray], np.ndarray]:
    """Per layer, the least chunk-time matrix over ``devices`` (``inf`` off the chunks), as
    shared matrices and one key per layer."""
    n = x.size - 1
    a, b = np.triu_indices(n + 1, 1)
    one: dict[int, np.ndarray] = {}
    mats: dict[tuple[int, ...], int] = {}
    out: list[np.ndarray] = []
    keys = np.zeros(table.num_layers, dtype=int)
    for j in range(table.num_layers):
        fns = [table.layers[d][j].time for d in devices]
        key = tuple(sorted({id(fn) for fn in fns}))
        if key not in mats:
            for fn in fns:
                if id(fn) not in one:
                    m = np.zeros((n + 1, n + 1))
                    m[a, b] = np.broadcast_to(np.asarray(fn(x[b] - x[a], x[a]), dtype=float),
                                              a.shape)
                    one[id(fn)] = m
            mats[key] = len(out)
            out.append(np.min([one[i] for i in key], axis=0))
        keys[j] = mats[key]
    return out, keys


def end_pairs_bound(table: CostTable, num_stages: int, x: np.ndarray, priced: np.ndarray,
                    act: float) -> float:
    """``min`` over (first stage ``[0, e)``, last stage ``[f, N)``) of ``max`` (the least
    min-max of the stage values ``priced[s, lo, hi]`` with those ends, the path value).

    Args:
        table: the cost table (stage ``s`` on device ``s``).
        num_stages: ``S ≥ 2``.
        x: grid points.
        priced: ``(S, N+1, N+1)`` valid per-stage bounds (``inf`` where not a range).
        act: activation bytes per token priced on the links (at most any layer's).
    """
    S, N, n = num_stages, table.num_layers, x.size - 1
    a, b = np.triu_indices(n + 1, 1)
    off = np.ones((n + 1, n + 1), dtype=bool)
    off[a, b] = False
    hops = np.zeros((n + 1, n + 1))
    for lk in table.links[: S - 1]:
        hops[a, b] += np.asarray(lk.time(act * (x[b] - x[a])), dtype=float)
    pairs = []
    for e in range(1, N - S + 2):
        g = np.full(N + 1, np.inf)
        g[e] = priced[0, 0, e]
        for s in range(1, S - 1):  # the middle stages' min-max, from e
            g = np.min(np.maximum(g[:, None], priced[s]), axis=0)
        c = np.maximum(g, priced[S - 1, :, N])
        pairs += [(float(c[f]), e, f) for f in np.nonzero(np.isfinite(c))[0]]
    first, k0 = _layer_mats(table, [0], x)
    last, k1 = _layer_mats(table, [S - 1], x)
    mid, km = _layer_mats(table, list(range(1, S - 1)) or [0], x)
    best = np.inf
    for c, e, f in sorted(pairs):
        if c >= best:
            break
        u = np.minimum(range_sum(first, k0, 0, e), range_sum(last, k1, int(f), N))
        v = u + hops + (range_sum(mid, km, e, int(f)) if f > e else 0.0)
        u[off], v[off] = np.inf, np.inf
        best = min(best, max(c, path_value(u, v, stop=best)))
    return best
